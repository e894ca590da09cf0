"""A step's updates, written once for every algorithm: the trees that train, shared out over the ranks, the part's
passes and advantages, then its optimizer updates (clip, AdamW, schedule), averaged into the step's metrics.

    trees  = part.trained(batch.trees)            # e.g. GRPO skips the groups without a learning signal
    shards = Shards.of(trees, ranks, ...)         # this rank's part of them (all of them in one process)
    part.prepare(batch, shards)                   # old policy / reference / critic passes, the advantages
    for k in range(part.num_updates):
        zero the gradients; part.backward(k); clip over the policy (and critic); step their AdamW and schedules

The loop never asks which algorithm runs (`algorithms/`).
"""

from __future__ import annotations

import time

import torch

from ...tree import ReplayResult, forests
from ..policy import clip_grad_norm
from ..shards import Shards


def run_updates(part, batch, ranks, layout: str, max_grad_norm: float) -> dict:
    """The step's updates of `part` (an `algorithms.base.Algorithm`) on `batch` (module docstring), over `ranks`
    (None in one process) with parallel.layout `layout`; gradients clipped to `max_grad_norm` over the policy and
    the critic together. Returns the metrics: per update averaged (loss, grad_norm, learning_rate and the part's),
    the passes' (`time/logprob_s`: their seconds), the shard plan's (`dist/*`), the engine's schedule of the last
    update, and the sizes of the step's trie (`tree/*`: every group's rollouts as one engine call in one process
    would run them, a start that groups share counted once with engine.forest; micro-batches and ranks each run
    their own forest, recomputing the start: `dist/physical_tokens/rank*` counts what each rank ran)."""
    policy = part.policy
    models = [policy] + ([part.critic] if part.critic is not None else [])
    shards = Shards.of(part.trained(batch.trees), ranks, policy.model.config, layout)
    t0 = time.perf_counter()
    prepared = part.prepare(batch, shards)
    passes_s = time.perf_counter() - t0  # the no-grad passes: old policy, reference, critic values
    history, result = [], None
    for k in range(part.num_updates):
        for model in models:
            model.zero_grad()
        result, metrics = part.backward(k)
        grad_norm = clip_grad_norm(models, max_grad_norm)
        lr = policy.scheduler.get_last_lr()[0]
        for model in models:
            model.step()
        history.append({"loss": result.loss if result else 0.0, "grad_norm": grad_norm, "learning_rate": lr,
                        **metrics})
    out = {k: sum(h.get(k, 0.0) for h in history) / len(history) for k in history[-1]}
    out.update({**prepared, "time/logprob_s": passes_s})
    if shards.plan is not None:
        out.update(plan_metrics(shards.plan, ranks, policy))
    if isinstance(result, ReplayResult) and policy.method == "branchreplay":  # the last update's (schedule.py)
        out.update({"engine/schedule": result.schedule, "engine/shared_nodes_merged": result.shared_nodes_merged})
    trees = forests(batch.trees) if policy.engine.forest else batch.trees  # the step's trie: groups share starts
    stats = sum((t.stats for t in trees[1:]), trees[0].stats)
    out.update({"tree/logical_tokens": stats.logical_tokens, "tree/physical_tokens": stats.physical_tokens,
                "tree/token_ratio": stats.token_ratio})
    return out


def first_update_gradient(part, batch, ranks, layout: str = "auto") -> list:
    """The gradient of `part`'s first update on `batch`, before clipping (what `run_updates` steps with): every
    parameter of the policy, then of the critic, as a full (unsharded) tensor, zeros where none. Under torchrun
    every rank calls it and gets the reduced gradient. For checks: `branchreplay verify --nproc`, the tests."""
    models = [part.policy] + ([part.critic] if part.critic is not None else [])
    part.prepare(batch, Shards.of(part.trained(batch.trees), ranks, part.policy.model.config, layout))
    for model in models:
        model.zero_grad()
    part.backward(0)
    return [g.detach().clone() for model in models for g in (
        model.dp.full_grads() if model.dp is not None else
        [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.model.parameters()])]


def plan_metrics(plan, ranks, policy) -> dict:
    """dist/*: the world size, the plan's imbalance, recomputed positions, layout, bytes moved and positions per
    rank, and the FSDP2 mode."""
    return {"dist/world_size": ranks.world_size, "dist/imbalance": plan.imbalance,
            "dist/recomputed_positions": plan.recomputed_positions, "dist/layout": plan.layout,
            "dist/bytes_moved": max(plan.bytes_moved),
            **({"dist/fsdp_mode": policy.dp.mode} if policy.dp.mode else {}),
            **{f"dist/physical_tokens/rank{r}": n for r, n in enumerate(plan.physical_tokens)}}
