"""What each algorithm puts on the rollouts before the updates: advantages (per token), loss weights and, for PPO,
the critic's targets. GRPO's group advantages are computed while sampling (`advantages.group_advantages`); the
estimators here need the step's old-policy and reference logprobs (and PPO the critic's values) first, so the
trainer calls them after those passes.

    rloo          TRL 1.16 RLOOTrainer `_generate_and_score_completions`: r - beta * sum_t k1_t, leave-one-out
                  baseline per group, optional normalisation; one advantage per completion.
    reinforce_pp  verl `compute_reinforce_plus_plus_outcome_advantage` (Hu et al. 2025): per-token rewards with the
                  k1 KL penalty, discounted returns, whitened over the step's completion tokens.
    ppo           TRL 0.24 PPOTrainer steps 3-6: missing_eos_penalty, per-token KL penalty (k1 or k3), optional
                  reward whitening, GAE from the critic's values, returns = A + V, advantages whitened; loss
                  weights are the token mean (TRL's masked_mean over the batch).

Each function writes `advantages` (and `weights`, `returns`, `old_values`) on the given rollouts in place and returns
the step's metrics under TRL's names. Rollouts are the step's, in group order; `old_logprobs` must be set (and
`ref_logprobs` whenever a KL coefficient is non-zero).
"""

from __future__ import annotations

import torch

from ..losses import token_weights
from ..tree import Rollout
from .advantages import (discounted_returns, gae, kl_per_token, masked_whiten, normalize, rloo_advantages,
                         token_rewards)


def rloo(rollouts: list[Rollout], rewards: torch.Tensor, beta: float, normalize_advantages: bool) -> dict:
    """RLOO's advantages (module docstring) on `rollouts` [B], `rewards` [B] float. Returns {"kl": mean per-token k1
    over the completion tokens} when beta > 0 (TRL logs it so)."""
    rewards = rewards.double().clone()
    metrics = {}
    if beta > 0:
        kls = [kl_per_token(r.old_logprobs, r.ref_logprobs, "k1") * r.loss_mask for r in rollouts]
        rewards = rewards - beta * torch.stack([k.sum() for k in kls])
        metrics["kl"] = float(sum(k.sum() for k in kls) / max(sum(float(r.loss_mask.sum()) for r in rollouts), 1.0))
    advantages = rloo_advantages(rewards, [r.group for r in rollouts])
    if normalize_advantages:
        advantages = normalize(advantages)
    for r, a in zip(rollouts, advantages.tolist()):
        r.advantages = torch.full((len(r),), a, dtype=torch.float64)
    return metrics


def reinforce_pp(rollouts: list[Rollout], rewards: torch.Tensor, beta: float, gamma: float) -> dict:
    """REINFORCE++'s per-token advantages (module docstring). Returns {"kl": mean per-token k1} when beta > 0."""
    masks = [r.loss_mask for r in rollouts]
    kls = [kl_per_token(r.old_logprobs, r.ref_logprobs, "k1") * r.loss_mask if beta > 0 else None for r in rollouts]
    returns = [discounted_returns(token_rewards(float(score), m, kl, beta), m, gamma)
               for score, m, kl in zip(rewards.tolist(), masks, kls)]
    for r, a in zip(rollouts, _whitened(returns, masks)):
        r.advantages = a
    metrics = {}
    if beta > 0:
        metrics["kl"] = float(sum(k.sum() for k in kls) / max(sum(float(m.sum()) for m in masks), 1.0))
    return metrics


