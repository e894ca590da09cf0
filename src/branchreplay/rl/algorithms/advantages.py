"""Group-relative advantages, as TRL's GRPOTrainer (`_generate_and_score_completions`).

    A_i = r_i - mean(r of i's group)                       every scale_rewards mode
    A_i /= std(r of i's group) + 1e-4                      scale_rewards="group" (GRPO, Shao et al. 2024)
    A_i /= std(r of the whole batch) + 1e-4                scale_rewards="batch" (Hu et al. 2025, REINFORCE++)
                                                           scale_rewards="none": no division (Liu et al. 2025,
                                                           Dr. GRPO)
std is torch.std (unbiased), as TRL; `group_advantages` lists the departures from TRL. The other estimators' pieces
(used by the parts rloo.py, reinforce_pp.py and ppo.py): `rloo_advantages` (leave-one-out), `normalize`, TRL's
`masked_whiten`, `kl_per_token` (k1, k3), `token_rewards`, `discounted_returns` (REINFORCE++) and `gae` (PPO).
"""

from __future__ import annotations

import torch

EPS = 1e-4  # TRL's epsilon in the std denominator


def group_advantages(rewards: torch.Tensor, group_ids: list, scale_rewards: str = "group") -> torch.Tensor:
    """Advantages of `rewards` [B] (float) whose group (prompt id) is group_ids[i]; returns [B] in rewards' dtype.

    The module docstring's formula, with TRL's departures: groups are found by prompt id, not by position in blocks
    of G, so rollouts may come in any order and groups may differ in size; a group whose rewards are all equal gets
    exactly 0 (TRL gets r - mean(r), which can be a rounding residue, divided by 1e-4); a group or batch of one
    sample has std 0 (torch.std gives NaN there).

    Raises ValueError for a length mismatch, an unknown scale_rewards, or a NaN/inf reward."""
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if rewards.dim() != 1 or len(group_ids) != rewards.numel():
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids ({len(group_ids)}) must both have length B")
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards={scale_rewards!r} is not valid; accepted values: group, batch, none")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards hold NaN or inf")
    advantages = torch.zeros_like(rewards)
    members = _members(group_ids)
    for idx in members:
        r = rewards[idx]
        if r.max() == r.min():
            continue  # exactly zero: nothing to learn from this group
        a = r - r.mean()
        if scale_rewards == "group":
            a = a / (r.std() + EPS)
        advantages[idx] = a
    if scale_rewards == "batch" and rewards.numel() > 1:
        advantages = advantages / (rewards.std() + EPS)
    return advantages


def _members(group_ids: list) -> list[torch.Tensor]:
    """Indices of each distinct group id, in order of first appearance."""
    groups: dict = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return [torch.tensor(v) for v in groups.values()]


def rloo_advantages(rewards: torch.Tensor, group_ids: list) -> torch.Tensor:
    """Leave-one-out advantages [B] (TRL 1.16 RLOOTrainer; Ahmadian et al. 2024, eq. 6): A_i = r_i - mean of the
    OTHER rewards of i's group. A group of one gets 0 (TRL: no baseline). Raises ValueError as `group_advantages`."""
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if rewards.dim() != 1 or len(group_ids) != rewards.numel():
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids ({len(group_ids)}) must both have length B")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards hold NaN or inf")
    advantages = torch.zeros_like(rewards)
    for idx in _members(group_ids):
        if idx.numel() > 1:
            r = rewards[idx]
            advantages[idx] = r - (r.sum() - r) / (idx.numel() - 1)
    return advantages


def normalize(advantages: torch.Tensor) -> torch.Tensor:
    """(A - mean) / (std + 1e-4) over the step, unbiased std (TRL RLOOTrainer `normalize_advantages`); [B] -> [B].
    One sample: unchanged minus its mean (0)."""
    if advantages.numel() < 2:
        return advantages - advantages.mean()
    return (advantages - advantages.mean()) / (advantages.std() + EPS)


def masked_whiten(values: list[torch.Tensor], masks: list[torch.Tensor], shift_mean: bool = True
                  ) -> list[torch.Tensor]:
    """Whiten per-token `values` over every masked token of every rollout together, as TRL's `masked_whiten`
    (trl/core.py, 0.24) and verl's: (v - mean) / sqrt(var + 1e-8), var unbiased (Bessel); shift_mean=False adds
    the mean back. values, masks: per rollout, [T] float64 and [T] 0/1. Returns per rollout [T], 0 where the mask
    is 0. Raises ValueError with fewer than 2 masked tokens (the unbiased variance needs 2)."""
    flat = torch.cat([v[m > 0] for v, m in zip(values, masks, strict=True)])
    if flat.numel() < 2:
        raise ValueError(f"whitening needs at least 2 completion tokens in the step, got {flat.numel()}")
    mean, var = flat.mean(), flat.var(unbiased=True)
    out = []
    for v, m in zip(values, masks, strict=True):
        w = (v - mean) * torch.rsqrt(var + 1e-8)
        if not shift_mean:
            w = w + mean
        out.append(torch.where(m > 0, w, torch.zeros_like(w)))
    return out


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """The per-token KL estimate of the sampling policy against the reference (Schulman 2020, "Approximating KL
    divergence"; TRL PPOTrainer): k1 = logp - ref_logp; k3 = (r - 1) - log r, r = exp(ref_logp - logp). [T] -> [T]."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":
        log_r = ref_logprobs - logprobs
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kl_estimator={estimator!r} is not valid; accepted values: k1, k3")


def token_rewards(score: float, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
                  ) -> torch.Tensor:
    """[T] per-token rewards of one rollout: -kl_coef * kl on its completion tokens (mask 1) and `score` added at
    the last of them (TRL PPOTrainer's `rewards[actual_end] += scores`, without its one-past-the-end placement: an
    unpadded rollout has no position after its last token). float64; all 0 when the mask is empty."""
    rewards = torch.zeros(mask.shape, dtype=torch.float64)
    if kl is not None and kl_coef:
        rewards = -kl_coef * kl.double() * mask
    trained = mask.nonzero()
    if trained.numel():
        rewards[int(trained[-1])] += score
    return rewards


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """[T] returns G_t = sum_{t' >= t} gamma^(t' - t) r_t' over the completion tokens of one rollout (verl
    `compute_reinforce_plus_plus_outcome_advantage`), 0 outside the mask; float64."""
    out, running = torch.zeros_like(rewards, dtype=torch.float64), 0.0
    for t in reversed(mask.nonzero().squeeze(1).tolist()):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the completion tokens of one rollout (Schulman et al. 2016; TRL
    PPOTrainer step 6): delta_t = r_t + gamma V_{t+1} - V_t (V after the last token = 0), A_t = delta_t + gamma lam
    A_{t+1}, returns = A + V. rewards, values [T] (values at the completion positions), mask [T] 0/1 -> ([T], [T])
    float64, 0 outside the mask. The recursion runs over the masked tokens only: a multi-turn trajectory's assistant
    tokens are consecutive steps across the environment turns between them, as verl's
    `compute_gae_advantage_return` skips its observation tokens."""
    advantages = torch.zeros(mask.shape, dtype=torch.float64)
    positions = mask.nonzero().squeeze(1).tolist()
    next_value = last = 0.0
    for t in reversed(positions):
        delta = float(rewards[t]) + gamma * next_value - float(values[t])
        last = delta + gamma * lam * last
        advantages[t] = last
        next_value = float(values[t])
    returns = (advantages + values.double()) * mask
    return advantages, returns
