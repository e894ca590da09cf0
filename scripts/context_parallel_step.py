"""One GRPO step of a shared-prompt tree in one process, then on N gloo processes with the prompt split over the ranks
(context-parallel, `engine/parallel/context_parallel.py`) and with today's split by branches (each rank recomputes the
prompt), side by side in one run; and the plans for 8 ranks. Prints one JSON object (docs/benchmarks.md, "The
headline step on 2 processes").

    .venv/bin/python scripts/context_parallel_step.py --prompt-tokens 32000 --generations 64 --response-tokens 768

Every process runs one torch thread (N processes on N cores against one process on one core). Times are between
barriers, the slowest rank's; gradients are compared with the one-process step (float32: relative error ~1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.multiprocessing as mp

from branchreplay.bench.runner import BENCH_MODEL, MODEL_LABEL
from branchreplay.engine.parallel.distributed import free_port
from branchreplay.engine.parallel.sharding import shard
from branchreplay.reference.shapes import make_rollouts, shared_prompt
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import RolloutTree

LAYOUTS = ("context-parallel", "whole-or-split")


def _tree(P: int, G: int, R: int) -> RolloutTree:
    g = torch.Generator().manual_seed(0)
    return RolloutTree(make_rollouts(shared_prompt(P, G, R, BENCH_MODEL["vocab_size"], g), g))


def _worker(rank, world, port, args, tmp):
    import torch.distributed as dist

    from branchreplay.engine.parallel.distributed import DataParallel, end_spawned_rank
    from branchreplay.engine.replay import replay_backward_sharded
    from branchreplay.losses import GRPOLoss
    from branchreplay.reference.naive import max_rel_grad_err

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    tree = _tree(args.prompt_tokens, args.generations, args.response_tokens)
    expected = torch.load(os.path.join(tmp, "grads.pt"))
    report = {}
    for layout in LAYOUTS:
        model = tiny_model("llama", dtype=torch.float32, seed=0, **BENCH_MODEL)
        dp = DataParallel(model, args.strategy)
        dist.barrier()
        t0 = time.perf_counter()
        _, plan = replay_backward_sharded(dp, [tree], GRPOLoss(), layout=layout)
        dist.barrier()
        seconds = time.perf_counter() - t0
        report[layout] = {"seconds": seconds, "layout": plan.layout, "grad_err": max_rel_grad_err(dp.full_grads(),
                                                                                                   expected)}
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    end_spawned_rank()  # after its results are written (engine.parallel.distributed)


def _plan(plan) -> dict:
    return {"layout": plan.layout, "positions_per_rank": plan.physical_tokens,
            "bytes_moved_per_rank": plan.bytes_moved, "predicted_seconds": plan.predicted_step_seconds,
            "recomputed_positions": plan.recomputed_positions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=32000)
    parser.add_argument("--generations", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=768)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp2", choices=("fsdp2", "ddp"))
    args = parser.parse_args()
    from branchreplay.engine import replay_backward
    from branchreplay.losses import GRPOLoss

    load_before = os.getloadavg()
    tree = _tree(args.prompt_tokens, args.generations, args.response_tokens)
    torch.set_num_threads(1)
    model = tiny_model("llama", dtype=torch.float32, seed=0, **BENCH_MODEL)
    t0 = time.perf_counter()
    replay_backward(model, tree, GRPOLoss())
    one = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        torch.save([p.grad for p in model.parameters()], os.path.join(tmp, "grads.pt"))
        mp.spawn(_worker, args=(args.nproc, free_port(), args, tmp), nprocs=args.nproc, join=True)
        reports = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(args.nproc)]
    rows = {"one process": {"seconds": one, "speedup": 1.0}}
    for layout in LAYOUTS:
        seconds = max(r[layout]["seconds"] for r in reports)
        rows[f"{args.nproc} processes, {reports[0][layout]['layout']}"] = {
            "seconds": seconds, "speedup": one / seconds, "grad_err": max(r[layout]["grad_err"] for r in reports)}
    plans = {f"{n} ranks, {layout}": _plan(shard([tree], n, model.config, layout=layout))
             for n in (args.nproc, 8) for layout in ("auto", "whole-or-split")}
    print(json.dumps({"model": MODEL_LABEL, "tree": {"P": args.prompt_tokens, "G": args.generations,
                                                     "R": args.response_tokens,
                                                     "logical": tree.stats.logical_tokens,
                                                     "unique": tree.stats.physical_tokens},
                      "strategy": args.strategy, "load_average_before": load_before,
                      "load_average_after": os.getloadavg(), "rows": rows, "plans": plans}, indent=1))


if __name__ == "__main__":
    main()
