"""What one pack's fixed cost, and a position's attention to a cached prefix, are worth in token positions: the
defaults of `EngineConfig.pack_overhead_tokens` and `EngineConfig.prefix_position_overhead`
(docs/notes/execution-stack.md, "Which shared nodes run once").

A prompt of --prompt-tokens with 8 children of S tokens each, every child a pack of its own (max_pack_tokens = S,
and max_batch_tokens = 1: children of one length would otherwise run as the rows of one batch), forward and
backward by the engine (pack_overhead_tokens 0: nothing merged), for S in --sizes, and the prompt alone (T0: one
rollout of the prompt and one token). The seconds per child pack, (T(S) - T0) / 8, fit c + a S: c
is a pack's fixed cost, a a position's; c / a is the overhead in positions.

The same 8 rollouts then run as the dense packed schedule (everything merged: each rollout of P + S tokens alone
in a pack of its own, attending to nothing cached). Its seconds per rollout fit c' + a' (P + S); a / a' - 1 is what
a child position costs beyond a standalone one (split prefix attention's second kernel, its merge and its
backward): `prefix_position_overhead`. Median of --repeats runs per size, sizes and schedules interleaved, after
one warm-up round.

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
from branchreplay.engine import EngineConfig, replay_backward
from branchreplay.engine.config import EVERY_SHARED_NODE
from branchreplay.losses import GRPOLoss
from branchreplay.models import load_model
from branchreplay.reference.shapes import make_rollouts, shared_prompt
from branchreplay.tiny_models import tiny_model
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
    schedules = {"tree": EVERY_SHARED_NODE, "dense": dict(pack_overhead_tokens=10**9)}
    times = {(S, k): [] for S in trees for k in schedules if S or k == "tree"}
    for round_ in range(a.repeats + 1):
        for S, kind in times:
            engine = EngineConfig(max_pack_tokens=max(S, 1) if kind == "tree" else a.prompt_tokens + S,
                                  max_batch_tokens=1, **schedules[kind])  # no [B, L] batches: a pack each
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            replay_backward(model, trees[S], GRPOLoss(), engine=engine)
            if round_:  # the first round warms up
                times[S, kind].append(time.perf_counter() - t0)
    t0 = statistics.median(times[0, "tree"])
    ys = [(statistics.median(times[S, "tree"]) - t0) / 8 for S in sizes]
    c, per_position = _fit(sizes, ys)
    dense = [statistics.median(times[S, "dense"]) / 8 for S in sizes]
    c_dense, per_dense_position = _fit([a.prompt_tokens + S for S in sizes], dense)
    print(f"{a.model or 'tiny bench llama'}, float32, {a.threads} threads, load average {os.getloadavg()[0]:.2f}; "
          f"prompt {a.prompt_tokens} + 8 children, median of {a.repeats}")
    for S, y, d in zip(sizes, ys, dense, strict=True):
        print(f"  child of {S:4d} tokens: {1e3 * y:8.2f} ms per child pack; the rollout alone {1e3 * d:8.2f} ms")
    print(f"prompt alone {1e3 * t0:.1f} ms; fit: {1e3 * c:.2f} ms per pack + {1e6 * per_position:.1f} us per position "
          f"-> a pack costs {c / per_position:.0f} positions")
    print(f"rollouts alone: {1e3 * c_dense:.2f} ms per pack + {1e6 * per_dense_position:.1f} us per position -> a "
          f"child position costs {per_position / per_dense_position - 1:+.3f} of a standalone one")


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = c + a x: (c, a)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - a * mx, a


if __name__ == "__main__":
    main()
