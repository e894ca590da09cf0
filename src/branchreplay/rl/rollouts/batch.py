"""A step's sampled batch: the rollouts of every group with their rewards and loss weights.

Rollouts are the prompt ids + the sampled ids (never re-tokenized), loss mask 1 on the completion (on the assistant
tokens of a multi-turn trajectory); per-token weights from `losses.token_weights(loss_type)` over the WHOLE step, so
micro-batching and data parallelism do not change the gradient. The advantages are the algorithm's (its
`estimate`, after the batch is scored).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from ...losses import token_weights
from ...tree import Rollout, RolloutTree


@dataclass
class Drawn:
    """What a back-end drew for `step` from `items`. Single-turn: prompt_ids and samples ({group k: its Samples},
    this rank's), failure (a rank's or the server's, re-raised after the gather). Multi-turn: trajectories ({item k:
    its Trajectories}, every rank's), timings, errors. sync_s: the weight sync's seconds (None in-process)."""

    step: int
    items: list[dict]
    prompt_ids: list[list[int]] = field(default_factory=list)
    samples: dict = field(default_factory=dict)
    failure: tuple | None = None
    trajectories: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    sync_s: float | None = None


@dataclass
class Batch:
    """One step's samples. Groups in prompt (item) order; flat [B] tensors and lists are group-major.

    rollouts: per group, its `Rollout`s with their loss weights (G of them; a multi-turn group may have fewer).
    rewards: [B] float32. reward_std: [B] std of each sample's group (of the batch with scale_rewards="batch"), as
    TRL logs it. lengths: [B] trained (completion or assistant) tokens per rollout; truncated: [B] whether its last
    reply hit sampling.max_new_tokens without EOS.
    Single-turn: prompt_ids (per group, the chat-templated prompt) and samples (per group, G `Sample`s). Multi-turn:
    trajectories (per group, its `Trajectory`s) and metrics (`agent.task.trajectory_metrics`, the environment's
    seconds). items: per group, its dataset item. sampler_logprobs: per rollout [T] float64, the logprobs the
    sampler drew with (0 outside the trained tokens): the vLLM server's, or a sampler process's (grpo.max_staleness).
    versions: drawn ahead (grpo.max_staleness >= 1), per group the weights version that drew it (the sampling
    rounds trained before it); None when drawn by the weights that train it. trees: one `RolloutTree` per group,
    built on first use (the step's trees phase).
    """

    rollouts: list[list[Rollout]]
    rewards: torch.Tensor
    reward_std: torch.Tensor
    lengths: list[int]
    truncated: list[bool]
    prompt_ids: list[list[int]] = field(default_factory=list)
    samples: list[list] = field(default_factory=list)
    trajectories: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    items: list[dict] = field(default_factory=list)
    sampler_logprobs: list[torch.Tensor] | None = None
    versions: list[int] | None = None

    @cached_property
    def trees(self) -> list[RolloutTree]:
        """One prefix tree per group (its rollouts' shared prompt and branches)."""
        return [RolloutTree(group) for group in self.rollouts]

    @property
    def flat(self) -> list[Rollout]:
        """Every rollout, group-major: the order of `rewards`."""
        return [r for group in self.rollouts for r in group]

    @property
    def logical_tokens(self) -> int:
        """Positions of every rollout, shared or not (TRL's num_tokens counts them)."""
        return sum(len(r) for group in self.rollouts for r in group)

    def step_metrics(self) -> dict:
        """TRL's reward, reward_std, frac_reward_zero_std, completions/mean_length and completions/clipped_ratio."""
        n = len(self.lengths)
        return {"reward": self.rewards.mean().item(), "reward_std": self.reward_std.mean().item(),
                "frac_reward_zero_std": torch.isclose(self.reward_std, torch.zeros(())).float().mean().item(),
                "completions/mean_length": sum(self.lengths) / n, "completions/clipped_ratio": sum(self.truncated) / n}

    def completions(self, tokenizer, advantages: torch.Tensor | None = None) -> list[dict]:
        """One row per rollout for the completions log: the item's prompt and the decoded completion (multi-turn:
        the conversation's messages, turns, how it ended), its reward, and its advantage from `advantages` [B]
        (GRPO's group advantages; the other algorithms' are per token, and not logged)."""
        rows = []
        flat = [(item, s) for item, group in zip(self.items, self.samples or self.trajectories,
                                                 strict=True) for s in group]
        logged = advantages.tolist() if advantages is not None else [None] * len(flat)
        for (item, s), reward, advantage in zip(flat, self.rewards.tolist(), logged, strict=True):
            if self.trajectories:
                row = {"messages": s.conversation.messages, "turns": s.turns, "ended_by": s.ended_by}
            else:
                row = {"prompt": item["question"],
                       "completion": tokenizer.decode(s.completion_ids, skip_special_tokens=True)}
            rows.append({**row, "reward": reward, **({"advantage": advantage} if advantage is not None else {})})
        return rows


def group_rollouts(sequences: list[list[tuple]], grpo, max_completion_length: int) -> list[list[Rollout]]:
    """Per group, its Rollouts from (token ids, loss mask, truncated), group-major, with loss weights over the WHOLE
    step (`losses.token_weights` with grpo.loss_type; truncated sequences masked out with
    grpo.mask_truncated_completions) and their group's index."""
    flat = [(ids, [m * float(not (grpo.mask_truncated_completions and cut)) for m in mask], gi)
            for gi, group in enumerate(sequences) for ids, mask, cut in group]
    weights = token_weights([mask for _, mask, _ in flat], grpo.loss_type,
                            max_completion_length=max_completion_length)
    rollouts = [[] for _ in sequences]
    for (ids, mask, gi), w in zip(flat, weights, strict=True):
        rollouts[gi].append(Rollout(ids, mask, weights=w, group=gi))
    return rollouts


def group_std(rewards: torch.Tensor, group_ids: list, scale_rewards: str = "group") -> torch.Tensor:
    """[B] the reward std (unbiased; 0 for a group of one) of each sample's group, or of the whole batch with
    scale_rewards="batch": TRL's `reward_std` is its mean and `frac_reward_zero_std` the fraction of samples where
    it is 0."""
    if scale_rewards == "batch":
        return rewards.std().expand_as(rewards)
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    out = torch.zeros_like(rewards)
    groups: dict = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    for idx in groups.values():
        if len(idx) > 1:
            out[idx] = rewards[idx].std()
    return out
