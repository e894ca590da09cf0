"""REINFORCE++ (Hu et al. 2025), as verl's `compute_reinforce_plus_plus_outcome_advantage` and OpenRLHF's
`reinforce` estimator: per-token rewards (the task's reward at the last token, minus grpo.beta times the per-token
k1 KL of the sampling policy against the reference), discounted returns (reinforce_pp.gamma), whitened over every
completion token of the step; then GRPO's clipped token loss (grpo.epsilon, loss_type, top_entropy_quantile,
importance_sampling_level) without a KL term in the loss, since the KL is in the reward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...tree import Rollout
from .advantages import discounted_returns, kl_per_token, masked_whiten, token_rewards
from .base import Estimate, step_rollouts, trains
from .grpo import GRPO

if TYPE_CHECKING:
    from ..rollouts.batch import Batch
    from ..shards import Shards
    from .base import Passes


class ReinforcePP(GRPO):
    """REINFORCE++ as a part of the loop (module docstring)."""

    name = "reinforce_pp"

    def trained(self, batch: Batch):
        return batch.trees  # the advantages come after the passes: groups are skipped then (`with_a_gradient`)

    def needs_old_logprobs(self) -> bool:
        return True  # the KL in the reward is of the sampling policy

    def estimate(self, batch: Batch, shards: Shards, passes: Passes) -> Estimate:
        rollouts = step_rollouts(batch, shards)
        advantages, metrics = reinforce_pp(rollouts, batch.rewards, self.config.grpo.beta,
                                           self.config.reinforce_pp.gamma)
        return Estimate(rollouts, {"advantages": advantages}, metrics)

    def with_a_gradient(self, shards: Shards):
        """All-zero advantages and no entropy bonus: no gradient, the tree is skipped."""
        return shards.keep(lambda t: trains(t, 0.0, self.config.grpo.entropy_coef))

    def make_loss(self, tokens: float):
        loss = super().make_loss(tokens)
        loss.beta = 0.0  # the KL is in the reward
        return loss


def reinforce_pp(rollouts: list[Rollout], rewards: torch.Tensor, beta: float, gamma: float
                 ) -> tuple[list[torch.Tensor], dict]:
    """REINFORCE++'s per-token advantages (module docstring) of `rollouts` [B] (the step's, in group order,
    `old_logprobs` set, and `ref_logprobs` when beta > 0) from `rewards` [B]. Returns (per rollout [T] float64, and
    {"kl": mean per-token k1 over the completion tokens} when beta > 0: TRL's name)."""
    masks = [r.loss_mask for r in rollouts]
    kls = [kl_per_token(r.old_logprobs, r.ref_logprobs, "k1") * r.loss_mask if beta > 0 else None for r in rollouts]
    returns = [discounted_returns(token_rewards(float(score), m, kl, beta), m, gamma)
               for score, m, kl in zip(rewards.tolist(), masks, kls, strict=True)]
    metrics = {}
    if beta > 0:
        metrics["kl"] = float(sum(k.sum() for k in kls) / max(sum(float(m.sum()) for m in masks), 1.0))
    return whitened(returns, masks), metrics


def whitened(values: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """`masked_whiten` over the step; with fewer than 2 completion tokens nothing trains: zeros."""
    if sum(float(m.sum()) for m in masks) < 2:
        return [torch.zeros_like(v) for v in values]
    return masked_whiten(values, masks)
