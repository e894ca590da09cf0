"""PPO with a learned critic, as TRL 0.24's PPOTrainer (PPO left TRL in 1.x; trl/trainer/ppo_trainer.py), over
prefix trees.

The critic (`value.ValueModel`) is a separate copy of the policy's decoder with a fresh scalar head, as TRL's
separate value model: the value loss never moves the policy. It runs on the same trees, so every unique position
gets one value, shared by the rollouts through it. Each step: the old-policy, reference and critic passes; the
estimator (`ppo`: TRL's steps 3-6); then ppo.num_ppo_epochs updates of GRPO's clipped token loss (cliprange, no KL
term, no entropy bonus: TRL's PPO has none) and `losses.ValueLoss` on the critic, one AdamW each with the same
schedule and one gradient-norm clip over both (TRL's one optimizer over policy and critic).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...losses import GRPOLoss, ValueLoss, token_weights
from ...models import load_policy
from ...tree import Rollout
from ...value import ValueModel, check_critic
from .advantages import gae, kl_per_token, masked_whiten, token_rewards
from .base import Estimate, step_rollouts
from .grpo import GRPO, Prepared
from .reinforce_pp import whitened

if TYPE_CHECKING:
    from ..config import Config
    from ..policy import Policy
    from ..rollouts.batch import Batch
    from ..shards import Shards
    from .base import Passes


class PPO(GRPO):
    """PPO as a part of the loop (module docstring): `critic` is the value model's `Policy`."""

    name = "ppo"

    def __init__(self, config: Config, policy: Policy, reference: Policy | None = None):
        super().__init__(config, policy, reference)
        p = config.ppo
        self.num_updates, self.quantile, self.sequence = p.num_ppo_epochs, False, False
        m = config.model
        base = policy.model if p.value_model is None else load_policy(p.value_model, m.dtype, m.device)[0]
        critic = ValueModel.from_policy(base, seed=config.train.seed).eval()
        check_critic(critic, policy.model)
        self.critic = policy.sibling(critic, temperature=1.0)

    @classmethod
    def needs_reference(cls, config: Config) -> bool:
        return config.ppo.kl_coef > 0

    @classmethod
    def check(cls, config: Config) -> None:
        if config.model.lora_r:
            raise ValueError("model.lora_r (LoRA) does not run with PPO's critic yet: train every parameter "
                             "(model.lora_r 0), or use algorithm grpo, rloo, reinforce_pp or dpo")

    def trained(self, batch: Batch):
        return batch.trees

    def needs_old_logprobs(self) -> bool:
        return True

    def estimate(self, batch: Batch, shards: Shards, passes: Passes) -> Estimate:
        rollouts = step_rollouts(batch, shards)
        ended = [not cut for cut in batch.truncated]
        fields, metrics = ppo(rollouts, batch.rewards, ended, passes.values, self.config.ppo)
        return Estimate(rollouts, fields, metrics)

    def make_loss(self, tokens: float) -> GRPOLoss:
        p = self.config.ppo
        return GRPOLoss(p.cliprange, p.cliprange, 0.0, 0.0, entropy_tokens=tokens)

    def backward(self, update: int, prepared: Prepared):
        result, metrics = super().backward(update, prepared)
        value_loss = ValueLoss(self.config.ppo.cliprange_value, self.config.ppo.vf_coef)
        self.critic.backward(prepared.shards.local, value_loss)
        if result is not None:
            metrics.update(value_loss.value_metrics())
        return result, metrics

    def update_metrics(self, result, prepared: Prepared) -> dict:
        """TRL PPOTrainer's per-update metrics of the policy: policy/approxkl_avg (0.5 mean (logp - old_logp)^2),
        val/ratio (the mean ratio), policy/entropy_avg, policy/clipfrac_avg, loss/policy_avg (this update's
        token-mean policy loss); means over the completion tokens (TRL's include its padding). The critic's
        loss/value_avg and val/clipfrac_avg come from its `ValueLoss`."""
        rollouts = prepared.shards.rollouts
        logprobs = prepared.shards.everywhere(result.logprobs)
        diffs = [(lp.double() - r.old_logprobs)[r.loss_mask > 0] for lp, r in zip(logprobs, rollouts, strict=True)]
        diffs = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
        stats = prepared.loss.stats.metrics()
        return {"policy/approxkl_avg": float(0.5 * (diffs ** 2).mean()) if diffs.numel() else 0.0,
                "val/ratio": float(diffs.exp().mean()) if diffs.numel() else 1.0,
                "policy/entropy_avg": stats["entropy"], "policy/clipfrac_avg": stats["clip_ratio/region_mean"],
                "loss/policy_avg": result.loss}


