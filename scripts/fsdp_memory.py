"""One GRPO step on N gloo processes under FSDP2 in its two modes, side by side in one run: gathered once per step
(full parameters and gradients during the step) and resharded (per layer, in lock-step): the peak parameter +
gradient bytes per rank (`bench.fsdp_memory.HeldBytes`) against the model's, the step time (the slowest rank's,
between barriers) and the gradient against one process. Prints one JSON object (docs/benchmarks.md, "FSDP2's two
modes: parameter and gradient bytes per rank").

    .venv/bin/python scripts/fsdp_memory.py --nproc 2 --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.multiprocessing as mp

from branchreplay.bench.fsdp_memory import HeldBytes
from branchreplay.bench.runner import BENCH_MODEL
from branchreplay.engine.parallel.distributed import free_port, param_bytes
from branchreplay.reference.shapes import make_rollouts, shared_prompt
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import RolloutTree

MODES = ("gather-once", "resharded")
GROUPS = [(400, 8, 64), (200, 8, 48), (120, 4, 32), (80, 4, 32), (60, 2, 24)]  # (prompt, rollouts, response)


def _model(layers: int):
    return tiny_model("llama", dtype=torch.float32, seed=0, **{**BENCH_MODEL, "num_hidden_layers": layers})


def _trees() -> list[RolloutTree]:
    g = torch.Generator().manual_seed(0)
    return [RolloutTree(make_rollouts(shared_prompt(P, G, R, BENCH_MODEL["vocab_size"], g), g)) for P, G, R in GROUPS]


def _worker(rank, world, port, args, tmp):
    import torch.distributed as dist

    from branchreplay.engine.parallel.distributed import DataParallel, end_spawned_rank
    from branchreplay.engine.replay import replay_backward_sharded
    from branchreplay.losses import GRPOLoss
    from branchreplay.reference.naive import max_rel_grad_err

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    expected = torch.load(os.path.join(tmp, "grads.pt"))
    report = {}
    for mode in MODES:
        model = _model(args.layers)
        dp = DataParallel(model, "fsdp2", mode=mode)
        with HeldBytes(dp) as held:
            held.sample()
            before = held.peak
            dist.barrier()
            t0 = time.perf_counter()
            result, plan = replay_backward_sharded(dp, _trees(), GRPOLoss())
            dist.barrier()
            seconds = time.perf_counter() - t0
        report[mode] = {"seconds": seconds, "peak_param_grad_bytes": held.peak, "before_step_bytes": before,
                        "grad_err": max_rel_grad_err(dp.full_grads(), expected),
                        "physical_tokens": plan.physical_tokens[rank]}
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    end_spawned_rank()  # after its results are written (engine.parallel.distributed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    from branchreplay.engine import replay_backward
    from branchreplay.losses import GRPOLoss

    torch.set_num_threads(1)
    model = _model(args.layers)
    replay_backward(model, _trees(), GRPOLoss())
    with tempfile.TemporaryDirectory() as tmp:
        torch.save([p.grad for p in model.parameters()], os.path.join(tmp, "grads.pt"))
        mp.spawn(_worker, args=(args.nproc, free_port(), args, tmp), nprocs=args.nproc, join=True)
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(args.nproc)]
    full, layer = param_bytes(model), param_bytes(model.model.layers[0])
    out = {"model": f"tiny llama, {args.layers} layers, hidden {BENCH_MODEL['hidden_size']}, float32",
           "world_size": args.nproc, "groups": GROUPS, "model_param_bytes": full, "layer_param_bytes": layer,
           "load_average": os.getloadavg(), "modes": {}}
    for mode in MODES:
        peak = max(r[mode]["peak_param_grad_bytes"] for r in ranks)
        out["modes"][mode] = {"seconds": max(r[mode]["seconds"] for r in ranks), "peak_param_grad_bytes": peak,
                              "peak_over_model_param_bytes": peak / full,
                              "grad_err": max(r[mode]["grad_err"] for r in ranks),
                              "per_rank": [r[mode] for r in ranks]}
    once, resharded = out["modes"]["gather-once"], out["modes"]["resharded"]
    out["resharded_over_gather_once"] = {
        "peak_bytes": resharded["peak_param_grad_bytes"] / once["peak_param_grad_bytes"],
        "seconds": resharded["seconds"] / once["seconds"]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
