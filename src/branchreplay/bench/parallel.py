"""`branchreplay bench --nproc N`: one step of a scenario data-parallel on N local processes (gloo), side by side:

    naive           rank r runs rollouts r, r + N, ... each alone, then one gradient all-reduce
    prompt-sharing  rank r runs the same rollouts with their prompt once per rank (`reference.prompt_sharing`,
                    prefix-grouper when installed), then one gradient all-reduce
    branchreplay    trees to ranks by `engine.parallel.sharding`, the gradient reduced once
                    (`engine.parallel.distributed`)

and the shard plan for more ranks. A method's wall time: the slowest rank's, between two barriers. A naive rank
projected past `max_seconds`, and a prompt-sharing rank whose estimated peak exceeds its share of the memory, run a
sample of their rollouts scaled by FLOPs (`flops`), as `runner` does; such rows say estimated. Peak memory is not
recorded per rank.
Design notes: docs/benchmarks.md ("Distributed").
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch

from ..engine.parallel.distributed import free_port
from ..engine.parallel.sharding import shard
from ..reference import work as F
from ..reference.prompt_sharing import PROMPT_SHARING_LABELS, prefix_grouper_version
from ..tree import RolloutTree
from .runner import BENCH_MODEL, MODEL_LABEL
from .scenarios import Scenario

METHODS = ("naive", "prompt-sharing", "branchreplay")


def run_data_parallel(scenario: Scenario, nproc: int, strategy: str = "fsdp2", seed: int = 0,
                      max_seconds: float = 120.0, plan_ranks: int = 8) -> dict:
    """The three methods on `nproc` processes (one torch thread each). Returns {"model", "world_size", "strategy",
    "prompt_sharing" (its implementation), "rows": [{method, seconds, estimated, sample_rollouts, speedup,
    per_rank_seconds}] in METHODS order, "plan": the shard plan of
    the same tree on this world size and on `plan_ranks` ranks (per-rank physical tokens, predicted cost,
    imbalance, recomputed positions)}."""
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(nproc, port, scenario, strategy, seed, max_seconds, tmp), nprocs=nproc, join=True)
        reports = [json.loads(open(f"{tmp}/rank{r}.json").read()) for r in range(nproc)]
    rows = []
    for method in METHODS:
        per_rank = [r[method]["seconds"] for r in reports]
        rows.append({"method": method, "seconds": max(per_rank), "per_rank_seconds": per_rank,
                     "estimated": any(r[method]["estimated"] for r in reports),
                     "sample_rollouts": sum(r[method]["rollouts_run"] for r in reports)})
    for row in rows:
        row["speedup"] = rows[0]["seconds"] / row["seconds"]
    model = _model(seed)
    tree = RolloutTree(_rollouts(scenario, model.config.vocab_size, seed))
    return {"model": MODEL_LABEL, "scenario": scenario.label(), "world_size": nproc, "strategy": strategy,
            "prompt_sharing": PROMPT_SHARING_LABELS[_prompt_sharing_impl()].format(version=prefix_grouper_version()),
            "logical_tokens": tree.stats.logical_tokens, "physical_tokens": tree.stats.physical_tokens,
            "rows": rows, "plan": {n: _plan(tree, n, model.config) for n in sorted({nproc, plan_ranks})}}


def format_data_parallel(result: dict) -> str:
    """The rows and the plans as lines for people."""
    lines = [f"{result['model']}; {result['scenario']}: {result['logical_tokens']} logical, "
             f"{result['physical_tokens']} physical positions; {result['world_size']} processes, {result['strategy']}"]
    for r in result["rows"]:
        ranks = ", ".join(f"{s:.1f}" for s in r["per_rank_seconds"])
        lines.append(f"  {r['method']:<15} {r['seconds']:>9.1f} s{'*' if r['estimated'] else ' '} speedup "
                     f"{r['speedup']:>6.2f}   per rank: {ranks}")
    if any(r["estimated"] for r in result["rows"]):
        lines.append("  * estimated from a sample of each rank's rollouts, scaled by FLOPs")
    lines.append(f"  prompt-sharing: {result['prompt_sharing']}")
    for n, plan in result["plan"].items():
        if "skipped" in plan:
            lines.append(f"  plan on {n} ranks: skipped ({plan['skipped']})")
            continue
        for label, p in (("plan", plan), ("without a context-parallel prefix", plan["whole_or_split"])):
            lines.append(f"  {label} on {n} ranks: {p['layout']}, positions per rank {p['physical_tokens']}, "
                         f"imbalance {p['imbalance']:.2f}, {p['recomputed_positions']} positions recomputed, "
                         f"{max(p['bytes_moved']) / 2**20:.0f} MiB moved per rank, predicted "
                         f"{max(p['predicted_seconds']):.1f} s" + (f" ({p['why']})" if p["why"] else ""))
    return "\n".join(lines)


def _plan(tree: RolloutTree, ranks: int, config) -> dict:
    """The plan the engine takes (`sharding.shard`, layout "auto") and, under "whole_or_split", the plan without a
    context-parallel prefix (the layout before it existed), side by side."""
    try:
        plans = {layout: shard([tree], ranks, config, layout=layout) for layout in ("auto", "whole-or-split")}
    except ValueError as e:  # fewer rollouts than ranks and no prefix to share
        return {"skipped": str(e)}
    out = {}
    for layout, plan in plans.items():
        out[layout] = {"layout": plan.layout, "physical_tokens": plan.physical_tokens,
                       "predicted_gflop": [c / 1e9 for c in plan.costs], "imbalance": plan.imbalance,
                       "recomputed_positions": plan.recomputed_positions, "bytes_moved": plan.bytes_moved,
                       "predicted_seconds": plan.predicted_seconds, "why": plan.why}
    return {**out.pop("auto"), "whole_or_split": out["whole-or-split"]}


def _model(seed: int):
    from ..tiny_models import tiny_model

    return tiny_model("llama", dtype=torch.float32, seed=seed, **BENCH_MODEL)


def _rollouts(scenario: Scenario, vocab: int, seed: int):
    from ..reference.shapes import make_rollouts

    g = torch.Generator().manual_seed(seed)
    return make_rollouts(scenario.sequences(vocab, g), g)


def _prompt_sharing(model, mine, loss, shape, world: int) -> dict:
    """This rank's rollouts with their prompt once (`reference.prompt_sharing`), then the gradient
    all-reduce: {"seconds", "estimated", "rollouts_run"}. The first k rollouts whose estimated peak fits this
    rank's share of the available memory run (at least one); the time is scaled by FLOPs to all of them."""
    import torch.distributed as dist

    from ..engine.planner import available_memory_bytes
    from ..reference.memory import prompt_sharing_peak_bytes
    from ..reference.prompt_sharing import prompt_sharing_backward

    budget = 0.6 * (available_memory_bytes(model.device) or 2**62) / world
    k = len(mine)
    while k > 1 and prompt_sharing_peak_bytes(mine[:k], model.config, model.dtype) > budget:
        k -= 1
    dist.barrier()
    t0 = time.perf_counter()
    prompt_sharing_backward(model, mine[:k], loss, impl=_prompt_sharing_impl())
    seconds = time.perf_counter() - t0
    if k < len(mine):
        seconds *= F.prompt_sharing_work(mine).flops(shape) / F.prompt_sharing_work(mine[:k]).flops(shape)
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    t1 = time.perf_counter()
    dist.all_reduce(flat)
    return {"seconds": seconds + time.perf_counter() - t1, "estimated": k < len(mine), "rollouts_run": k}