def ppo(rollouts: list[Rollout], scores: torch.Tensor, ended: list[bool], values: list[torch.Tensor], cfg
        ) -> tuple[dict[str, list[torch.Tensor]], dict]:
    """PPO's advantages, returns, old values and token-mean weights of `rollouts` [B] (the step's, with
    `old_logprobs`, and `ref_logprobs` when kl_coef > 0) from the task's `scores` [B], whether each completion
    `ended` with EOS, the critic's `values` (per rollout [T], at the completion positions: `ReplayResult.values`) and
    `cfg` (`config.PPOConfig`). TRL's steps 3-6: missing_eos_penalty, the per-token KL penalty (k1 or k3) in the reward,
    optional reward whitening, GAE from the critic's values, returns = A + V, advantages whitened; loss weights the
    token mean (TRL's masked_mean over the batch). Departure: TRL places the score one position past the last token
    (a padding slot); an unpadded rollout has no such slot, so ours is at the last token. Returns ({"advantages",
    "returns", "old_values", "weights": per rollout [T] float64}, the metrics): TRL's objective/*
    metrics: objective/kl and objective/non_score_reward (per completion, summed over its tokens, mean over the
    step), objective/entropy (the sampled tokens' -logp summed, mean), objective/scores and objective/rlhf_reward."""
    scores = scores.double().clone()
    if cfg.missing_eos_penalty is not None:
        scores = scores - cfg.missing_eos_penalty * torch.tensor([not e for e in ended], dtype=torch.float64)
    masks = [r.loss_mask for r in rollouts]
    kls = [kl_per_token(r.old_logprobs, r.ref_logprobs, cfg.kl_estimator) * r.loss_mask
           if r.ref_logprobs is not None else torch.zeros(len(r), dtype=torch.float64) for r in rollouts]
    rewards = [token_rewards(float(s), m, kl, cfg.kl_coef) for s, m, kl in zip(scores.tolist(), masks, kls,
                                                                               strict=True)]
    if cfg.whiten_rewards and sum(float(m.sum()) for m in masks) >= 2:
        rewards = masked_whiten(rewards, masks, shift_mean=False)
    estimates = [gae(rw, v.double(), m, cfg.gamma, cfg.lam) for rw, v, m in zip(rewards, values, masks, strict=True)]
    weights = token_weights(masks, "bnpo")
    fields = {"advantages": whitened([e[0] for e in estimates], masks), "returns": [ret for _, ret in estimates],
              "old_values": [v.double() * r.loss_mask for r, v in zip(rollouts, values,
                                                                      strict=True)], "weights": weights}
    B = max(len(rollouts), 1)
    non_score = -cfg.kl_coef * sum(float(k.sum()) for k in kls) / B
    return fields, {
        "objective/kl": sum(float(k.sum()) for k in kls) / B,
        "objective/entropy": sum(float((-r.old_logprobs * r.loss_mask).sum()) for r in rollouts) / B,
        "objective/non_score_reward": non_score,
        "objective/rlhf_reward": non_score + float(scores.mean()),
        "objective/scores": float(scores.mean()),
    }
