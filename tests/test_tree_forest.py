"""One prefix forest per step (`tree.forest`, `EngineConfig.forest`): the groups of a step run as one trie, so a start
their prompts share (a system prompt, few-shot turns) runs once, and the gradient is the one of the per-group trees
and of the naive per-rollout reference (float64). Advantages stay per group and the loss normalisation per step
(`rollouts.batch.group_rollouts`, `algorithms.advantages.group_advantages`); a control that merges two groups'
advantages (one group of 2G) is seen.
"""

from types import SimpleNamespace

import pytest
import torch

from branchreplay.engine import EngineConfig, replay_backward, replay_logprobs
from branchreplay.engine.config import EVERY_SHARED_NODE
from branchreplay.losses import GRPOLoss
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.rl.algorithms.advantages import group_advantages
from branchreplay.rl.rollouts.batch import group_rollouts
from branchreplay.tree import RolloutTree, forest, forests
from helpers import grads

SYSTEM = [1, 7, 7, 3, 9, 12, 30, 31, 32, 33, 34, 35]  # every group's prompt opens with it
PROMPTS = [SYSTEM + [40, 41], SYSTEM + [50, 51, 52], [60, 61, 62]]  # the third shares nothing


def step_sequences(seed: int, G: int = 3) -> tuple[list[list[tuple]], torch.Tensor]:
    """Per group, G (ids, loss mask, truncated) of its prompt plus a random completion, and [B] rewards."""
    g = torch.Generator().manual_seed(seed)
    sequences = []
    for prompt in PROMPTS:
        group = []
        for _ in range(G):
            completion = torch.randint(3, 120, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
            group.append((prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion), False))
        sequences.append(group)
    return sequences, torch.rand(len(PROMPTS) * G, generator=g, dtype=torch.float64)


def grpo(loss_type: str = "grpo"):
    return SimpleNamespace(scale_rewards="group", mask_truncated_completions=False, loss_type=loss_type)


def scored(sequences, rewards, config) -> list:
    """Per group, its Rollouts with GRPO's group advantages and the step's loss weights, as a step trains them."""
    rollouts = group_rollouts(sequences, config, max_completion_length=8)
    flat = [r for group in rollouts for r in group]
    for r, a in zip(flat, group_advantages(rewards, [r.group for r in flat], config.scale_rewards).tolist(),
                    strict=True):
        r.advantages = torch.full((len(r),), a, dtype=torch.float64)
    return rollouts


def gradient(model, trees, loss, **engine):
    model.zero_grad(set_to_none=True)
    result = replay_backward(model, trees, loss, temperature=0.7, engine=EngineConfig(**{**EVERY_SHARED_NODE,
                                                                                        **engine}))
    return grads(model), result


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo"])
def test_one_forest_per_step_equals_per_group_trees_and_naive(loss_type, tiny64):
    model = tiny64("llama")
    rollouts = scored(*step_sequences(0), grpo(loss_type))
    trees = [RolloutTree(group) for group in rollouts]
    loss = GRPOLoss(beta=0.0, entropy_coef=0.01)
    together, merged = gradient(model, trees, loss)
    apart, alone = gradient(model, trees, loss, forest=False)
    model.zero_grad(set_to_none=True)
    naive_backward(model, [r for group in rollouts for r in group], loss, temperature=0.7)
    reference = grads(model)
    assert sum(g.abs().sum().item() for g in reference) > 0, "the test would pass trivially: no gradient"
    assert max_rel_grad_err(together, reference) <= 1e-6
    assert max_rel_grad_err(apart, reference) <= 1e-6
    # the system prompt ran once for the step, not once per group
    assert alone.stats.physical_tokens - merged.stats.physical_tokens == len(SYSTEM)
    assert merged.stats.logical_tokens == alone.stats.logical_tokens
    for a, b in zip(merged.logprobs, alone.logprobs, strict=True):  # per rollout, in the step's order
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_merging_the_groups_advantages_is_seen(tiny64):
    """Control: the two groups that share the system prompt scored as ONE group (their advantages against a common
    mean) give another gradient than the per-group advantages the step trains on."""
    model = tiny64("llama")
    sequences, rewards = step_sequences(1)
    rollouts = scored(sequences, rewards, grpo())
    wrong = scored([sequences[0] + sequences[1], sequences[2]], rewards, grpo())
    loss = GRPOLoss(beta=0.0)
    right, _ = gradient(model, [RolloutTree(group) for group in rollouts], loss)
    merged, _ = gradient(model, [RolloutTree(group) for group in wrong], loss)
    assert max_rel_grad_err(merged, right) > 1e-3


def test_forest_keeps_order_and_optional_fields_apart(tiny64):
    """Trees whose rollouts carry old logprobs and trees without run in one call (as separate forests): per-rollout
    results in the order given; `forest` of one tree is that tree; a tree with images is refused by name."""
    model = tiny64("llama")
    rollouts = scored(*step_sequences(2), grpo())
    for r in rollouts[1]:
        r.old_logprobs = torch.zeros(len(r), dtype=torch.float64)
    trees = [RolloutTree(group) for group in rollouts]
    ours = replay_logprobs(model, trees, engine=EngineConfig(**EVERY_SHARED_NODE))
    naive = naive_backward(model, [r for group in rollouts for r in group], None)
    for a, b in zip(ours.logprobs, naive.logprobs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    assert forest(trees[:1]) is trees[0]
    with pytest.raises(ValueError, match="images"):
        forest([trees[0], SimpleNamespace(images=object(), rollouts=[])])
    with pytest.raises(ValueError, match="at least one"):
        forest([])


def test_only_trees_that_share_a_start_merge():
    """`forests`: consecutive trees that share a first token become one tree; a tree that shares none with its
    neighbour stays itself (it runs exactly as alone)."""
    rollouts = scored(*step_sequences(3), grpo())
    trees = [RolloutTree(group) for group in rollouts]
    out = forests(trees + trees[:1])
    assert len(out) == 3 and out[1] is trees[2] and out[2] is trees[0]
    assert [id(r) for r in out[0].rollouts] == [id(r) for t in trees[:2] for r in t.rollouts]
    assert out[0].stats.physical_tokens == trees[0].stats.physical_tokens + trees[1].stats.physical_tokens - len(SYSTEM)
