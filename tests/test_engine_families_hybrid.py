"""Hybrid families under the engine: Granite 4.0 hybrid (`granitemoehybrid`: Mamba2 + attention layers, MoE with a
shared MLP in every layer, muP multipliers), Zamba2 (Mamba2 layers; its "hybrid" layers run one shared transformer
block, tied across its uses, in front of their Mamba2 mixer: `recurrent.HybridLayer`), Kimi Linear (Kimi delta
attention + multi-head latent attention, MoE) and OLMo Hybrid (gated delta-net + attention with QK norm).

Their exactness on every tree shape, single-token children, chunked and replayed nodes, and with transformers'
float32 casts made float64 (the engine itself then agrees to ~1e-14), is tested with the other recurrent families
through `tiny_models.RECURRENT_ARCHS` (tests/test_engine_families_recurrent.py). Here: their layer kinds and mixer
forwards, float32 judged against a float64 copy over 20 random trees, and the refusal by name of an unregistered
hybrid, with or without `force`.
"""

import pytest
import torch

from branchreplay.check.rounding import TREE_RATIO, judge_rounding
from branchreplay.engine import EngineConfig, replay_backward
from branchreplay.engine.families import FAMILIES, UnsupportedModelError, family_of
from branchreplay.engine.recurrent import EngineForwards, layer_kinds, mamba2_forward
from branchreplay.losses import GRPOLoss
from branchreplay.reference.shapes import SHAPES, make_rollouts
from branchreplay.tiny_models import RECURRENT_ARCHS, tiny_model
from branchreplay.tree import RolloutTree

pytestmark = pytest.mark.usefixtures("one_thread")

HYBRID_ARCHS = ["granitemoehybrid", "zamba2", "kimi_linear", "olmo_hybrid"]
KINDS = {
    "granitemoehybrid": ["recurrent", "attention"],
    "zamba2": ["recurrent", "hybrid", "hybrid"],  # K/V of the shared block and the Mamba2 state at one index
    "kimi_linear": ["recurrent", "attention", "recurrent"],
    "olmo_hybrid": ["recurrent", "attention"],
}
MAMBA2_MIXERS = {"granitemoehybrid": 1, "zamba2": 3, "kimi_linear": 0, "olmo_hybrid": 0}
"""Mixers that run `mamba2_forward` under the engine; the delta-rule layers run their own forward."""


def test_registered_with_their_layer_kinds():
    assert set(HYBRID_ARCHS) <= set(RECURRENT_ARCHS)
    for arch in HYBRID_ARCHS:
        model = tiny_model(arch)
        family = family_of(model)
        assert family is FAMILIES[arch] and family.recurrent and family.float32_kernels
        assert layer_kinds(model.config) == KINDS[arch]
        forwards = EngineForwards(model)
        assert len(forwards.mixers) == MAMBA2_MIXERS[arch]
        with forwards:
            assert all(m.forward.__func__ is mamba2_forward for m in forwards.mixers)
        assert not any("forward" in vars(m) for m in forwards.mixers)  # restored


def test_zamba2_shares_its_transformer_block():
    """Both hybrid layers run one block (as Zamba2 ships: tied with the embeddings), so its gradient sums both uses,
    in the tree as in each rollout alone."""
    layers = tiny_model("zamba2").model.layers
    first, second = layers[1].shared_transformer, layers[2].shared_transformer
    assert all(a is b for a, b in zip(first.parameters(), second.parameters(), strict=True))


PER_TREE = {"zamba2": 6.0}
"""The engine's error on one tree at most this many times naive's own there (3 otherwise). Zamba2's float32 rounding
is the largest of these (naive up to 8e-4 against float64; three Mamba2 layers and a shared block used twice): over
seeds 1-5 (20 trees each) its worst tree was 4.95x, a 10-token tree (a 3-token prefix, children of 3 and 1 tokens)
on which naive's error, 1.5e-5, lay below its usual 4e-5 to 8e-4 while the engine's, 7.4e-5, did not; 3.25x at seed
5, under 3x at the others. With float64 kernels the engine agrees to ~1e-14 (test_engine_families_recurrent.py)."""


@pytest.mark.slow
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_float32_against_float64_on_random_trees(arch):
    """20 random trees in float32, the engine and naive (each rollout alone, unpadded) both against a float64 copy
    (`keep_float64`): the engine's largest error at most 1.25x naive's largest, and on no tree more than 3x naive's
    own there (Zamba2: 6x, `PER_TREE`)."""
    rounding = judge_rounding(tiny_model(arch, dtype=torch.float32), tree_ratio=PER_TREE.get(arch, TREE_RATIO))
    assert max(rounding.naive) > 0 and rounding.passed, str(rounding)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_an_unregistered_hybrid_is_refused_by_name_even_under_force(arch):
    """A hybrid family the registry does not know (one of these under another model_type): refused by name, with
    or without the package's `force`, by the engine's `trusted=True` too, instead of the KeyError of a guessed family
    (a mask mapping without "linear_attention")."""
    model = tiny_model(arch)
    model.config.model_type = f"my_{arch}"
    rollouts = make_rollouts(SHAPES["shared-prompt"](256, torch.Generator().manual_seed(0)), torch.Generator())
    with pytest.raises(UnsupportedModelError, match=f"'my_{arch}' is not supported"):
        family_of(model)
    with pytest.raises(UnsupportedModelError, match=f"my_{arch}: not in the engine's registry and has recurrent"):
        family_of(model, trusted=True)
    with pytest.raises(UnsupportedModelError, match=f"my_{arch}: .*recurrent or hybrid layers"):
        replay_backward(model, RolloutTree(rollouts), GRPOLoss(), engine=EngineConfig(), trusted=True)
