"""A/B timing of replay_backward on the bench's multi-turn tree (P=512 turns=4 reply=96 tool=64 fork=2,1,3).
Imports branchreplay from PYTHONPATH; prints the per-call seconds of N calls after a warm-up."""
import json, sys, time
import torch
from branchreplay.bench.runner import BENCH_MODEL, trees_of
from branchreplay.bench.scenarios import Scenario
from branchreplay.check.shapes import make_rollouts
from branchreplay.engine import replay_backward
from branchreplay.losses import GRPOLoss
from branchreplay.models import tiny_model

label, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
model = tiny_model("llama", dtype=torch.float32, seed=0, **BENCH_MODEL)
sc = Scenario("multi-turn", 512, turns=4, reply_tokens=96, tool_tokens=64, branching=(2, 1, 3))
g = torch.Generator().manual_seed(0)
rollouts = make_rollouts(sc.sequences(model.config.vocab_size, g), g)
trees = trees_of(rollouts)
loss = GRPOLoss()
for _ in range(2):
    replay_backward(model, trees, loss); model.zero_grad(set_to_none=True)
times = []
for _ in range(n):
    t = time.perf_counter(); replay_backward(model, trees, loss); times.append(time.perf_counter() - t)
    model.zero_grad(set_to_none=True)
times.sort()
import branchreplay
print(json.dumps({"file": branchreplay.__file__[:22], "label": label, "threads": threads, "min": round(times[0], 4), "median": round(times[len(times)//2], 4), "all": [round(x, 3) for x in times]}))
