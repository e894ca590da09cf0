"""What an algorithm is to the training step (`run/step.py`): a small part with a few answers (`Algorithm`), and the
values a step hands from one phase to the next (`Passes`, `Estimate`).

The step samples and scores the batch (or, for a part that brings its own, asks it: DPO's pairs), builds the trees,
asks the part which trees train, shares them out over the ranks (`Shards`), runs the passes without a graph
(`run.step.passes`: old policy, reference, critic), asks the part for its advantages (`estimate`) and for what its
updates need (`prepare`), then for each update's gradients (`backward`); it writes every field a rollout carries,
clips, steps the optimizers and logs. The passes run on this rank's trees and their values are gathered to every rank
(`Shards.everywhere`), so the estimators and the losses of whole sequences see every rollout of the step on every
rank, as in one process. A part holds no state of a step: `prepare` returns it and `backward` receives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from ...tree import ReplayResult, Rollout, RolloutTree

if TYPE_CHECKING:
    from ..config import Config
    from ..data.preferences import PairBatch
    from ..policy import Policy
    from ..rollouts.batch import Batch
    from ..shards import Shards


class Algorithm:
    """The interface. Override what differs. After sampling, scoring and building the trees, the step asks:

        trained(batch)                   the trees that have a gradient this step
        needs_old_logprobs()             whether the passes run the old policy (`passes`); needs_ref_logprobs()
                                         the reference
        estimate(batch, shards, passes)  the advantages: an `Estimate`, whose fields the step writes on the rollouts
        prepare(batch, shards, passes)   what the updates need (its trained shards, its loss), for `backward`
        before_update(k, prepared)       fields the step writes before update k (GRPO's entropy mask), and metrics
        backward(k, prepared)            update k's engine calls, gradients into param.grad; (result, metrics)

    and it clips, steps the optimizers and logs. Class-level answers: `samples` (whether the step samples its batch;
    a part that does not gives `batches(tokenizer)`, whose `sample(step)` the step takes), `needs_reference(config)`
    (whether a frozen reference policy is kept), `check(config)` (what it refuses, by name, before the model
    loads). A part's constructor receives the `Policy` it trains and the reference `Policy` (or None); `critic` is a
    second trained Policy (PPO's), `num_updates` the optimizer updates per step."""

    name: ClassVar[str] = ""
    samples: ClassVar[bool] = True

    def __init__(self, config: Config, policy: Policy, reference: Policy | None = None):
        self.config, self.policy, self.reference = config, policy, reference
        self.critic = None
        self.num_updates = 1

    @classmethod
    def needs_reference(cls, config: Config) -> bool:
        """Whether the part needs the frozen reference policy (a KL term, or DPO's reference)."""
        return config.grpo.beta > 0

    @classmethod
    def check(cls, config: Config) -> None:
        """Raise ValueError naming the setting for what this part does not run (before the model loads)."""

    def trained(self, batch: Batch | PairBatch) -> list[RolloutTree]:
        """The step's trees that have a gradient (every one by default)."""
        return batch.trees

    def needs_old_logprobs(self) -> bool:
        """Whether the passes run the policy before the updates (the ratio's old logprobs)."""
        return True

    def needs_ref_logprobs(self) -> bool:
        """Whether the passes run the reference policy (its logprobs per token: a KL term)."""
        return self.reference is not None

    def estimate(self, batch: Batch | PairBatch, shards: Shards, passes: Passes) -> Estimate:
        """The advantages (and any other per-rollout field the loss reads), after the passes; the step writes
        `Estimate.fields` on `Estimate.rollouts`."""
        raise NotImplementedError

    def prepare(self, batch: Batch | PairBatch, shards: Shards, passes: Passes):
        """What the updates need (the trained shards, the loss, the pass values), handed to `backward`; called
        after the estimate's fields are written."""
        raise NotImplementedError

    def before_update(self, update: int, prepared) -> tuple[list[Rollout], dict, dict]:
        """(rollouts, their fields, metrics) the step writes before update `update`: nothing by default."""
        return [], {}, {}

    def backward(self, update: int, prepared) -> tuple[ReplayResult | None, dict]:
        """One optimizer update's gradients (update = 0, 1, ...); returns the result and its metrics."""
        raise NotImplementedError


@dataclass
class Passes:
    """The passes without a graph of a step (`passes`), per rollout of `shards.rollouts` (every rank's).

    old: the policy's logprobs and entropies before the updates (None when the part needs none). old_logprobs: what
    the ratio takes (the old pass's, or drawn ahead the sampler's behaviour logprobs). ref_logprobs: the frozen
    reference's. values: the critic's, at every position. ratios: TRL's truncated importance sampling weights per
    rollout id (sampling.vllm_importance_sampling_cap), which multiply GRPO's advantages. metrics: the sampler's
    logprobs against the old pass's (`mismatch.sampler_mismatch`).
    """

    old: StepValues | None = None
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    ratios: dict[int, torch.Tensor] | None = None
    metrics: dict = field(default_factory=dict)

    def fields(self) -> dict[str, list[torch.Tensor]]:
        """The rollout fields the passes give: old_logprobs and ref_logprobs, where they ran."""
        out = {"old_logprobs": self.old_logprobs, "ref_logprobs": self.ref_logprobs}
        return {name: values for name, values in out.items() if values is not None}


@dataclass
class Estimate:
    """A part's estimate: `fields` ({name: per rollout of `rollouts`}: advantages, and PPO's returns, old_values and
    weights) that the step writes on `rollouts`; its metrics; `logged`: [B] the advantage per rollout of the batch
    that the completions log shows (GRPO's group advantages), or None."""

    rollouts: list[Rollout]
    fields: dict[str, list[torch.Tensor]]
    metrics: dict = field(default_factory=dict)
    logged: torch.Tensor | None = None


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


def step_rollouts(batch: Batch | PairBatch, shards: Shards) -> list[Rollout]:
    """Every rollout of the step, which an estimator indexes like `batch.rewards` (its part trains every tree).
    Raises RuntimeError when they do not match."""
    rollouts = shards.rollouts
    if len(rollouts) != len(batch.rewards):
        raise RuntimeError(f"the estimator got {len(rollouts)} rollouts for {len(batch.rewards)} rewards")
    return rollouts
