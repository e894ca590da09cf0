import time

import pytest
import torch

from branchreplay.tree import Rollout, RolloutTree


def _shape(tree):
    return [(n.start, n.tokens.tolist(), n.rollouts, len(n.children)) for n in tree.nodes()]


def test_shared_prompt_branches_prefix_identical_and_forest():
    P = [1, 2, 3, 4]
    rs = [Rollout(P + [5, 6]), Rollout(P + [5, 7]), Rollout(P + [9]), Rollout(P), Rollout(P), Rollout([7, 8])]
    tree = RolloutTree(rs)
    assert _shape(tree) == [
        (0, [1, 2, 3, 4], [0, 1, 2, 3, 4], 2),  # identical rollouts 3, 4 end here: a prefix of the others
        (4, [5], [0, 1], 2),
        (5, [6], [0], 0),
        (5, [7], [1], 0),
        (4, [9], [2], 0),
        (0, [7, 8], [5], 0),  # a second root: the forest
    ]
    s = tree.stats
    assert (s.logical_tokens, s.physical_tokens, s.nodes, s.depth, s.rollouts) == (27, 10, 6, 3, 6)
    assert s.token_ratio == pytest.approx(2.7)


def test_single_rollout_is_a_chain_of_one_node():
    tree = RolloutTree([Rollout([3, 1, 4, 1, 5])])
    assert _shape(tree) == [(0, [3, 1, 4, 1, 5], [0], 0)]
    assert tree.stats.token_ratio == 1.0


def test_every_rollout_is_the_concatenation_of_its_path():
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 5, (30,), generator=g).tolist()
    rs = [Rollout(base[: int(torch.randint(1, 30, (), generator=g))] + torch.randint(0, 5, (4,), generator=g).tolist())
          for _ in range(40)]
    tree = RolloutTree(rs)
    for i, r in enumerate(rs):
        path = [n for n in tree.nodes() if i in n.rollouts]
        assert torch.cat([n.tokens for n in path]).tolist() == r.token_ids.tolist()
        assert [n.start for n in path] == sorted(n.start for n in path)
    # siblings differ in their first token: the tree is a radix trie
    for node in [tree.root] + tree.nodes():
        firsts = [c.tokens[0].item() for c in node.children]
        assert len(firsts) == len(set(firsts))


def test_deep_tree_does_not_hit_the_recursion_limit():
    rs = [Rollout([1] * d + [2]) for d in range(1, 1500)]
    assert RolloutTree(rs).stats.depth == 1499  # the last two tokens of the longest rollout share a node


def test_building_64_rollouts_of_32k_tokens_is_fast():
    prompt = torch.randint(0, 50_000, (32_000,))
    rs = [Rollout(torch.cat([prompt, torch.randint(0, 50_000, (768,))])) for _ in range(64)]
    t0 = time.perf_counter()
    tree = RolloutTree(rs)
    elapsed = time.perf_counter() - t0
    assert tree.stats.logical_tokens == 64 * 32_768
    assert elapsed < 5.0  # generous bound against a pathological (per-token Python) build; measured in bench


def test_no_rollouts():
    with pytest.raises(ValueError, match="at least one rollout"):
        RolloutTree([])


@pytest.mark.parametrize("field, value, match", [
    ("old_logprobs", [0.0, float("nan"), -1.0, -1.0, -1.0], r"old_logprobs\[1\] is nan"),
    ("ref_logprobs", [0.0, 0.0, -1.0, float("inf"), -1.0], r"ref_logprobs\[3\] is inf"),
    ("ref_logprobs", [0.0, 0.0, -1.0, -1.0, float("-inf")], r"ref_logprobs\[4\] is -inf"),
])
def test_non_finite_old_or_ref_logprobs_are_refused(field, value, match):
    """They used to run and return a NaN loss and NaN gradients."""
    with pytest.raises(ValueError, match=match):
        Rollout([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], **{field: value})


def test_a_batch_of_token_ids_is_not_one_rollout():
    """A [B, T] batch used to be flattened into one sequence of B * T tokens."""
    with pytest.raises(ValueError, match=r"token_ids has shape \(2, 5\), expected \[T\].*one Rollout per row"):
        Rollout(torch.ones(2, 5, dtype=torch.long))
