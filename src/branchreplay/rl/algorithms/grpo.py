"""GRPO (TRL 1.16 GRPOTrainer; Shao et al. 2024, DeepSeekMath): the group advantages computed while the step is
scored (`rollouts.batch.group_rollouts`), TRL's token-level clipped loss with its KL term and every loss_type
(`losses.GRPOLoss`), GSPO's sequence-level ratios (grpo.importance_sampling_level sequence: `losses.gspo_loss` in
two passes), and top_entropy_quantile (`keep_high_entropy`). REINFORCE++ and PPO run the same clipped token loss
with their own advantages (their modules subclass `GRPO`).

Departures from TRL: a group whose advantages are all zero (all rewards equal) is skipped when beta and
entropy_coef are 0, since its gradient is exactly zero, so `entropy` and `clip_ratio/*` are over the groups that
trained; one step is one sampling round (TRL's steps_per_generation = 1) followed by num_iterations updates; with
num_iterations 1 the ratio is against the detached current logprobs (on-policy), as TRL's.
"""

from __future__ import annotations

import torch

from ...losses import GRPOLoss, LossStats, gspo_loss
from .base import Algorithm, completion_tokens, trains
from .mismatch import sampler_mismatch


class GRPO(Algorithm):
    """GRPO as a part of the loop (module docstring)."""

    name = "grpo"
    logs_group_advantages = True

    def __init__(self, config, policy, reference=None):
        super().__init__(config, policy, reference)
        g = config.grpo
        self.num_updates = g.num_iterations
        self.quantile = g.top_entropy_quantile < 1
        self.sequence = g.importance_sampling_level == "sequence"

    def trained(self, trees):
        g = self.config.grpo
        if self.quantile:  # every group counts in the entropy quantile (TRL's), so none is skipped under it
            return trees
        return [t for t in trees if trains(t, g.beta, g.entropy_coef)]

    def needs_old_logprobs(self) -> bool:
        """An old-policy pass before the updates: for the ratio of later updates, and for the vLLM sampler's
        truncated importance sampling."""
        return self.num_updates > 1 or self.config.sampling.vllm_importance_sampling_cap is not None

    def prepare(self, batch, shards) -> dict:
        metrics = self.passes(batch, shards, old=self.needs_old_logprobs())
        metrics.update(self.estimate(batch, shards))
        self.shards = shards if self.quantile else self.with_a_gradient(shards)
        self.batch = batch
        # the advantages before the entropy mask of each update
        self.advantages = [r.advantages.clone() for r in self.shards.rollouts] if self.quantile else None
        self.loss = self.make_loss(completion_tokens(batch.trees))
        return metrics

    def estimate(self, batch, shards) -> dict:
        """The advantages, after the passes (GRPO's were set while scoring: nothing); returns their metrics."""
        return {}

    def with_a_gradient(self, shards):
        """The trees that train after `estimate` (GRPO's were chosen by `trained`)."""
        return shards

    def make_loss(self, tokens: float) -> GRPOLoss:
        """The clipped token loss with the grpo section's options; `tokens`: the step's completion tokens, which the
        entropy bonus averages over."""
        g = self.config.grpo
        return GRPOLoss(g.epsilon, g.epsilon_high, g.beta, g.entropy_coef, g.use_bias_correction_kl, g.delta,
                        entropy_tokens=tokens, loss_type=g.loss_type, sapo_temperature_pos=g.sapo_temperature_pos,
                        sapo_temperature_neg=g.sapo_temperature_neg)

    def backward(self, update: int):
        shards, metrics = self.shards, {}
        if not shards.trees:  # no group has a gradient this step (on every rank alike)
            return None, metrics
        self.loss.stats = LossStats()  # the clip, KL and entropy sums of this update (losses.py)
        if self.quantile:  # this update's entropies: the old-policy pass's (the same weights) for the first one
            entropy = self.old.entropy if update == 0 and self.old is not None else shards.everywhere(
                self.policy.logprobs(shards.local).entropy)
            metrics["entropy_mask/kept"] = keep_high_entropy(shards.rollouts, entropy, self.advantages,
                                                             self.config.grpo.top_entropy_quantile)
        if self.sequence:
            first = self.old.take(shards.rollouts) if update == 0 and self.old is not None else None
            _, logprobs, _, result = self.policy.function_backward(
                shards, lambda lps, ents: gspo_loss(lps, ents, shards.rollouts, self.loss), first)
        else:
            result = self.policy.backward(shards.local, self.loss)
            logprobs = None
        if self.batch.sampler_logprobs is not None and self.old is None:  # on-policy: this update's are the old ones
            logprobs = logprobs if logprobs is not None else shards.everywhere(result.logprobs)
            metrics.update(sampler_mismatch(self.batch, shards.rollouts, logprobs, None,
                                            ratios=self.batch.versions is not None))
        return result, {**metrics, **self.update_metrics(result)}

    def update_metrics(self, result) -> dict:
        """TRL's entropy, kl and clip_ratio/* of this update (`losses.LossStats`)."""
        return self.loss.stats.metrics()


def keep_high_entropy(rollouts, entropy: list[torch.Tensor], advantages: list[torch.Tensor], quantile: float
                      ) -> float:
    """top_entropy_quantile (TRL 1.16 GRPOTrainer `get_high_entropy_mask`; Wang et al. 2025, "Beyond the 80/20
    rule"): each rollout's `advantages` ([T], kept unchanged) are written on it zeroed at the completion tokens whose
    entropy (`entropy`, per rollout [T], of the current policy) is below the (1 - quantile) quantile of every
    completion token of the step. Zeroed advantages drop those tokens from the policy term only, as TRL masks the
    per-token policy loss but not the KL term nor the normaliser. Departure: TRL's entropy bonus also averages over
    the kept tokens only; ours over every completion token. Returns the fraction of the completion tokens kept."""
    pooled = [e[r.loss_mask > 0].double() for e, r in zip(entropy, rollouts)]
    pooled = torch.cat(pooled) if pooled else torch.zeros(0, dtype=torch.float64)
    if pooled.numel() == 0:
        return 0.0
    threshold = torch.quantile(pooled, 1 - quantile)
    kept = 0.0
    for r, e, a in zip(rollouts, entropy, advantages):
        keep = (e.double() >= threshold) & (r.loss_mask > 0)
        r.advantages = a * keep
        kept += float(keep.sum())
    return kept / max(sum(float(r.loss_mask.sum()) for r in rollouts), 1.0)
