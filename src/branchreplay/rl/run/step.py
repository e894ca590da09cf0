"""One training step, read top to bottom: its phases in order, each timed as `time/<phase>_s`.

    sample      the step's rollouts, drawn with the current weights   rollouts/sampler.py -> decode/in_process.py
                                                                      (or rollouts/vllm/backend.py, rollouts/ahead.py)
    score       their rewards, gathered on every rank                  rollouts/sampler.py -> data/rewards.py
    trees       one prefix tree per group                              tree.py (`Batch.trees`)
    shard       the trees with a gradient, over the ranks              algorithms/<part>.trained, shards.py
    passes      old, reference and value logprobs, no graph            here -> policy.py -> engine
    advantages  the part's estimate, then what its updates need        algorithms/<part>.estimate, .prepare
    update      each update's gradients                                algorithms/<part>.backward -> policy.py -> engine
    optimizer   clip over the policy (and critic), AdamW and schedule  policy.py
    log         the step's metrics                                     here

The advantages follow the passes, as in verl's `RayPPOTrainer.fit`: PPO's, RLOO's and REINFORCE++'s estimators read
them (GRPO's read the rewards alone, and its choice of trees, `GRPO.trained`, uses them before sharding). Every
field a rollout carries for the loss (old and reference logprobs, advantages, PPO's returns, values and weights) is
written here (`write`), from what the passes and the part's estimate return. The step never asks which algorithm
runs (`algorithms/`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...tree import ReplayResult, Rollout, forests
from ..algorithms.base import Passes, StepValues
from ..algorithms.mismatch import sampler_mismatch
from ..data.rewards import RewardFunctionError
from ..policy import clip_grad_norm
from ..rollouts.trajectories import ItemError
from ..shards import Shards
from .log import peak_memory_bytes

if TYPE_CHECKING:
    from ..algorithms.base import Algorithm
    from ..data.preferences import PairBatch
    from ..rollouts.batch import Batch
    from .parallel import Ranks


def train_step(run, step: int) -> dict | None:
    """Step `step` (>= 1) of `run` (a `trainer.Trainer`): its metrics, or None (with a warning) when the reward or
    every item's environment failed (`run.skips`). Raises VLLMError or SamplerFailed from the sampler, before any
    update."""
    part, config, phases = run.algorithm, run.config, Phases()
    try:
        with phases("sample"):
            drawn = run.source.sample(step)
        with phases("score"):
            batch = run.source.score(drawn)
    except (RewardFunctionError, ItemError) as e:
        run.skips.skipped(step, e, Path(config.train.output_dir), write=run.rank == 0)
        return None
    with phases("trees"):
        trees = batch.trees
    with phases("shard"):
        shards = Shards.of(part.trained(batch), run.ranks, part.policy.model.config, config.parallel.layout)
    run.status(f"step {step}: training on {sum(len(t.rollouts) for t in shards.trees)} rollouts")
    with phases("passes"):
        values = passes(part, batch, shards)
    with phases("advantages"):
        estimate, prepared = advantages(part, batch, shards, values)
    history, result = [], None
    for k in range(part.num_updates):
        with phases("update"):
            result, metrics = update(part, k, prepared)
        with phases("optimizer"):
            history.append({**optimizer_step(part, config.grpo.max_grad_norm, result), **metrics})
    with phases("log"):
        if config.train.log_completions and run.rank == 0:
            run.completion_rows = batch.completions(run.tokenizer, estimate.logged)
        run.num_tokens += batch.logical_tokens
        record = {"step": step, **batch.step_metrics(), "num_tokens": run.num_tokens, **batch.metrics,
                  **averaged(history), **values.metrics, **estimate.metrics,
                  **step_sizes(part, shards, trees, result, run.ranks)}
    return {**record, **phases.metrics(batch.metrics), "memory/peak_bytes": peak_memory_bytes(part.policy.model.device)}


def passes(part: Algorithm, batch: Batch | PairBatch, shards: Shards) -> Passes:
    """The passes of `part` without a graph, on this rank's trees, gathered to every rank: the old policy (when
    `part.needs_old_logprobs()`), the reference (`part.needs_ref_logprobs()`), the critic (with one), in that order.
    With a sampler's logprobs (vLLM, or a batch drawn ahead by older weights, `batch.versions`) the old pass is
    compared with them (`sampler_mismatch`); drawn ahead without sampling.vllm_importance_sampling_cap the sampler's
    (behaviour) logprobs become the old logprobs, so the clipped ratio is against the policy that drew the tokens
    (TRL's AsyncGRPOTrainer); with the cap the old logprobs stay this policy's and min(exp(old - behaviour), cap)
    weighs each token (`Passes.ratios`: TRL's truncated importance sampling; the decoupled objective of verl's and
    AReaL's asynchronous modes). The logprobs are written on the step's rollouts (`write`)."""
    out = Passes()
    if part.needs_old_logprobs():
        result = part.policy.logprobs(shards.local)
        out.old = StepValues(shards.rollouts, shards.everywhere(result.logprobs), shards.everywhere(result.entropy))
        out.old_logprobs = out.old.logprobs
    if part.needs_ref_logprobs():
        out.ref_logprobs = shards.everywhere(part.reference.logprobs(shards.local).logprobs)
    if part.critic is not None:
        out.values = shards.everywhere(part.critic.logprobs(shards.local).values)
    if batch.sampler_logprobs is not None:
        out.metrics, out.ratios, out.old_logprobs = compared(part, batch, shards, out)
    write(shards.rollouts, out.fields())
    return out


def compared(part: Algorithm, batch: Batch, shards: Shards, out: Passes) -> tuple:
    """With a sampler's logprobs: (`sampler_mismatch`'s metrics, TRL's truncated importance sampling weights, the
    old logprobs the ratio takes: the sampler's behaviour logprobs when drawn ahead without the cap)."""
    metrics, ratios, old = {}, None, out.old_logprobs
    cap, ahead = part.config.sampling.vllm_importance_sampling_cap, batch.versions is not None
    if out.old is not None:
        metrics, ratios = sampler_mismatch(batch, shards.rollouts, out.old.logprobs, cap, ratios=ahead)
    if ahead and cap is None:
        behaviour = {id(r): lp for r, lp in zip(batch.flat, batch.sampler_logprobs, strict=True)}
        old = [behaviour[id(r)] for r in shards.rollouts]
    return metrics, ratios, old


def advantages(part: Algorithm, batch: Batch | PairBatch, shards: Shards, values: Passes) -> tuple:
    """The part's estimate, written on the rollouts, and what its updates need (`prepare`): (estimate, prepared)."""
    estimate = part.estimate(batch, shards, values)
    write(estimate.rollouts, estimate.fields)
    return estimate, part.prepare(batch, shards, values)


def update(part: Algorithm, k: int, prepared) -> tuple[ReplayResult | None, dict]:
    """Update k's gradients, from zero, into `param.grad` of the policy (and the critic): the fields the part
    changes before it (GRPO's entropy mask) written, then its engine calls. Returns (result, metrics)."""
    for model in trained(part):
        model.zero_grad()
    rollouts, fields, metrics = part.before_update(k, prepared)
    write(rollouts, fields)
    result, more = part.backward(k, prepared)
    return result, {**metrics, **more}


def optimizer_step(part: Algorithm, max_grad_norm: float, result) -> dict:
    """Clip the gradient norm over the policy and the critic together, step their AdamW and schedules; returns the
    update's loss, grad_norm (before clipping) and learning_rate."""
    models = trained(part)
    grad_norm = clip_grad_norm(models, max_grad_norm)
    lr = part.policy.scheduler.get_last_lr()[0]
    for model in models:
        model.step()
    return {"loss": result.loss if result else 0.0, "grad_norm": grad_norm, "learning_rate": lr}


def first_update_gradient(part: Algorithm, batch: Batch | PairBatch, ranks: Ranks | None, layout: str = "auto") -> list:
    """The gradient of `part`'s first update on `batch`, before clipping (what `train_step` steps with): every
    parameter of the policy, then of the critic, as a full (unsharded) tensor, zeros where none. Under torchrun
    every rank calls it and gets the reduced gradient. For checks: `branchreplay verify --nproc`, the tests."""
    shards = Shards.of(part.trained(batch), ranks, part.policy.model.config, layout)
    _, prepared = advantages(part, batch, shards, passes(part, batch, shards))
    update(part, 0, prepared)
    return [g.detach().clone() for model in trained(part) for g in (
        model.dp.full_grads() if model.dp is not None else
        [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.model.parameters()])]


def write(rollouts: list[Rollout], fields: dict[str, list]) -> None:
    """The one place a step's rollouts get their training fields: `fields` {name: one value per rollout}."""
    for name, values in fields.items():
        if len(values) != len(rollouts):
            raise RuntimeError(f"{len(values)} values of {name} for {len(rollouts)} rollouts")
        for r, value in zip(rollouts, values, strict=True):
            setattr(r, name, value)


def trained(part: Algorithm) -> list:
    """The policies the updates move: the policy, and PPO's critic."""
    return [part.policy] + ([part.critic] if part.critic is not None else [])


def averaged(history: list[dict]) -> dict:
    """The updates' metrics, each averaged over the updates (a metric missing from one counts 0 there)."""
    return {k: sum(h.get(k, 0.0) for h in history) / len(history) for k in history[-1]} if history else {}


def step_sizes(part: Algorithm, shards: Shards, trees: list, result, ranks: Ranks | None) -> dict:
    """The shard plan's metrics (`dist/*`), the engine's schedule of the last update, and the sizes of the step's
    trie (`tree/*`: every group's rollouts as one engine call in one process would run them, a start that groups
    share counted once with engine.forest; micro-batches and ranks each run their own forest, recomputing the start:
    `dist/physical_tokens/rank*` counts what each rank ran)."""
    policy, out = part.policy, {}
    if shards.plan is not None:
        plan = shards.plan
        out.update({"dist/world_size": ranks.world_size, "dist/imbalance": plan.imbalance,
                    "dist/recomputed_positions": plan.recomputed_positions, "dist/layout": plan.layout,
                    "dist/bytes_moved": max(plan.bytes_moved),
                    **({"dist/fsdp_mode": policy.dp.mode} if policy.dp.mode else {}),
                    **{f"dist/physical_tokens/rank{r}": n for r, n in enumerate(plan.physical_tokens)}})
    if isinstance(result, ReplayResult) and policy.method == "branchreplay":  # the last update's (schedule.py)
        out.update({"engine/schedule": result.schedule, "engine/shared_nodes_merged": result.shared_nodes_merged})
    whole = forests(trees) if policy.engine.forest else trees  # the step's trie: groups share starts
    stats = sum((t.stats for t in whole[1:]), whole[0].stats)
    out.update({"tree/logical_tokens": stats.logical_tokens, "tree/physical_tokens": stats.physical_tokens,
                "tree/token_ratio": stats.token_ratio})
    return out


class Phases:
    """Each phase's seconds, summed over its entries (`with phases("update"): ...`)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self, batch_metrics: dict) -> dict:
        """time/<phase>_s; time/train_s, the training phases' sum (trees to optimizer); time/step_s, every phase's;
        time/sample_model_s, the model's share of the sampling (multi-turn: the rest is the environment's; drawn
        ahead, of the sampler process's seconds)."""
        s = self.seconds
        out = {f"time/{name}_s": seconds for name, seconds in s.items()}
        train = ("trees", "shard", "passes", "advantages", "update", "optimizer")
        out.update({"time/train_s": sum(s.get(name, 0.0) for name in train), "time/step_s": sum(s.values())})
        env_s = batch_metrics.get("time/sample_env_s")
        if env_s is not None:
            out["time/sample_model_s"] = batch_metrics.get("time/sampler_process_s", s["sample"]) - env_s
        return out