def ppo(rollouts: list[Rollout], scores: torch.Tensor, ended: list[bool], values: list[torch.Tensor], cfg) -> dict:
    """PPO's advantages, returns and token-mean weights (module docstring) on `rollouts` [B] from the task's
    `scores` [B], whether each completion `ended` with EOS, the critic's `values` (per rollout [T], at the
    completion positions: `ReplayResult.values`) and `cfg` (`config.PPOConfig`). Returns TRL's objective/* metrics:
    objective/kl and objective/non_score_reward (per completion, summed over its tokens, mean over the step),
    objective/entropy (the sampled tokens' -logp summed, mean), objective/scores and objective/rlhf_reward."""
    scores = scores.double().clone()
    if cfg.missing_eos_penalty is not None:
        scores = scores - cfg.missing_eos_penalty * torch.tensor([not e for e in ended], dtype=torch.float64)
    masks = [r.loss_mask for r in rollouts]
    kls = [kl_per_token(r.old_logprobs, r.ref_logprobs, cfg.kl_estimator) * r.loss_mask
           if r.ref_logprobs is not None else torch.zeros(len(r), dtype=torch.float64) for r in rollouts]
    rewards = [token_rewards(float(s), m, kl, cfg.kl_coef) for s, m, kl in zip(scores.tolist(), masks, kls)]
    if cfg.whiten_rewards and _tokens(masks) >= 2:
        rewards = masked_whiten(rewards, masks, shift_mean=False)
    estimates = [gae(rw, v.double(), m, cfg.gamma, cfg.lam) for rw, v, m in zip(rewards, values, masks)]
    weights = token_weights(masks, "bnpo")
    for r, (_, ret), a, w, v in zip(rollouts, estimates, _whitened([e[0] for e in estimates], masks), weights,
                                    values):
        r.advantages, r.returns, r.old_values, r.weights = a, ret, v.double() * r.loss_mask, w
    B = max(len(rollouts), 1)
    non_score = -cfg.kl_coef * sum(float(k.sum()) for k in kls) / B
    return {
        "objective/kl": sum(float(k.sum()) for k in kls) / B,
        "objective/entropy": sum(float((-r.old_logprobs * r.loss_mask).sum()) for r in rollouts) / B,
        "objective/non_score_reward": non_score,
        "objective/rlhf_reward": non_score + float(scores.mean()),
        "objective/scores": float(scores.mean()),
    }


def keep_high_entropy(rollouts: list[Rollout], entropy: list[torch.Tensor], advantages: list[torch.Tensor],
                      quantile: float, gather=None) -> float:
    """top_entropy_quantile (TRL 1.16 GRPOTrainer `get_high_entropy_mask`; Wang et al. 2025, "Beyond the 80/20
    rule"): each rollout's `advantages` ([T], kept unchanged) are written on it zeroed at the completion tokens whose
    entropy (`entropy`, per rollout [T], of the current policy) is below the (1 - quantile) quantile of every
    completion token of the step. Zeroed advantages drop those tokens from the policy term only, as TRL masks the
    per-token policy loss but not the KL term nor the normaliser. Departure: TRL's entropy bonus also averages over
    the kept tokens only; ours over every completion token. `gather`: pools the [n] entropies over the processes.
    Returns the fraction of the completion tokens kept."""
    pooled = [e[r.loss_mask > 0].double() for e, r in zip(entropy, rollouts)]
    pooled = torch.cat(pooled) if pooled else torch.zeros(0, dtype=torch.float64)
    if gather is not None:
        pooled = gather(pooled)
    if pooled.numel() == 0:
        return 0.0
    threshold = torch.quantile(pooled, 1 - quantile)
    kept = 0.0
    for r, e, a in zip(rollouts, entropy, advantages):
        keep = (e.double() >= threshold) & (r.loss_mask > 0)
        r.advantages = a * keep
        kept += float(keep.sum())
    return kept / max(_tokens([r.loss_mask for r in rollouts]), 1.0)


def _whitened(values: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """`masked_whiten` over the step; with fewer than 2 completion tokens nothing trains: zeros."""
    if _tokens(masks) < 2:
        return [torch.zeros_like(v) for v in values]
    return masked_whiten(values, masks)


def _tokens(masks: list[torch.Tensor]) -> float:
    return sum(float(m.sum()) for m in masks)
