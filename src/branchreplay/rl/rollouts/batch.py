"""A step's sampled batch: the rollouts of every group with their rewards, group advantages and loss weights.

Rollouts are the prompt ids + the sampled ids (never re-tokenized), loss mask 1 on the completion (on the assistant
tokens of a multi-turn trajectory); advantages group-relative (`algorithms.advantages.group_advantages`, TRL's
GRPOTrainer `_generate_and_score_completions`); per-token weights from `losses.token_weights(loss_type)` over the
WHOLE step, so micro-batching and data parallelism do not change the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...losses import token_weights
from ...tree import Rollout, RolloutTree
from ..algorithms.advantages import group_advantages, group_std


@dataclass
class Batch:
    """One step's samples. Groups in prompt (item) order; flat [B] tensors and lists are group-major.

    rollouts: per group, its `Rollout`s with advantages and weights (G of them; a multi-turn group may have fewer).
    rewards, advantages: [B] float32. reward_std: [B] std of each sample's group (of the batch with
    scale_rewards="batch"), as TRL logs it. lengths: [B] trained (completion or assistant) tokens per rollout;
    truncated: [B] whether its last reply hit sampling.max_new_tokens without EOS.
    Single-turn: prompt_ids (per group, the chat-templated prompt) and samples (per group, G `Sample`s). Multi-turn:
    trajectories (per group, its `Trajectory`s) and metrics (`agent.task.trajectory_metrics`, the environment's
    seconds). items: per group, its dataset item. sampler_logprobs: per rollout [T] float64, the logprobs the
    sampler drew with (0 outside the trained tokens): the vLLM server's, or a sampler process's (grpo.max_staleness).
    versions: drawn ahead (grpo.max_staleness >= 1), per group the weights version that drew it (the sampling
    rounds trained before it); None when drawn by the weights that train it. trees: one `RolloutTree` per group
    (built once, with the batch).
    """

    rollouts: list[list[Rollout]]
    rewards: torch.Tensor
    advantages: torch.Tensor
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
    trees: list[RolloutTree] = field(init=False)

    def __post_init__(self):
        self.trees = [RolloutTree(group) for group in self.rollouts]

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

    def completions(self, tokenizer, advantages: bool = True) -> list[dict]:
        """One row per rollout for the completions log: the item's prompt and the decoded completion (multi-turn:
        the conversation's messages, turns, how it ended), its reward, and its group advantage unless `advantages`
        is False (the other algorithms set theirs after the old-policy and critic passes, per token)."""
        rows = []
        flat = [(item, s) for item, group in zip(self.items, self.samples or self.trajectories) for s in group]
        for (item, s), reward, advantage in zip(flat, self.rewards.tolist(), self.advantages.tolist()):
            if self.trajectories:
                row = {"messages": s.conversation.messages, "turns": s.turns, "ended_by": s.ended_by}
            else:
                row = {"prompt": item["question"],
                       "completion": tokenizer.decode(s.completion_ids, skip_special_tokens=True)}
            rows.append({**row, "reward": reward, **({"advantage": advantage} if advantages else {})})
        return rows


def group_rollouts(sequences: list[list[tuple]], rewards: torch.Tensor, grpo, max_completion_length: int
                   ) -> tuple[list[list[Rollout]], torch.Tensor, torch.Tensor]:
    """Per group, its Rollouts from (token ids, loss mask, truncated) in group-major order matching `rewards` [B]:
    group advantages (grpo.scale_rewards), the reward std TRL logs, loss weights over the WHOLE step
    (`losses.token_weights` with grpo.loss_type; truncated sequences masked out with
    grpo.mask_truncated_completions). Returns (rollouts per group, advantages [B], reward_std [B])."""
    groups = [gi for gi, group in enumerate(sequences) for _ in group]
    advantages = group_advantages(rewards, groups, grpo.scale_rewards)
    std = group_std(rewards, groups) if grpo.scale_rewards != "batch" else rewards.std().expand_as(rewards)
    flat = [(ids, [m * float(not (grpo.mask_truncated_completions and cut)) for m in mask], gi)
            for gi, group in enumerate(sequences) for ids, mask, cut in group]
    weights = token_weights([mask for _, mask, _ in flat], grpo.loss_type,
                            max_completion_length=max_completion_length)
    rollouts = [[] for _ in sequences]
    for (ids, mask, gi), w, adv in zip(flat, weights, advantages.tolist()):
        rollouts[gi].append(Rollout(ids, mask, advantages=adv, weights=w, group=gi))
    return rollouts, advantages, std
