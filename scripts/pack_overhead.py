"""What one pack's fixed cost is worth in token positions: the default of `EngineConfig.pack_overhead_tokens`.

A prompt of --prompt-tokens with 8 children of S tokens each, every child a pack of its own (max_pack_tokens = S),
forward and backward by the engine (pack_overhead_tokens 0: nothing merged), for S in --sizes, and the prompt
alone (T0: one rollout of the prompt and one token). The seconds per child pack, (T(S) - T0) / 8, fit c + a S: c
is a pack's fixed cost, a a position's; c / a is the overhead in positions. Median of --repeats runs per size,
sizes interleaved, after one warm-up round.

    .venv/bin/python scripts/pack_overhead.py --threads 1
    .venv/bin/python scripts/pack_overhead.py --threads 2 --model smollm2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from branchreplay.bench.runner import BENCH_MODEL
from branchreplay.check.shapes import make_rollouts, shared_prompt
from branchreplay.engine import EngineConfig, replay_backward
from branchreplay.losses import GRPOLoss
from branchreplay.models import load_model, tiny_model
from branchreplay.tree import RolloutTree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model spec (default: the tiny bench Llama)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--sizes", default="2,8,32,128")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = tiny_model("llama", dtype=torch.float32, seed=0, **BENCH_MODEL) if a.model is None else \
        load_model(a.model, dtype=torch.float32)[0]
    sizes = [int(s) for s in a.sizes.split(",")]
    g = torch.Generator().manual_seed(0)
    trees = {S: RolloutTree(make_rollouts(shared_prompt(a.prompt_tokens, 8, S, model.config.vocab_size, g), g))
             for S in sizes}
    trees[0] = RolloutTree(make_rollouts(shared_prompt(a.prompt_tokens, 1, 1, model.config.vocab_size, g), g))
    times = {S: [] for S in trees}
    for k in range(a.repeats + 1):
        for S in trees:
            engine = EngineConfig(max_pack_tokens=max(S, 1), pack_overhead_tokens=0)
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            replay_backward(model, trees[S], GRPOLoss(), engine=engine)
            if k:  # the first round warms up
                times[S].append(time.perf_counter() - t0)
    t0 = statistics.median(times[0])
    xs, ys = sizes, [(statistics.median(times[S]) - t0) / 8 for S in sizes]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    a_ = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    c = my - a_ * mx
    print(f"{a.model or 'tiny bench llama'}, float32, {a.threads} threads, load average {os.getloadavg()[0]:.2f}; "
          f"prompt {a.prompt_tokens} + 8 children, median of {a.repeats}")
    for S, y in zip(xs, ys):
        print(f"  child of {S:4d} tokens: {1e3 * y:8.2f} ms per child pack")
    print(f"prompt alone {1e3 * t0:.1f} ms; fit: {1e3 * c:.2f} ms per pack + {1e6 * a_:.1f} us per position -> a "
          f"pack costs {c / a_:.0f} positions")


if __name__ == "__main__":
    main()
