"""RLOO, as TRL 1.16's RLOOTrainer (trl/trainer/rloo_trainer.py; Ahmadian et al. 2024, "Back to Basics"): the KL
in the reward (grpo.beta times the summed k1 of the sampling policy against the reference; TRL's RLOOConfig.beta
defaults to 0.05), a leave-one-out baseline per group, optional normalisation (rloo.normalize_advantages), one
advantage per completion; the loss TRL's sequence-level clipped ratio of the summed completion logprobs
(`losses.rloo_loss`), a mean over the step's completions, whose exact gradient over the trees takes two passes
(`Policy.function_backward`). grpo.delta, entropy_coef, use_bias_correction_kl and loss_type do not apply (TRL's
RLOO has none of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...engine.sequence import sequence_sums
from ...losses import rloo_clip_metrics, rloo_loss
from ...tree import Rollout
from .advantages import kl_per_token, normalize, rloo_advantages
from .base import Algorithm, Estimate, StepValues, step_rollouts, trains

if TYPE_CHECKING:
    from ..config import Config
    from ..policy import Policy
    from ..rollouts.batch import Batch
    from ..shards import Shards
    from .base import Passes


@dataclass
class Prepared:
    """What RLOO's updates need: the trained `shards`, the old pass, the old summed logprobs [N] and the advantages
    [N] of their rollouts (float64), and the step's number of completions (TRL's mean is over all of them)."""

    shards: object
    old: StepValues
    old_sums: torch.Tensor | None
    advantages: torch.Tensor
    num_sequences: int


class RLOO(Algorithm):
    """RLOO as a part of the loop (module docstring)."""

    name = "rloo"

    def __init__(self, config: Config, policy: Policy, reference: Policy | None = None):
        super().__init__(config, policy, reference)
        self.num_updates = config.grpo.num_iterations

    def estimate(self, batch: Batch, shards: Shards, passes: Passes) -> Estimate:
        rollouts, g = step_rollouts(batch, shards), self.config.grpo
        advantages, metrics = rloo(rollouts, batch.rewards, g.beta, self.config.rloo.normalize_advantages)
        return Estimate(rollouts, {"advantages": advantages}, metrics)

    def prepare(self, batch: Batch, shards: Shards, passes: Passes) -> Prepared:
        kept = shards.keep(lambda t: trains(t, 0.0, self.config.grpo.entropy_coef))  # all-zero advantages: no gradient
        rollouts = kept.rollouts
        old_sums = sequence_sums([r.old_logprobs for r in rollouts], rollouts) if rollouts else None
        advantages = torch.tensor([float(r.advantages[0]) for r in rollouts], dtype=torch.float64)
        return Prepared(kept, passes.old, old_sums, advantages, len(shards.rollouts))

    def backward(self, update: int, prepared: Prepared):
        """One update of the sequence-level loss; the first reuses the old-policy pass as its pass 1 (the same
        weights). Metrics: TRL's entropy (a token mean) and clip_ratio/low_mean, high_mean, region_mean."""
        shards, g, p = prepared.shards, self.config.grpo, prepared
        if not shards.trees:
            return None, {}
        rollouts = shards.rollouts

        def loss(logprobs, entropy):
            return rloo_loss(sequence_sums(logprobs, rollouts), p.old_sums, p.advantages, epsilon_low=g.epsilon,
                             epsilon_high=g.epsilon_high, num_sequences=p.num_sequences)

        first = p.old.take(rollouts) if update == 0 else None
        _, logprobs, entropy, result = self.policy.function_backward(shards, loss, first)
        masks = [r.loss_mask for r in rollouts]
        tokens = sum(float((e.double() * m).sum()) for e, m in zip(entropy, masks, strict=True))
        return result, {"entropy": tokens / max(sum(float(m.sum()) for m in masks), 1.0),
                        **rloo_clip_metrics(sequence_sums(logprobs, rollouts), p.old_sums, p.advantages,
                                            epsilon_low=g.epsilon, epsilon_high=g.epsilon_high)}


def rloo(rollouts: list[Rollout], rewards: torch.Tensor, beta: float, normalize_advantages: bool
         ) -> tuple[list[torch.Tensor], dict]:
    """RLOO's advantages (module docstring) of `rollouts` [B] (the step's, with `old_logprobs`, and `ref_logprobs`
    when beta > 0), `rewards` [B] float; TRL 1.16 RLOOTrainer `_generate_and_score_completions`. Returns (per
    rollout [T] float64, its one advantage at every position, and {"kl": mean per-token k1 over the completion
    tokens} when beta > 0: TRL logs it so)."""
    rewards = rewards.double().clone()
    metrics = {}
    if beta > 0:
        kls = [kl_per_token(r.old_logprobs, r.ref_logprobs, "k1") * r.loss_mask for r in rollouts]
        rewards = rewards - beta * torch.stack([k.sum() for k in kls])
        metrics["kl"] = float(sum(k.sum() for k in kls) / max(sum(float(r.loss_mask.sum()) for r in rollouts), 1.0))
    advantages = rloo_advantages(rewards, [r.group for r in rollouts])
    if normalize_advantages:
        advantages = normalize(advantages)
    return [torch.full((len(r),), a, dtype=torch.float64) for r, a in zip(rollouts, advantages.tolist(),
                                                                          strict=True)], metrics
