"""GRPO (TRL 1.16 GRPOTrainer; Shao et al. 2024, DeepSeekMath): the group advantages of the rewards (`GRPO.advantages`,
`advantages.group_advantages`), TRL's token-level clipped loss with its KL term and every loss_type
(`losses.GRPOLoss`), GSPO's sequence-level ratios (grpo.importance_sampling_level sequence: `losses.gspo_loss` in
two passes), and top_entropy_quantile (`keep_high_entropy`). REINFORCE++ and PPO run the same clipped token loss
with their own advantages (their modules subclass `GRPO`).

Departures from TRL: a group whose advantages are all zero (all rewards equal) is skipped when beta and
entropy_coef are 0, since its gradient is exactly zero, so `entropy` and `clip_ratio/*` are over the groups that
trained; one step is one sampling round (TRL's steps_per_generation = 1) followed by num_iterations updates; with
num_iterations 1 the ratio is against the detached current logprobs (on-policy), as TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...losses import GRPOLoss, LossStats, gspo_loss
from ...tree import Rollout
from .advantages import group_advantages
from .base import Algorithm, Estimate, Passes, StepValues, completion_tokens
from .mismatch import sampler_mismatch

if TYPE_CHECKING:
    from ..config import Config
    from ..policy import Policy
    from ..rollouts.batch import Batch
    from ..shards import Shards


@dataclass
class Prepared:
    """What GRPO's updates need (`GRPO.prepare`): the trained `shards`, the `loss`, the old pass (`Passes.old`, or
    None), the batch (its sampler logprobs) and, under top_entropy_quantile, each trained rollout's advantages before
    the entropy mask."""

    shards: object
    loss: GRPOLoss
    old: StepValues | None
    batch: object
    advantages: list[torch.Tensor] | None = None


class GRPO(Algorithm):
    """GRPO as a part of the step (module docstring)."""

    name = "grpo"

    def __init__(self, config: Config, policy: Policy, reference: Policy | None = None):
        super().__init__(config, policy, reference)
        g = config.grpo
        self.num_updates = g.num_iterations
        self.quantile = g.top_entropy_quantile < 1
        self.sequence = g.importance_sampling_level == "sequence"

    def advantages(self, batch: Batch) -> torch.Tensor:
        """[B] one advantage per rollout of the batch, from its rewards (`advantages.group_advantages` with
        grpo.scale_rewards). A part on GRPO's loss with another baseline overrides this alone."""
        return group_advantages(batch.rewards, [r.group for r in batch.flat], self.config.grpo.scale_rewards)

    def trained(self, batch: Batch):
        g = self.config.grpo
        if self.quantile or g.beta > 0 or g.entropy_coef > 0:  # every group counts in the entropy quantile (TRL's)
            return batch.trees
        signal = {id(r): a != 0 for r, a in zip(batch.flat, self.advantages(batch).tolist(), strict=True)}
        return [t for t in batch.trees if any(signal[id(r)] and r.weights.any() for r in t.rollouts)]

    def needs_old_logprobs(self) -> bool:
        """An old-policy pass before the updates: for the ratio of later updates, and for the vLLM sampler's
        truncated importance sampling."""
        return self.num_updates > 1 or self.config.sampling.vllm_importance_sampling_cap is not None

    def estimate(self, batch: Batch, shards: Shards, passes: Passes) -> Estimate:
        """The group advantages, each [T] float64, times the truncated importance sampling weights where the passes
        gave them."""
        advantages = self.advantages(batch)
        ratios = passes.ratios or {}
        fields = []
        for r, a in zip(batch.flat, advantages.tolist(), strict=True):
            full = torch.full((len(r),), a, dtype=torch.float64)
            fields.append(full * ratios[id(r)] if id(r) in ratios else full)
        return Estimate(batch.flat, {"advantages": fields}, logged=advantages)

    def prepare(self, batch: Batch, shards: Shards, passes: Passes) -> Prepared:
        shards = shards if self.quantile else self.with_a_gradient(shards)
        advantages = [r.advantages.clone() for r in shards.rollouts] if self.quantile else None
        return Prepared(shards, self.make_loss(completion_tokens(batch.trees)), passes.old, batch, advantages)

    def with_a_gradient(self, shards: Shards):
        """The trees that train after `estimate` (GRPO's were chosen by `trained`)."""
        return shards

    def make_loss(self, tokens: float) -> GRPOLoss:
        """The clipped token loss with the grpo section's options; `tokens`: the step's completion tokens, which the
        entropy bonus averages over."""
        g = self.config.grpo
        return GRPOLoss(g.epsilon, g.epsilon_high, g.beta, g.entropy_coef, g.use_bias_correction_kl, g.delta,
                        entropy_tokens=tokens, loss_type=g.loss_type, sapo_temperature_pos=g.sapo_temperature_pos,
                        sapo_temperature_neg=g.sapo_temperature_neg)

    def before_update(self, update: int, prepared: Prepared) -> tuple[list[Rollout], dict, dict]:
        """top_entropy_quantile: this update's advantages, masked to the high-entropy tokens of the current policy
        (the old pass's entropies, the same weights, for the first update)."""
        shards, old = prepared.shards, prepared.old
        if not self.quantile or not shards.trees:
            return [], {}, {}
        entropy = old.entropy if update == 0 and old is not None else shards.everywhere(
            self.policy.logprobs(shards.local).entropy)
        masked, kept = keep_high_entropy(shards.rollouts, entropy, prepared.advantages,
                                         self.config.grpo.top_entropy_quantile)
        return shards.rollouts, {"advantages": masked}, {"entropy_mask/kept": kept}

    def backward(self, update: int, prepared: Prepared):
        shards, loss, old, batch = prepared.shards, prepared.loss, prepared.old, prepared.batch
        if not shards.trees:  # no group has a gradient this step (on every rank alike)
            return None, {}
        loss.stats = LossStats()  # the clip, KL and entropy sums of this update (losses.py)
        if self.sequence:
            first = old.take(shards.rollouts) if update == 0 and old is not None else None
            _, logprobs, _, result = self.policy.function_backward(
                shards, lambda lps, ents: gspo_loss(lps, ents, shards.rollouts, loss), first)
        else:
            result = self.policy.backward(shards.local, loss)
            logprobs = None
        metrics = {}
        if batch.sampler_logprobs is not None and old is None:  # on-policy: this update's are the old ones
            logprobs = logprobs if logprobs is not None else shards.everywhere(result.logprobs)
            metrics.update(sampler_mismatch(batch, shards.rollouts, logprobs, None,
                                            ratios=batch.versions is not None)[0])
        return result, {**metrics, **self.update_metrics(result, prepared)}

    def update_metrics(self, result, prepared: Prepared) -> dict:
        """TRL's entropy, kl and clip_ratio/* of this update (`losses.LossStats`)."""
        return prepared.loss.stats.metrics()


