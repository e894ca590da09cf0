"""Proof of exactness: the execution stack equals the naive per-rollout computation.

Reference: `naive_backward`, the same Hugging Face model on each rollout alone (unpadded, no cache, full logits),
the same loss, summed. Error measure: per parameter max|g_replay - g_naive| / max|g_naive|, max over parameters.
float64 models run with `keep_float64` (HF's RMSNorm casts to float32 otherwise, on both sides alike).
"""

import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from branchreplay.bench.scenarios import agent_trajectories
from branchreplay.engine import EngineConfig, replay_backward, replay_logprobs
from branchreplay.engine.config import EVERY_SHARED_NODE
from branchreplay.losses import GRPOLoss
from branchreplay.reference.float64 import keep_float64
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.reference.shapes import SHAPES, make_rollouts, shared_prompt
from branchreplay.tiny_models import TINY_ARCHS, tiny_model
from branchreplay.tree import Rollout, RolloutTree
from helpers import grads

TOL = {torch.float64: 1e-6, torch.float32: 1e-4}
LOGPROB_TOL = {torch.float64: 1e-9, torch.float32: 1e-4}




def compare(model, rollouts, loss, temperature=1.0, **engine_kw):
    """Run naive and replay on the same model; return (grad err, max logprob err, loss err, grad norm)."""
    engine = EngineConfig(**{**EVERY_SHARED_NODE, **engine_kw})  # every shared node kept (the tree)
    model.zero_grad(set_to_none=True)
    naive = naive_backward(model, rollouts, loss, temperature=temperature)
    g_naive = grads(model)
    model.zero_grad(set_to_none=True)
    replay = replay_backward(model, RolloutTree(rollouts), loss, temperature=temperature, engine=engine)
    g_replay = grads(model)
    lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive.logprobs, strict=True))
    norm = sum(g.abs().sum().item() for g in g_naive)
    return max_rel_grad_err(g_replay, g_naive), lp_err, abs(replay.loss - naive.loss), norm


# Every shape in float64 (the tight bound); float32 on the two shapes with the most branch points (float32's own
# rounding is the same on every shape).
CASES = [(arch, shape, torch.float64) for arch in TINY_ARCHS for shape in sorted(SHAPES)]
CASES += [(arch, shape, torch.float32) for arch in TINY_ARCHS for shape in ("branches-of-branches", "multi-turn")]


@pytest.mark.slow
@pytest.mark.parametrize("arch, shape, dtype", CASES, ids=[f"{a}-{s}-{str(d)[-7:]}" for a, s, d in CASES])
def test_replay_equals_naive(arch, shape, dtype, tiny64):
    g = torch.Generator().manual_seed(zlib.crc32(f"{arch}/{shape}".encode()))  # not hash(): salted per process
    model = tiny64(arch, dtype)
    rollouts = make_rollouts(SHAPES[shape](model.config.vocab_size, g), g)
    grad_err, lp_err, loss_err, norm = compare(model, rollouts, GRPOLoss(entropy_coef=0.01), temperature=0.7,
                                               max_pack_tokens=24)
    assert norm > 0, "the test would pass trivially: no gradient"
    assert grad_err <= TOL[dtype], f"{arch}/{shape}/{dtype}: max relative grad error {grad_err:.3e}"
    assert lp_err <= LOGPROB_TOL[dtype], f"{arch}/{shape}/{dtype}: max logprob error {lp_err:.3e}"
    assert loss_err <= 1e-5 * max(1.0, abs(norm)), f"loss differs by {loss_err:.3e}"


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_long_prompt_eight_branches_with_kl_and_old_logprobs(arch, tiny64):
    """Long shared prompt + 8 branches, PPO ratio against old logprobs, k3 KL against reference logprobs."""
    g = torch.Generator().manual_seed(1)
    model = tiny64(arch, torch.float64)
    rollouts = make_rollouts(shared_prompt(96, 8, 12, model.config.vocab_size, g), g, old_logprobs=True)
    for r in rollouts:
        r.ref_logprobs = r.old_logprobs - 0.1
    loss = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, beta=0.04)
    grad_err, lp_err, _, norm = compare(model, rollouts, loss, temperature=1.3)
    assert norm > 0
    assert grad_err <= 1e-6 and lp_err <= 1e-9, (grad_err, lp_err)


def test_clipping_is_active_and_still_exact(tiny64):
    """Old logprobs = current ones + noise, so that some ratios fall outside the clip range and some inside."""
    g = torch.Generator().manual_seed(2)
    model = tiny64("qwen2", torch.float64)
    rollouts = make_rollouts(SHAPES["branches-of-branches"](model.config.vocab_size, g), g)
    current = replay_logprobs(model, RolloutTree(rollouts)).logprobs
    for r, lp in zip(rollouts, current, strict=True):
        noise = 0.4 * (torch.rand(len(r), generator=g, dtype=torch.float64) - 0.5)
        r.old_logprobs = (lp.double() + noise) * r.loss_mask
    ratios = torch.cat([(lp.double() - r.old_logprobs).exp()[r.loss_mask > 0] for lp, r in zip(current, rollouts,
                                                                                               strict=True)])
    outside = (ratios < 0.9) | (ratios > 1.1)
    assert outside.any() and not outside.all()
    grad_err, _, _, norm = compare(model, rollouts, GRPOLoss(epsilon_low=0.1, epsilon_high=0.1))
    assert norm > 0 and grad_err <= 1e-6


