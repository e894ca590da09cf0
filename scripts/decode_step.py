"""Where one decoding step of SmolLM2-135M-Instruct goes on this machine (docs/benchmarks.md, "Against the decoding
roofline"): --streams rows at --prompt-tokens positions, float32, greedy, nothing else running.

  1. torch.profiler over 5 steps (after the prefill) with transformers' DynamicCache (what `decode.loop.sample_groups`
     decodes with): the ops by self CPU time;
  2. the median step with DynamicCache, with transformers' StaticCache (preallocated, written in place; a 4-D mask
     hides the unwritten slots), both again with the linear layers' weights MKL-packed (`packed_linears`, what the
     sampler runs on the CPU), and with the StaticCache step under torch.compile (inductor; --compile), after its
     first (compiling) call;
  3. torch.profiler over 5 steps of the packed StaticCache step.

    .venv/bin/python scripts/decode_step.py --streams 32 --prompt-tokens 160 --new-tokens 48 --compile
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache, StaticCache

from branchreplay.models import load_policy
from branchreplay.decode.packed_linears import packed_linears


@torch.no_grad()
def decode(model, ids: torch.Tensor, new_tokens: int, static: bool, step=None, around=contextlib.nullcontext()
           ) -> list[float]:
    """Prefill `ids` [R, P], then `new_tokens` - 1 greedy steps (inside `around`); each step's seconds."""
    R, P = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=P + new_tokens) if static else \
        DynamicCache(config=model.config)
    logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    mask = torch.zeros(R, 1, 1, P + new_tokens, dtype=torch.bool) if static else None
    if static:
        mask[..., :P] = True
    step = step or (lambda t, p, m, c: model(input_ids=t, position_ids=p, attention_mask=m, cache=c,
                                             use_cache=True).logits[:, -1])
    times = []
    with around:
        for d in range(new_tokens - 1):
            if static:
                mask[..., P + d] = True
            t0 = time.perf_counter()
            logits = step(logits.argmax(-1, keepdim=True), torch.full((R, 1), P + d), mask, cache)
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=160)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--compile", action="store_true", help="also the StaticCache step under torch.compile")
    args = ap.parse_args()
    model, _ = load_policy("smollm2", "float32", "cpu")
    model.eval()
    ids = torch.randint(100, 1000, (args.streams, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    prof = profile(activities=[ProfilerActivity.CPU])
    decode(model, ids, 6, static=False, around=prof)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    ms = lambda times: f"{1000 * statistics.median(times):.0f} ms"  # noqa: E731
    print("DynamicCache, median step:", ms(decode(model, ids, args.new_tokens, static=False)))
    print("StaticCache, median step:", ms(decode(model, ids, args.new_tokens, static=True)))
    with packed_linears(model):
        print("DynamicCache, packed weights, median step:", ms(decode(model, ids, args.new_tokens, static=False)))
        print("StaticCache, packed weights, median step:", ms(decode(model, ids, args.new_tokens, static=True)))
        prof = profile(activities=[ProfilerActivity.CPU])
        decode(model, ids, 6, static=True, around=prof)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    if args.compile:
        step = torch.compile(lambda t, p, m, c: model(input_ids=t, position_ids=p, attention_mask=m, cache=c,
                                                      use_cache=True).logits[:, -1], dynamic=False)
        times = decode(model, ids, args.new_tokens, static=True, step=step)
        print(f"StaticCache compiled: first call {times[0]:.1f} s, median step {ms(times[1:])}")
        print("StaticCache compiled again, median step:", ms(decode(model, ids, args.new_tokens, static=True,
                                                                       step=step)))


if __name__ == "__main__":
    main()