def keep_high_entropy(rollouts, entropy: list[torch.Tensor], advantages: list[torch.Tensor], quantile: float
                      ) -> tuple[list[torch.Tensor], float]:
    """top_entropy_quantile (TRL 1.16 GRPOTrainer `get_high_entropy_mask`; Wang et al. 2025, "Beyond the 80/20
    rule"): each rollout's `advantages` ([T], kept unchanged), zeroed at the completion tokens whose
    entropy (`entropy`, per rollout [T], of the current policy) is below the (1 - quantile) quantile of every
    completion token of the step. Zeroed advantages drop those tokens from the policy term only, as TRL masks the
    per-token policy loss but not the KL term nor the normaliser. Departure: TRL's entropy bonus also averages over
    the kept tokens only; ours over every completion token. Returns (the masked advantages per rollout, the fraction
    of the completion tokens kept)."""
    pooled = [e[r.loss_mask > 0].double() for e, r in zip(entropy, rollouts, strict=True)]
    pooled = torch.cat(pooled) if pooled else torch.zeros(0, dtype=torch.float64)
    if pooled.numel() == 0:
        return list(advantages), 0.0
    threshold = torch.quantile(pooled, 1 - quantile)
    masked, kept = [], 0.0
    for r, e, a in zip(rollouts, entropy, advantages, strict=True):
        keep = (e.double() >= threshold) & (r.loss_mask > 0)
        masked.append(a * keep)
        kept += float(keep.sum())
    return masked, kept / max(sum(float(r.loss_mask.sum()) for r in rollouts), 1.0)