@pytest.mark.parametrize("replay", ["keep", "replay"])
@pytest.mark.parametrize("max_pack_tokens, chunk_tokens", [(1, 4096), (7, 3), (10_000, 5), (10_000, 4096)])
def test_packing_chunking_and_replay_do_not_change_gradients(max_pack_tokens, chunk_tokens, replay, tiny64):
    g = torch.Generator().manual_seed(3)
    model = tiny64("llama", torch.float64)
    rollouts = make_rollouts(SHAPES["multi-turn"](model.config.vocab_size, g), g)
    grad_err, lp_err, _, _ = compare(model, rollouts, GRPOLoss(), max_pack_tokens=max_pack_tokens,
                                     chunk_tokens=chunk_tokens, head_chunk_tokens=5, replay=replay)
    assert grad_err <= 1e-6 and lp_err <= 1e-9


@pytest.mark.parametrize("arch", ["mistral", "gpt2"])
def test_chunks_across_a_sliding_window_with_replay(arch, tiny64):
    """Chunks shorter than, equal to and longer than Mistral's window (16), replayed."""
    g = torch.Generator().manual_seed(8)
    model = tiny64(arch, torch.float64)
    rollouts = make_rollouts(shared_prompt(50, 4, 20, model.config.vocab_size, g), g)
    for chunk in (5, 16, 23):
        grad_err, lp_err, _, _ = compare(model, rollouts, GRPOLoss(), chunk_tokens=chunk, replay="replay")
        assert grad_err <= 1e-6 and lp_err <= 1e-9, (chunk, grad_err, lp_err)


def test_eager_attention_uses_an_additive_mask(tiny64):
    """Eager attention adds the mask (a boolean tree mask would be off by O(1)). HF's eager softmax runs in float32
    even in a float64 model, so the bound here is float32's."""
    g = torch.Generator().manual_seed(4)
    model = tiny64("mistral", torch.float64, attn_implementation="eager")
    rollouts = make_rollouts(SHAPES["branches-of-branches"](model.config.vocab_size, g), g)
    grad_err, lp_err, _, _ = compare(model, rollouts, GRPOLoss())
    assert grad_err <= 1e-5 and lp_err <= 1e-5


def test_first_token_of_a_child_is_in_the_loss(tiny64):
    """A tree whose only trainable positions are the first tokens of the branches: their loss comes entirely
    from the parent's last hidden state. Dropping that transition would give zero gradient."""
    g = torch.Generator().manual_seed(5)
    model = tiny64("llama", torch.float64)
    prompt = torch.randint(0, 256, (12,), generator=g).tolist()
    rollouts = [Rollout(prompt + [b, 7, 8], [0] * 12 + [1, 0, 0], advantages=1.0 - b / 100) for b in (10, 20, 30)]
    grad_err, lp_err, _, norm = compare(model, rollouts, GRPOLoss())
    assert norm > 0 and grad_err <= 1e-6 and lp_err <= 1e-9


def test_replay_logprobs_equals_naive_and_builds_no_graph(tiny64):
    g = torch.Generator().manual_seed(6)
    model = tiny64("gpt2", torch.float64)
    rollouts = make_rollouts(SHAPES["forest"](model.config.vocab_size, g), g)
    with torch.enable_grad():
        out = replay_logprobs(model, [RolloutTree(rollouts[:3]), RolloutTree(rollouts[3:])], temperature=0.5)
    ref = naive_backward(model, rollouts, None, temperature=0.5)
    assert all(lp.grad_fn is None for lp in out.logprobs)
    assert all(p.grad is None for p in model.parameters())
    err = max((a - b).abs().max().item() for a, b in zip(out.logprobs, ref.logprobs, strict=True))
    assert err <= 1e-9
    assert out.stats.rollouts == len(rollouts)
    empty = replay_logprobs(model, [])
    assert empty.logprobs == [] and empty.loss == 0.0 and empty.stats.rollouts == 0


def test_gradients_accumulate_like_backward(tiny64):
    """Two calls add up, as two loss.backward() calls do."""
    g = torch.Generator().manual_seed(7)
    model = tiny64("llama", torch.float64)
    rollouts = make_rollouts(SHAPES["edge-cases"](model.config.vocab_size, g), g)
    model.zero_grad(set_to_none=True)
    replay_backward(model, RolloutTree(rollouts), GRPOLoss())
    once = grads(model)
    replay_backward(model, RolloutTree(rollouts), GRPOLoss())
    twice = grads(model)
    assert max_rel_grad_err(twice, [2 * x for x in once]) <= 1e-12


