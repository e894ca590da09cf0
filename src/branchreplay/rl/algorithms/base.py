"""What an algorithm is to the training loop (`run/update.py`): a small part with five answers (`Algorithm`).

The loop samples and scores a step (or, for a part that brings its own batch, asks it: DPO's pairs), builds the
trees, shares them out over the ranks (`Shards`), then asks the part which trees it trains, for its no-grad passes
and advantages (`prepare`) and for each update's gradients (`backward`); it clips, steps the optimizers and logs.
The passes run on this rank's trees and their values are gathered to every rank (`Shards.everywhere`), so the
estimators and the losses of whole sequences see every rollout of the step on every rank, as in one process.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ...tree import ReplayResult, Rollout, RolloutTree
from .mismatch import sampler_mismatch


class Algorithm:
    """The interface and the shared passes. Override what differs. After sampling, scoring and sharing out the
    trees, the loop asks:

        trained(trees)           the trees that have a gradient this step
        prepare(batch, shards)   its no-grad passes (old policy, reference, critic) and its advantages; metrics
                                 (it keeps the shards it trains: `self.shards`)
        backward(k)              update k's engine calls, gradients into param.grad; (result, metrics)

    and it clips, steps the optimizers and logs. Class-level answers: `samples` (whether the loop samples its batch;
    a part that does not gives `batches(tokenizer)`, whose `batch(step)` the loop takes), `logs_group_advantages`
    (whether its advantages are the group advantages set while scoring, which the completions log then shows),
    `needs_reference(config)` (whether a frozen reference policy is kept), `check(config)` (what it refuses, by
    name, before the model loads). A part's constructor receives the `Policy` it trains and the reference `Policy`
    (or None); `critic` is a second trained Policy (PPO's), `num_updates` the optimizer updates per step."""

    name: ClassVar[str] = ""
    samples: ClassVar[bool] = True
    logs_group_advantages: ClassVar[bool] = False  # the completions log carries the scored group advantages

    def __init__(self, config, policy, reference=None):
        self.config, self.policy, self.reference = config, policy, reference
        self.critic = None
        self.num_updates = 1
        self.old: StepValues | None = None  # the old-policy pass of the step, when one ran

    @classmethod
    def needs_reference(cls, config) -> bool:
        """Whether the part needs the frozen reference policy (a KL term, or DPO's reference)."""
        return config.grpo.beta > 0

    @classmethod
    def check(cls, config) -> None:
        """Raise ValueError naming the setting for what this part does not run (before the model loads)."""

    def trained(self, trees: list[RolloutTree]) -> list[RolloutTree]:
        """The step's trees that have a gradient (every one by default)."""
        return trees

    def prepare(self, batch, shards) -> dict:
        """The passes before the updates and the advantages, keeping `shards` (the trees the updates train) as
        `self.shards`; returns metrics (TRL's names)."""
        self.shards = shards
        return self.passes(batch, shards, old=True)

    def backward(self, update: int) -> tuple[ReplayResult | None, dict]:
        """One optimizer update's gradients over `self.shards` (update = 0, 1, ...); returns the result and its
        metrics."""
        raise NotImplementedError

    # -- shared passes --------------------------------------------------------------------------------------------

    def passes(self, batch, shards, old: bool) -> dict:
        """The old-policy pass (when `old`) and the reference pass (with a reference policy), their logprobs set on
        every rollout of the step (`old_logprobs`, `ref_logprobs`), on every rank; with the vLLM sampler, its
        logprobs compared with the old policy's (and TRL's truncated importance sampling: `sampler_mismatch`).
        A batch drawn ahead (`batch.versions`, grpo.max_staleness >= 1) by older weights: without
        sampling.vllm_importance_sampling_cap its sampler's (behaviour) logprobs become the old logprobs, so the
        clipped ratio is against the policy that drew the tokens (TRL's AsyncGRPOTrainer); with the cap the old
        logprobs stay this policy's and min(exp(old - behaviour), cap) weighs each token (TRL's truncated
        importance sampling; the decoupled objective of verl's and AReaL's asynchronous modes). Returns the
        sampler metrics."""
        self.old = self.old_pass(shards) if old else None
        if self.reference is not None:
            for r, lp in zip(shards.rollouts, shards.everywhere(self.reference.logprobs(shards.local).logprobs)):
                r.ref_logprobs = lp
        if batch.sampler_logprobs is None:
            return {}
        cap, ahead = self.config.sampling.vllm_importance_sampling_cap, batch.versions is not None
        metrics = {} if self.old is None else sampler_mismatch(batch, shards.rollouts, self.old.logprobs, cap,
                                                               ratios=ahead)
        if ahead and cap is None:
            behaviour = {id(r): lp for r, lp in zip((r for g in batch.rollouts for r in g), batch.sampler_logprobs)}
            for r in shards.rollouts:
                r.old_logprobs = behaviour[id(r)]
        return metrics

    def old_pass(self, shards) -> StepValues:
        """The policy's logprobs and entropies of every rollout of the step before the updates, set as their
        `old_logprobs`; kept, to serve as pass 1 of the first update (the same weights)."""
        result = self.policy.logprobs(shards.local)
        old = StepValues(shards.rollouts, shards.everywhere(result.logprobs), shards.everywhere(result.entropy))
        for r, lp in zip(shards.rollouts, old.logprobs):
            r.old_logprobs = lp
        return old


class StepValues:
    """A pass over the step: per rollout of `rollouts` (the step's, on every rank) its [T] logprobs and entropies."""

    def __init__(self, rollouts: list[Rollout], logprobs: list[torch.Tensor], entropy: list[torch.Tensor]):
        self.logprobs, self.entropy = logprobs, entropy
        self.index = {id(r): k for k, r in enumerate(rollouts)}

    def take(self, rollouts: list[Rollout]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(logprobs, entropies) of `rollouts`, some of the pass's, in their order."""
        at = [self.index[id(r)] for r in rollouts]
        return [self.logprobs[k] for k in at], [self.entropy[k] for k in at]


def trains(tree: RolloutTree, beta: float, entropy_coef: float) -> bool:
    """Whether a tree has a gradient: a KL or entropy term, or a rollout with a non-zero advantage and weight."""
    return beta > 0 or entropy_coef > 0 or any(r.advantages.any() and r.weights.any() for r in tree.rollouts)


def completion_tokens(trees: list[RolloutTree]) -> float:
    """The trained (loss_mask) positions of every rollout of `trees`."""
    return sum(float(r.loss_mask.sum()) for t in trees for r in t.rollouts)


def step_rollouts(batch, shards) -> list[Rollout]:
    """Every rollout of the step, which an estimator indexes like `batch.rewards` (its part trains every tree).
    Raises RuntimeError when they do not match."""
    rollouts = shards.rollouts
    if len(rollouts) != len(batch.rewards):
        raise RuntimeError(f"the estimator got {len(rollouts)} rollouts for {len(batch.rewards)} rewards")
    return rollouts
