"""Positions: rotary encodings whose frequencies depend on the forward's length, and models with a position limit.

Reference: `naive_backward`, the same HF model on each rollout alone (one forward of T tokens: longrope picks its
long factors when T > original_max_position_embeddings, dynamic NTK scales for T > max_position_embeddings). The
engine runs a prompt and its branches in separate calls, so without `positions.held_at_length` the prompt's K/V
would carry other frequencies than the rollout's (on the main branch before the fix: gradient error 1.6, logprob
error 5.5 nats for the `above` tree below). Trees: every rollout at or below the threshold, every rollout above it,
and lengths around it in one tree (two regimes, run as two sub-forests).
"""

import pytest
import torch

from branchreplay.decode.config import SamplingConfig
from branchreplay.decode.loop import sample_group
from branchreplay.engine import EngineConfig, replay_backward, replay_logprobs
from branchreplay.engine.config import EVERY_SHARED_NODE
from branchreplay.engine.positions import length_dependent_rotaries, regimes
from branchreplay.losses import GRPOLoss
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.reference.shapes import around_length, make_rollouts, shared_prompt
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import RolloutTree
from helpers import grads

THRESHOLD = 32  # original_max_position_embeddings (longrope) / max_position_embeddings (dynamic)
ROPE = {
    # Phi3Config copies its top-level original_max_position_embeddings (default 4096) into rope_parameters
    "longrope": dict(max_position_embeddings=128, original_max_position_embeddings=THRESHOLD, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
        "original_max_position_embeddings": THRESHOLD}),
    "dynamic": dict(max_position_embeddings=THRESHOLD, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}),
}
TREES = {
    "below": lambda g: shared_prompt(12, 4, 6, 256, g),  # 18 tokens each
    "above": lambda g: shared_prompt(24, 4, 20, 256, g),  # 44 tokens each
    "mixed": lambda g: around_length(THRESHOLD, 256, g),  # 31, 32, 33 and 36 tokens
}


def _model(tiny64, arch, rope, dtype=torch.float64):
    return tiny64(arch, dtype, **ROPE[rope])



def _compare(model, rollouts, **engine_kw):
    loss = GRPOLoss(beta=0.0, entropy_coef=0.01)
    model.zero_grad(set_to_none=True)
    naive = naive_backward(model, rollouts, loss)
    g_naive = grads(model)
    model.zero_grad(set_to_none=True)
    engine = EngineConfig(**{"chunk_tokens": 16, **EVERY_SHARED_NODE, **engine_kw})
    replay = replay_backward(model, RolloutTree(rollouts), loss, engine=engine)
    lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive.logprobs, strict=True))
    return max_rel_grad_err(grads(model), g_naive), lp_err, replay


CASES = [(arch, rope, tree) for arch, rope in (("llama", "longrope"), ("phi3", "longrope"), ("llama", "dynamic"))
         for tree in TREES]


@pytest.mark.parametrize("arch, rope, tree", CASES, ids=[f"{a}-{r}-{t}" for a, r, t in CASES])
def test_length_dependent_rope_equals_naive(arch, rope, tree, tiny64):
    g = torch.Generator().manual_seed(len(arch) * 100 + len(tree))
    model = _model(tiny64, arch, rope)
    rollouts = make_rollouts(TREES[tree](g), g)
    grad_err, lp_err, replay = _compare(model, rollouts)
    assert grad_err <= 1e-6 and lp_err <= 1e-9, (grad_err, lp_err)
    lengths = [len(r) for r in rollouts]
    groups = regimes(length_dependent_rotaries(model), lengths)
    if tree == "mixed":  # two regimes: each sub-forest holds its own copy of the prompt
        assert len(groups) == (2 if rope == "longrope" else 3)
        assert replay.stats.physical_tokens > RolloutTree(rollouts).stats.physical_tokens
    else:
        assert len(groups) == 1


def test_dynamic_rope_is_exact_after_the_model_ran_a_longer_sequence(tiny64):
    """transformers' dynamic NTK keeps the frequencies of the longest call seen; the engine and the reference both
    start each rollout from the state after loading, so earlier calls change nothing."""
    g = torch.Generator().manual_seed(3)
    model = _model(tiny64, "llama", "dynamic")
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (1, 100), generator=g))  # grows the cached frequencies to 100
    grad_err, lp_err, _ = _compare(model, make_rollouts(TREES["above"](g), g))
    assert grad_err <= 1e-6 and lp_err <= 1e-9, (grad_err, lp_err)


@pytest.mark.parametrize("rope", sorted(ROPE))
def test_rotary_module_is_restored_after_the_engine(rope, tiny64):
    """After the engine, a plain forward is transformers' own: no instance forward left on the rotary module, and
    the same logits as before the engine ran (also for dynamic NTK, whose state the engine changes while it runs)."""
    g = torch.Generator().manual_seed(4)
    model = _model(tiny64, "llama", rope)
    ids = torch.randint(0, 256, (1, 44), generator=g)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    (rotary,) = length_dependent_rotaries(model)
    replay_backward(model, RolloutTree(make_rollouts(TREES["mixed"](g), g)), GRPOLoss())
    assert "forward" not in vars(rotary)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)


def test_a_position_limit_in_the_config_is_not_a_length_limit_for_dynamic_rope(tiny64):
    """Dynamic NTK extrapolates past max_position_embeddings by design: such rollouts are accepted; longrope's
    max_position_embeddings stays a limit, refused by name."""
    g = torch.Generator().manual_seed(5)
    long = make_rollouts(shared_prompt(100, 2, 40, 256, g), g)  # 140 tokens > 128 and > 32
    replay_logprobs(_model(tiny64, "llama", "dynamic"), RolloutTree(long))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        replay_logprobs(_model(tiny64, "llama", "longrope"), RolloutTree(long))


# -- models with learned positions (GPT-2): the planner's memory probe stays within the table --------------------

@pytest.mark.parametrize("replay", ["auto", "keep"])
def test_gpt2_with_a_short_position_table_runs_valid_trees(replay, tiny64):
    """n_positions=64: one 20-token rollout failed with IndexError in the memory probe (it ran 7 x 16 positions)."""
    g = torch.Generator().manual_seed(6)
    model = tiny_model("gpt2", dtype=torch.float64, max_position_embeddings=64)
    grad_err, lp_err, _ = _compare(model, make_rollouts(shared_prompt(10, 1, 10, 256, g), g), replay=replay)
    assert grad_err <= 1e-6 and lp_err <= 1e-9, (grad_err, lp_err)


def test_gpt2_at_its_real_size_runs_8_rollouts_of_600_tokens(tiny64):
    """n_positions=1024: 8 distinct rollouts of 600 tokens (4800 unique positions) made the probe run 7 x 256."""
    g = torch.Generator().manual_seed(7)
    model = tiny_model("gpt2", dtype=torch.float32, max_position_embeddings=1024)
    rollouts = make_rollouts([(torch.randint(0, 256, (600,), generator=g).tolist(), [0] * 500 + [1] * 100)
                              for _ in range(8)], g)
    grad_err, lp_err, _ = _compare(model, rollouts, chunk_tokens=4096)
    assert grad_err <= 1e-4 and lp_err <= 1e-4, (grad_err, lp_err)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_sampling_past_the_position_limit_is_refused_before_any_work(arch, tiny64):
    model = tiny_model(arch, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"max_new_tokens.*max_position_embeddings \(64\).*at most 4"):
        sample_group(model, list(range(1, 61)), 2, SamplingConfig(max_new_tokens=8), eos_token_ids=[2])
