"""The matrix products of one decoding step of SmolLM2-135M-Instruct for the demo's streams, against this machine's
peaks (issue 31 item 1; docs/benchmarks.md, "The sampler against the roofline"; the full figures:
docs/notes/2026-12-06-sampler-half-roofline.md).

A decoding step multiplies --prompts x --num-generations hidden states by each of the model's 211 weight matrices
(per layer q, k, v, o, gate, up, down; then the LM head), each read from memory once. This times those products,
float32, in the step's order ("streamed": what the sampler's step does) and the same products on one matrix of each
shape, over and over ("hot": the matrix stays in the caches, so only the arithmetic is timed), with each library
kernel the sampler could use: nn.Linear's sgemm (`F.linear`), MKL's packed sgemm (`packed_linears`: what the sampler
runs) and oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`). Methods and rounds alternate; medians of --repeats
rounds.

It prints this machine's peaks as `bench/roofline.py` measures them (matmul FLOP/s, copy bandwidth) and the read
bandwidth of a sum over the weights; then, per kernel, ms per step, GB/s of weights and GFLOP/s, against the
roofline's time for one step of the demo's batch (the larger of its FLOP and byte terms, `DecodeShape`) and twice
that, the whole step's budget at 50% of the roofline. Last, the sampler itself (`sample_groups`, cache
implementation auto: the plain Llama step) on the demo's batch (its first --prompts training prompts x G, no EOS,
--new-tokens each), its time per generated position split into the step's products (`decode.rows.llama._Linear`), its
attention (`grouped_prefix_attention`), the rest of the step (norms, rotary, residuals, cache writes, Python), the
draw (`decode.draw.draw`) and what runs outside the steps (the prefill, the packing, the streams' bookkeeping): each
timed by a wrapper around its calls (about a microsecond each), the median of --repeats calls.

    .venv/bin/python scripts/decode_gemms.py --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict
from unittest import mock

import torch
import torch.nn.functional as F

from branchreplay.bench.roofline import DecodeShape, Roofline, memory_bandwidth, peak_matmul_flops
from branchreplay.decode import loop as sampling
from branchreplay.decode import packed_linears
from branchreplay.decode.config import SamplingConfig
from branchreplay.decode.rows import llama as llama_rows
from branchreplay.models import load_policy
from branchreplay.rl.config import Config
from branchreplay.rl.data.tasks import load_task, prompt_token_ids


def step_matrices(model) -> list[torch.Tensor]:
    """The weights a decoding step multiplies by, in its order: [out, in] float32 each."""
    layers = [m.weight for layer in model.model.layers for m in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    return [w.detach().contiguous() for w in layers + [model.lm_head.weight]]


def kernels(matrices: list[torch.Tensor], rows: int) -> dict:
    """{name: product(x, index)}: x [rows, in] times matrices[index].T, by each library kernel."""
    packed = [packed_linears.pack(w, rows) for w in matrices] if packed_linears.available() else None
    out = {"F.linear (sgemm)": lambda x, i: F.linear(x, matrices[i])}
    if packed is not None:
        out["MKL packed (the sampler's)"] = lambda x, i: torch.ops.mkl._mkl_linear(x, packed[i], matrices[i], None,
                                                                                  rows)
    if torch.backends.mkldnn.is_available():
        out["oneDNN linear"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(x, matrices[i], None, "none", [], "")
    return out


def demo_prompts(tokenizer, prompts: int) -> list[list[int]]:
    """The default task's first `prompts` training prompts, chat-templated (the demo's first step)."""
    config = Config()
    train = load_task(config.task)[0]
    return [prompt_token_ids(tokenizer, train[i], config.task) for i in range(prompts)]


def sampler_split(model, batch: list[list[int]], G: int, new_tokens: int, repeats: int) -> dict[str, float]:
    """Seconds of one `sample_groups` call on `batch` x G (no EOS; median of `repeats`, after a warm-up), split into
    the parts of the module docstring: {part: seconds}, "call" the whole."""
    spent: dict[str, float] = defaultdict(float)

    def timed(part, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - t0
        return wrapper

    patches = [mock.patch.object(llama_rows._Linear, "__call__", timed("products", llama_rows._Linear.__call__)),
               mock.patch.object(llama_rows, "grouped_prefix_attention",
                                 timed("attention", llama_rows.grouped_prefix_attention)),
               mock.patch.object(llama_rows.LlamaRows, "decode", timed("step", llama_rows.LlamaRows.decode)),
               mock.patch.object(sampling, "draw", timed("draw", sampling.draw))]
    settings = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, cache_implementation="auto")
    calls = []
    for run in range(repeats + 1):
        spent.clear()
        generators = [torch.Generator().manual_seed(k) for k in range(len(batch))]
        for patch in patches:
            patch.start()
        try:
            call = seconds(functools.partial(sampling.sample_groups, model, batch, G, settings, {-1}, generators))
        finally:
            for patch in patches:
                patch.stop()
        if run:  # the first call warms up
            calls.append({"call": call, **spent})
    median = {part: statistics.median(c[part] for c in calls) for part in calls[0]}
    rest = median["step"] - median["products"] - median["attention"]
    return {"products": median["products"], "attention": median["attention"], "rest of the step": rest,
            "draw": median["draw"], "outside the steps": median["call"] - median["step"] - median["draw"],
            "call": median["call"]}


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=4, help="the sampler's prompts (the demo's prompts_per_step)")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48, help="tokens each stream decodes (the demo's max_new_tokens)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_policy("smollm2", "float32", "cpu")
    model.eval()
    batch = demo_prompts(tokenizer, args.prompts)
    rows, context = args.prompts * args.num_generations, round(sum(map(len, batch)) / len(batch))
    matrices = step_matrices(model)
    weight_bytes = sum(w.numel() for w in matrices) * 4
    flops = 2.0 * rows * sum(w.numel() for w in matrices)
    peak, copy = peak_matmul_flops(), memory_bandwidth()
    read = weight_bytes / min(seconds(lambda: [w.sum() for w in matrices]) for _ in range(args.repeats))
    shape = DecodeShape.of(model)
    step = max(shape.flops(rows, context) / peak, shape.bytes(rows, context) / copy)
    ceiling = Roofline.of(shape, rows, context, args.new_tokens, peak, copy)
    print(f"{torch.get_num_threads()} threads: peak float32 matmul {peak / 1e9:.0f} GFLOP/s, copy bandwidth "
          f"{copy / 1e9:.1f} GB/s, read bandwidth (sum over the weights) {read / 1e9:.1f} GB/s")
    print(f"a step of {rows} streams at {context} tokens of context: {len(matrices)} matrices, "
          f"{weight_bytes / 1e9:.2f} GB, {flops / 1e9:.1f} GFLOP in products; the roofline's step {step * 1e3:.1f} "
          f"ms, so 50% of the roofline allows {2 * step * 1e3:.1f} ms for the whole step; the products alone need at "
          f"least {flops / peak * 1e3:.1f} ms at the peak FLOP rate and {weight_bytes / read * 1e3:.1f} ms at the "
          "read bandwidth")
    x = {n: torch.randn(rows, n) for n in {w.shape[1] for w in matrices}}
    first = {}  # one matrix of each shape, for the hot rounds
    for i, w in enumerate(matrices):
        first.setdefault(tuple(w.shape), i)
    hot_order = [first[tuple(w.shape)] for w in matrices]
    runs = {}
    for name, product in kernels(matrices, rows).items():
        runs[(name, "streamed")] = lambda p=product: [p(x[w.shape[1]], i) for i, w in enumerate(matrices)]
        runs[(name, "hot")] = lambda p=product: [p(x[matrices[i].shape[1]], i) for i in hot_order]
    times = {key: [] for key in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for key, fn in runs.items():
            times[key].append(seconds(fn))
    print(f"{'kernel':28} {'weights':9} {'ms/step':>8} {'GB/s':>6} {'GFLOP/s':>8} {'of peak':>8}")
    for (name, how), values in times.items():
        t = statistics.median(values)
        print(f"{name:28} {how:9} {t * 1e3:8.1f} {weight_bytes / t / 1e9:6.1f} {flops / t / 1e9:8.0f} "
              f"{flops / t / peak:8.0%}")
    with torch.no_grad():
        split = sampler_split(model, batch, args.num_generations, args.new_tokens, args.repeats)
    positions, tokens = args.new_tokens - 1, rows * args.new_tokens
    rate = tokens / split["call"]
    print(f"sample_groups (auto) on {args.prompts} prompts x G={args.num_generations}, {args.new_tokens} tokens "
          f"each: {split['call']:.2f} s, {rate:.0f} tokens/s, {rate / ceiling.tokens_per_s:.1%} of the roofline's "
          f"{ceiling.tokens_per_s:.0f} tokens/s ({ceiling.bound}-bound); per decoding step ({positions} of them):")
    for part, value in split.items():
        if part != "call":
            print(f"  {part:18} {value * 1e3 / positions:6.1f} ms")


if __name__ == "__main__":
    main()
