"""Sampling one step's groups several ways on SmolLM2-135M-Instruct (docs/benchmarks.md, "The sampler against the
roofline"):

  - per group: `decode.loop.sample_group` for each prompt in turn (the trainer before issue 15),
  - batched:   `decode.loop.sample_groups`, every group in one decoding loop (the trainer since), in the static cache
               (sampling.cache_implementation=static, the default on CUDA: its step a CUDA graph; also timed with
               enforce_eager there), each prompt held once or (where split prefix attention does not apply) in
               every row, and in the dynamic one, and with cache_implementation=auto (the default: on the CPU the
               plain Llama step of `decode.rows.llama.LlamaRows` where it applies),
  - TRL:       `model.generate` on the left-padded batch of prompts x G rows, as TRL's GRPOTrainer without vLLM.

Same prompts (the default task's first --prompts training questions, chat-templated, after --system-tokens tokens
of a shared start, a long system prompt's stand-in), temperature 1, no EOS (every row decodes --max-new-tokens
tokens, so all decode the same number of tokens). The methods alternate, --repeats times each, timed alone;
then one more run of each measures its peak memory (`bench.measure`: on the CPU the resident set's peak above its
start, polled by a thread that takes the GIL every millisecond, which slowed the Python-heavy samplers by up to
20%, so it is not timed). It prints the median wall seconds and the peak of each, and their ratios. With --roofline
it first measures this machine's peak matmul FLOP rate and memory bandwidth (`bench/roofline.py`) and prints the
batch's decoding ceiling in tokens/s and each sampler's share of it.

    .venv/bin/python scripts/sampling_time.py --prompts 4 --num-generations 8 --max-new-tokens 48 --roofline

On a GPU (scripts/gpu_check.sh): --device cuda --dtype bfloat16 --model FOLDER, the roofline then from the GPU's
own matmul rate in that dtype and its copy bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
from unittest import mock

import torch

from branchreplay.bench.measure import measure
from branchreplay.decode import rows as rows_module
from branchreplay.decode.config import SamplingConfig
from branchreplay.decode.loop import sample_group, sample_groups
from branchreplay.engine.attention import PrefixSplit
from branchreplay.models import load_policy
from branchreplay.rl.config import Config
from branchreplay.rl.data.tasks import load_task, prompt_token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=0, help="tokens of a start every prompt shares")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--roofline", action="store_true", help="measure the peaks and print the decoding roofline")
    ap.add_argument("--model", default="smollm2", help="a model spec (a folder of SmolLM2's shape on a GPU machine)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the parameters' dtype")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = Config()
    model, tokenizer = load_policy(args.model, "float32", args.device)
    model.to(getattr(torch, args.dtype))  # bfloat16: the parameters themselves, as an inference server holds them
    train = load_task(config.task)[0]
    system = (tokenizer("You can call these tools. ", add_special_tokens=False)["input_ids"] * args.system_tokens)
    prompts = [system[: args.system_tokens] + prompt_token_ids(tokenizer, train[i], config.task)
               for i in range(args.prompts)]
    ceiling = roofline(model, prompts, args.num_generations, args.max_new_tokens) if args.roofline else None
    methods = samplers(model, tokenizer, prompts, args.num_generations, args.max_new_tokens)
    times, peaks, failed = {name: [] for name in methods}, {}, {}
    with torch.no_grad():
        for run in range(args.repeats + 1):  # the last round measures the peaks (a thread polls the resident set)
            for name, fn in methods.items():
                if name in failed:
                    continue
                try:
                    if run < args.repeats:
                        times[name].append(measure(fn, model.device, memory=False).seconds)
                    else:
                        peaks[name] = measure(fn, model.device).peak_bytes
                except RuntimeError as e:  # e.g. a step that cannot be captured as a CUDA graph: the others still run
                    failed[name] = f"{type(e).__name__}: {e}"
    print(f"{args.prompts} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens x "
          f"G={args.num_generations}, {args.max_new_tokens} new tokens each, {args.dtype} on {model.device}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    report(times, peaks, failed, len(prompts) * args.num_generations * args.max_new_tokens, ceiling)


def roofline(model, prompts: list[list[int]], G: int, max_new_tokens: int):
    """This machine's peaks (measured before the samplers, with the same threads) and the batch's decoding ceiling
    (`bench/roofline.py`), printed; returns the `Roofline`."""
    from branchreplay.bench.roofline import DecodeShape, Roofline, memory_bandwidth, peak_matmul_flops

    device = model.device
    flops = peak_matmul_flops(4096 if device.type == "cuda" else 2048, model.dtype, device=device.type)
    bandwidth = memory_bandwidth(2048 if device.type == "cuda" else 512, device=device.type)
    shape = DecodeShape.of(model)
    mean_prompt = round(sum(map(len, prompts)) / len(prompts))
    ceiling = Roofline.of(shape, len(prompts) * G, mean_prompt, max_new_tokens, flops, bandwidth)
    print(f"peak {model.dtype} matmul {flops / 1e9:.0f} GFLOP/s, copy bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"({torch.get_num_threads()} threads); a step of {len(prompts) * G} streams at {mean_prompt} tokens: "
          f"{shape.flops(len(prompts) * G, mean_prompt) / 1e9:.1f} GFLOP, "
          f"{shape.bytes(len(prompts) * G, mean_prompt) / 1e9:.2f} GB; roofline "
          f"{ceiling.tokens_per_s:.0f} tokens/s ({ceiling.bound}-bound, {ceiling.seconds:.2f} s for the batch)")
    return ceiling


def samplers(model, tokenizer, prompts: list[list[int]], G: int, max_new_tokens: int) -> dict:
    """{name: a call that samples the batch}: the ways of the module docstring, every row running max_new_tokens."""
    device, no_eos, width = model.device, {-1}, max(map(len, prompts))

    def per_group():
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens)
        for k, p in enumerate(prompts):
            sample_group(model, p, G, sampling, no_eos, torch.Generator(device).manual_seed(k))

    def batched(**cache):
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens, **cache)

        def run():
            generators = [torch.Generator(device).manual_seed(k) for k in range(len(prompts))]
            sample_groups(model, prompts, G, sampling, no_eos, generators)
        return run

    def split_off(*args):  # a PrefixSplit that does not apply: the static rows hold each row's prompt
        split = PrefixSplit(*args)
        split.applies = False
        return split

    def stacked():  # the static cache with each prompt in every row: as where split prefix attention does not apply
        with mock.patch.object(rows_module, "PrefixSplit", split_off):
            batched(cache_implementation="static")()

    def trl_generate():
        rows = [p for p in prompts for _ in range(G)]
        ids = torch.tensor([[tokenizer.eos_token_id] * (width - len(p)) + p for p in rows], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
        torch.manual_seed(0)
        model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                       max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                       pad_token_id=tokenizer.eos_token_id)

    methods = {"per group (sample_group)": per_group, "batched, static cache": batched(cache_implementation="static"),
               "batched, static, prompt per row": stacked,
               "batched, dynamic cache": batched(cache_implementation="dynamic"),
               "batched, auto (plain step on CPU)": batched(cache_implementation="auto"),
               "TRL (model.generate, padded)": trl_generate}
    if device.type == "cuda":
        methods["batched, static, eager"] = batched(cache_implementation="static", enforce_eager=True)
    return methods


def report(times: dict, peaks: dict, failed: dict, tokens: int, ceiling) -> None:
    """One line per method: median wall seconds (timed without the memory poll), peak (one more run), against the
    static batched sampler, tokens/s and (with a `ceiling`) the share of the roofline."""
    base = statistics.median(times["batched, static cache"] or times["batched, dynamic cache"])
    for name, values in times.items():
        if name in failed:
            print(f"  {name:30} failed: {failed[name][:300]}")
            continue
        wall = statistics.median(values)
        share = f"  {tokens / wall / ceiling.tokens_per_s:6.1%} of the roofline" if ceiling is not None else ""
        print(f"  {name:32} {wall:7.2f} s  peak {peaks[name] / 2**20:7.0f} MiB  {wall / base:5.2f}x batched  "
              f"{tokens / wall:6.0f} tokens/s{share}")


if __name__ == "__main__":
    main()
