"""A/B timing of replay_backward (default EngineConfig) on the `make bench` grid and the low-sharing tree-schedule
rows. Imports branchreplay from PYTHONPATH, so one process per version: point PYTHONPATH at each checkout's src in
turn (alternate the order, e.g. new, old, old, new). One JSON line per configuration: min / median of N calls after
2 warm-up calls.

    PYTHONPATH=/tmp/before/src .venv/bin/python scripts/ab_grid.py before 2 10
    PYTHONPATH=src .venv/bin/python scripts/ab_grid.py after 2 10
    PYTHONPATH=src .venv/bin/python scripts/ab_grid.py after 1 10 1     # only the multi-turn row

Arguments: label, torch threads, timed calls, and optionally a comma list of the configurations' indices below.
"""

import json
import sys
import time

import torch

import branchreplay
from branchreplay.bench.runner import BENCH_MODEL, trees_of
from branchreplay.bench.scenarios import Scenario
from branchreplay.reference.shapes import make_rollouts
from branchreplay.engine import replay_backward
from branchreplay.losses import GRPOLoss

try:
    from branchreplay.tiny_models import tiny_model
except ImportError:  # checkouts before the tiny models got a module of their own
    from branchreplay.models import tiny_model

label, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
model = tiny_model("llama", dtype=torch.float32, seed=0, **BENCH_MODEL)
loss = GRPOLoss()
scenarios = [Scenario("shared-prompt", 2048, generations=8, response_tokens=128),
             Scenario("multi-turn", 512, turns=4, reply_tokens=96, tool_tokens=64, branching=(2, 1, 3)),
             Scenario("tree-sampled", 1024, response_tokens=128, fork_schedule=((0, 2), (32, 4))),
             Scenario("shared-prompt", 64, generations=8, response_tokens=256),
             Scenario("shared-prompt", 256, generations=8, response_tokens=256)]
only = [int(i) for i in sys.argv[4].split(",")] if len(sys.argv) > 4 else range(len(scenarios))
for sc in [scenarios[i] for i in only]:
    g = torch.Generator().manual_seed(0)
    trees = trees_of(make_rollouts(sc.sequences(model.config.vocab_size, g), g))
    for _ in range(2):
        replay_backward(model, trees, loss)
        model.zero_grad(set_to_none=True)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        replay_backward(model, trees, loss)
        times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    times.sort()
    print(json.dumps({"version": label, "src": str(branchreplay.__file__), "threads": threads,
                      "config": f"{sc.name} {sc.label()}", "min": round(times[0], 4),
                      "median": round(times[len(times) // 2], 4)}), flush=True)
