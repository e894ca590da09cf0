"""Group-relative advantages, as TRL's GRPOTrainer (`_generate_and_score_completions`).

    A_i = r_i - mean(r of i's group)                       every scale_rewards mode
    A_i /= std(r of i's group) + 1e-4                      scale_rewards="group" (GRPO, Shao et al. 2024)
    A_i /= std(r of the whole batch) + 1e-4                scale_rewards="batch" (Hu et al. 2025, REINFORCE++)
                                                           scale_rewards="none": no division (Liu et al. 2025,
                                                           Dr. GRPO)
std is torch.std (unbiased), as TRL. Departures: groups are found by prompt id, not by position in blocks of G, so
rollouts may come in any order and groups may differ in size; a group whose rewards are all equal gets exactly 0
(TRL gets r - mean(r), which can be a rounding residue, divided by 1e-4); a group or batch of one sample has std 0
(torch.std gives NaN there).
"""

from __future__ import annotations

import torch

EPS = 1e-4  # TRL's epsilon in the std denominator


def group_advantages(rewards: torch.Tensor, group_ids: list, scale_rewards: str = "group") -> torch.Tensor:
    """Advantages of `rewards` [B] (float) whose group (prompt id) is group_ids[i]; returns [B] in rewards' dtype.

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


def group_std(rewards: torch.Tensor, group_ids: list) -> torch.Tensor:
    """[B] the reward std (unbiased; 0 for a group of one) of each sample's group: TRL's `reward_std` is its mean
    and `frac_reward_zero_std` the fraction of samples where it is 0."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    out = torch.zeros_like(rewards)
    for idx in _members(group_ids):
        if idx.numel() > 1:
            out[idx] = rewards[idx].std()
    return out


def _members(group_ids: list) -> list[torch.Tensor]:
    """Indices of each distinct group id, in order of first appearance."""
    groups: dict = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return [torch.tensor(v) for v in groups.values()]
