"""Where the time of the `make bench` grid's multi-turn row goes (issue 31 item 4; docs/benchmarks.md, "Multi-turn
against its FLOP ratio"): naive and branchreplay on the row's trajectories (bench Llama, float32, P=512, 4 turns of a
96-token reply and a 64-token tool output, fork 2,1,3), two warm-up calls each, then torch.profiler over two calls:
the ops by self CPU time, per method.

    .venv/bin/python scripts/multi_turn_profile.py --threads 2
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from branchreplay.bench.runner import BENCH_MODEL, trees_of
from branchreplay.bench.scenarios import agent_trajectories
from branchreplay.check.reference import naive_backward
from branchreplay.check.shapes import make_rollouts
from branchreplay.engine import replay_backward
from branchreplay.losses import GRPOLoss
from branchreplay.models import tiny_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=14, help="ops printed per method")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = tiny_model("llama", dtype=torch.float32, seed=0, **BENCH_MODEL)
    g = torch.Generator().manual_seed(0)
    rollouts = make_rollouts(agent_trajectories(512, 4, 96, 64, (2, 1, 3), 2048, g), g)
    trees, loss = trees_of(rollouts), GRPOLoss()
    methods = {"naive": lambda: naive_backward(model, rollouts, loss),
               "branchreplay": lambda: replay_backward(model, trees, loss)}
    for name, call in methods.items():
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            call()
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                call()
        print(f"===== {name} (two calls)")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