@pytest.mark.parametrize("replay", ["keep", "replay"])
def test_packs_below_different_parents_equal_naive(replay, monkeypatch, tiny64):
    """Agent trajectories (uneven forks at every turn): under split prefix attention the nodes of one depth run in
    packs that mix parents, as batches (nodes with children among them) and as tree-masked packs, each node against
    its own parent's prefix. The gradient and logprobs equal naive; a control where every node of such a pack sees
    the first parent's prefix fails."""
    from branchreplay.engine import cache

    model = tiny64("llama", torch.float64)
    g = torch.Generator().manual_seed(11)
    rollouts = make_rollouts(agent_trajectories(12, 3, 5, 4, (2, 1, 3), model.config.vocab_size, g), g)
    built = []
    original = cache.PrefixCache.__init__

    def spy(self, *args, groups=None, **kwargs):
        built.append(0 if groups is None else len(groups))
        original(self, *args, groups=groups, **kwargs)

    monkeypatch.setattr(cache.PrefixCache, "__init__", spy)
    grad_err, lp_err, _, norm = compare(model, rollouts, GRPOLoss(), max_pack_tokens=24, replay=replay)
    assert max(built) >= 2, built  # a pack below two or more parents ran
    assert norm > 0 and grad_err <= 1e-10 and lp_err <= 1e-12, (grad_err, lp_err)

    prefix = cache._PrefixLayer._prefix

    def first_parent_only(self, queries):
        keys, values, groups = prefix(self, queries)
        return cache.Prefix(keys, values, tuple((a, b, groups[0][2]) for a, b, _ in groups))

    monkeypatch.setattr(cache._PrefixLayer, "_prefix", first_parent_only)
    grad_err, lp_err, _, _ = compare(model, rollouts, GRPOLoss(), max_pack_tokens=24, replay=replay)
    assert grad_err > 1e-3 and lp_err > 1e-3


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), pack=st.integers(1, 40), arch=st.sampled_from(["llama", "gpt2", "mistral"]))
def test_random_trees(seed, pack, arch):
    g = torch.Generator().manual_seed(seed)
    model = tiny_model(arch, dtype=torch.float64)
    rollouts = make_rollouts(SHAPES["random"](model.config.vocab_size, g), g)
    with keep_float64(model):  # a context, not a fixture: hypothesis runs the body once per example
        grad_err, lp_err, loss_err, _ = compare(model, rollouts, GRPOLoss(entropy_coef=0.1), max_pack_tokens=pack)
    assert grad_err <= 1e-6 and lp_err <= 1e-9 and loss_err <= 1e-9


# -- bad input --------------------------------------------------------------------------------------------------------


def _tree(ids, **kw):
    return RolloutTree([Rollout(ids, [0] + [1] * (len(ids) - 1), **kw)])


def test_token_id_outside_vocabulary(tiny64):
    model = tiny64("llama", torch.float32)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        replay_backward(model, _tree([1, 2, 999]), GRPOLoss())


def test_rollout_longer_than_max_positions(tiny64):
    model = tiny64("gpt2", torch.float32, max_position_embeddings=16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        replay_backward(model, _tree(list(range(20))), GRPOLoss())


def test_active_dropout_is_refused():
    model = tiny_model("gpt2", resid_pdrop=0.1).train()
    with pytest.raises(ValueError, match="dropout"):
        replay_backward(model, _tree([1, 2, 3]), GRPOLoss())


def test_unsupported_family_is_refused_by_name():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from branchreplay.engine import UnsupportedModelError

    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    model = GPTNeoXForCausalLM(cfg).eval()
    with pytest.raises(UnsupportedModelError, match="gpt_neox.*branchreplay verify"):
        replay_backward(model, _tree([1, 2, 3]), GRPOLoss())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(token_ids=[]), "empty"),
        (dict(token_ids=[1, 2, 3], loss_mask=[0, 1]), "loss_mask has shape"),
        (dict(token_ids=[1, 2, 3], loss_mask=[1, 1, 1]), r"loss_mask\[0\]"),
        (dict(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], advantages=[1.0, 2.0]), "advantages has shape"),
        (dict(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], advantages=float("nan")), "NaN or inf"),
        (dict(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], advantages=[0, float("inf"), 0]), "NaN or inf"),
        (dict(token_ids=[1, 2, 3], loss_mask=[0, 0, 1], weights=[0, 1, 1]), "weights is non-zero"),
    ],
)
def test_bad_rollouts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Rollout(**kwargs)


def test_old_logprobs_for_some_rollouts_only(tiny64):
    model = tiny64("llama", torch.float32)
    rs = [Rollout([1, 2, 3], [0, 1, 1], old_logprobs=[0, -1, -1]), Rollout([1, 2, 4], [0, 1, 1])]
    with pytest.raises(ValueError, match="old_logprobs"):
        replay_backward(model, RolloutTree(rs), GRPOLoss())