def _prompt_sharing_impl() -> str:
    return "prefix-grouper" if prefix_grouper_version() else "equivalent"


def _worker(rank, world, port, scenario, strategy, seed, max_seconds, out):
    import torch.distributed as dist

    from ..engine.parallel.distributed import DataParallel, end_spawned_rank
    from ..engine.replay import replay_backward_sharded
    from ..losses import GRPOLoss
    from ..reference.naive import naive_backward

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    loss, report = GRPOLoss(), {}
    model = _model(seed)
    rollouts = _rollouts(scenario, model.config.vocab_size, seed)
    shape = F.ModelShape.of(model)
    mine = rollouts[rank::world]
    dist.barrier()
    t0, run = time.perf_counter(), 0
    for r in mine:  # naive data parallelism: this rank's rollouts, each alone
        naive_backward(model, [r], loss)
        run += 1
        elapsed = time.perf_counter() - t0
        if run < len(mine) and elapsed * len(mine) / run > max_seconds:
            break
    seconds = time.perf_counter() - t0  # this rank's compute; estimated: the sample's, scaled by FLOPs
    if run < len(mine):
        seconds *= F.naive_work(mine).flops(shape) / F.naive_work(mine[:run]).flops(shape)
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    t1 = time.perf_counter()
    dist.all_reduce(flat)  # the one gradient reduction of naive data parallelism
    seconds += time.perf_counter() - t1
    report["naive"] = {"seconds": seconds, "estimated": run < len(mine), "rollouts_run": run}
    model.zero_grad(set_to_none=True)
    report["prompt-sharing"] = _prompt_sharing(model, mine, loss, shape, world)
    dist.barrier()
    dp_model = _model(seed)
    dp = DataParallel(dp_model, strategy)
    dist.barrier()
    t0 = time.perf_counter()
    _, plan = replay_backward_sharded(dp, [RolloutTree(rollouts)], loss)
    dist.barrier()
    report["branchreplay"] = {"seconds": time.perf_counter() - t0, "estimated": False,
                              "rollouts_run": sum(len(t.rollouts) for t in plan.parts[rank])}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    end_spawned_rank()  # on success only, after its results are written (engine.parallel.distributed)
