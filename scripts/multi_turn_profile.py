"""Where the time of the `make bench` grid's multi-turn and tree-sampled rows goes (issue 31 item 4;
docs/benchmarks.md, "Multi-turn against its FLOP ratio" and "The grid's rows split into matmuls, attention and the
rest"): naive and branchreplay on the rows' rollouts (bench Llama, float32; multi-turn P=512, 4 turns of a 96-token
reply and a 64-token tool output, fork 2,1,3; tree-sampled P=1024, R=128, fork 2@0,4@32), two warm-up calls each.

For each row and method: the best wall time of three calls, and one call under torch.profiler split into matrix
products (aten::mm: the linear layers and the LM head), the attention kernels (the CPU flash-attention forward and
backward) and the rest (elementwise ops, copies, autograd, Python-side op overhead), scaled to sum to the wall time,
and each as naive / branchreplay.
Then the row's FLOP ratio (`reference.work`) and what branchreplay would reach of it if each part ran at naive's own
speed per unit of work (matmuls per matmul FLOP, attention per attention FLOP, the rest per position): naive's parts
scaled by branchreplay's share of each, the "equal-rate bound" of its of-limit column. With --ops, the op tables of
the multi-turn row as well (self CPU time).

    .venv/bin/python scripts/multi_turn_profile.py --threads 2
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from branchreplay.reference import work as F
from branchreplay.bench.runner import BENCH_MODEL, trees_of
from branchreplay.bench.scenarios import agent_trajectories, tree_sampled
from branchreplay.reference.naive import naive_backward
from branchreplay.reference.shapes import make_rollouts
from branchreplay.engine import replay_backward
from branchreplay.losses import GRPOLoss
from branchreplay.tiny_models import tiny_model

ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ops", action="store_true", help="also print the multi-turn row's op tables")
    ap.add_argument("--rows", type=int, default=14, help="ops printed per method with --ops")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = tiny_model("llama", dtype=torch.float32, seed=0, **BENCH_MODEL)
    shape, loss = F.ModelShape.of(model), GRPOLoss()
    for row in ("multi-turn", "tree-sampled"):
        g = torch.Generator().manual_seed(0)
        sequences = (agent_trajectories(512, 4, 96, 64, (2, 1, 3), 2048, g) if row == "multi-turn"
                     else tree_sampled(1024, 128, ((0, 2), (32, 4)), 2048, g))
        rollouts = make_rollouts(sequences, g)
        trees = trees_of(rollouts)
        methods = {"naive": lambda: naive_backward(model, rollouts, loss),
                   "branchreplay": lambda: replay_backward(model, trees, loss)}
        parts = {name: split(model, call, args.ops and row == "multi-turn", args.rows, name)
                 for name, call in methods.items()}
        work = {"naive": F.naive_work(rollouts), "branchreplay": sum(map(F.tree_work, trees), F.NOTHING)}
        report(row, parts, work, shape)


def split(model, call, ops: bool, rows: int, name: str) -> tuple[float, float, float, float]:
    """(best wall seconds of 3 calls, and its matmul, attention and rest seconds: one profiled call's shares of its
    op time), after 2 warm-ups."""
    seconds = []
    for i in range(5):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        call()
        if i >= 2:
            seconds.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        model.zero_grad(set_to_none=True)
        call()
    events = p.key_averages()
    if ops:
        print(f"===== {name} (multi-turn, one call)")
        print(events.table(sort_by="self_cpu_time_total", row_limit=rows))
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    mm = sum(e.self_cpu_time_total for e in events if e.key == "aten::mm") / 1e6
    attention = sum(e.self_cpu_time_total for e in events if e.key in ATTENTION) / 1e6
    scale = min(seconds) / total  # the profiled parts scaled to sum to the wall time (the profiler adds to each op)
    return min(seconds), mm * scale, attention * scale, (total - mm - attention) * scale


def report(row: str, parts: dict, work: dict, shape: F.ModelShape) -> None:
    """The split of each method, the ratios, and the equal-rate bound (the module docstring)."""
    for name, (wall, mm, attention, rest) in parts.items():
        print(f"{row:13s} {name:13s} wall {wall:6.3f} s   matmul {mm:6.3f}  attention {attention:6.3f}  "
              f"rest {rest:6.3f} s")
    (wn, mn, an, rn), (wb, mb, ab, rb) = parts["naive"], parts["branchreplay"]
    n, b = work["naive"], work["branchreplay"]

    def linear(w: F.Work) -> int:  # the matmul FLOPs: the layers' and the LM head's
        return F.Work(w.positions, 0, w.head_rows).flops(shape)

    def keys(w: F.Work) -> int:  # the attention FLOPs
        return F.Work(0, w.attention_keys, 0).flops(shape)

    flop_ratio = n.flops(shape) / b.flops(shape)
    equal_rate = mn * linear(b) / linear(n) + an * keys(b) / keys(n) + rn * b.positions / n.positions
    print(f"{row:13s} naive / branchreplay: wall {wn / wb:.2f}  matmul {mn / mb:.2f} (matmul FLOPs "
          f"{linear(n) / linear(b):.2f})  attention {an / ab:.2f} (attention FLOPs {keys(n) / keys(b):.2f})  rest "
          f"{rn / rb:.2f} (positions {n.positions / b.positions:.2f})")
    print(f"{row:13s} FLOP ratio {flop_ratio:.2f}: of-limit {wn / wb / flop_ratio:.2f}; at naive's rate per unit of "
          f"each part {equal_rate:.3f} s, an of-limit of {wn / equal_rate / flop_ratio:.2f}")


if __name__ == "__main__":
    main()
