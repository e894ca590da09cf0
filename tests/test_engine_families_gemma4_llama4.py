"""Gemma 4 and Llama 4 text models (Gemma4ForCausalLM, Llama4ForCausalLM) under the engine.

Tiny configs (`tiny_models.MIXED_LAYER_ARCHS`): Gemma 4 with sliding (window 8) and full layers of different
head_dim and K/V heads, keys as values on the full layers, the last two layers reusing the first two's K/V,
per-layer token inputs, MoE blocks and final logit softcapping; Llama 4 with chunked attention (chunks of 8) on its
RoPE layers, NoPE layers with temperature tuning (floor_scale 8), QK norm and MoE with a shared expert.
Reference: `naive_backward`, each rollout alone. float64 models run under `keep_float64` (their norms, routers and
Llama 4's complex rotation compute in float32 otherwise, on both sides alike), where the engine agrees to 1e-10;
float32 is judged against a float64 copy over 20 random trees.
"""

import types

import pytest
import torch

from branchreplay.check.rounding import judge_rounding
from branchreplay.engine.cache import PrefixCache, kept_positions
from branchreplay.engine.families import Chunk, UnsupportedModelError, family_of, layer_windows, state_bytes_per_token
from branchreplay.engine.head import decoder_and_head
from branchreplay.engine.masks import tree_mask
from branchreplay.engine.recurrent import layer_kinds
from branchreplay.engine.temperature import QueryTemperature
from branchreplay.models import head_dim, kv_heads
from branchreplay.reference.shapes import SHAPES, around_length, around_window, make_rollouts, prompt_completion
from branchreplay.tiny_models import MIXED_LAYER_ARCHS, tiny_config, tiny_model
from helpers import compare

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = list(MIXED_LAYER_ARCHS)
TOL64 = 1e-10  # relative gradient error, float64 under keep_float64 (measured: below 1e-13)


def nope_crossing(vocab: int, g: torch.Generator) -> list:
    """A trunk of 30 tokens; branches at 6, 7, 8, 9 (around the first chunk boundary, 8) and 16, 17 (the second),
    several siblings per branch point so that packs hold many nodes whose queries' positions differ from their index
    in the pack (what Llama 4's NoPE layers scale by), and a branch forking again across the next boundary."""
    trunk = torch.randint(0, vocab, (30,), generator=g).tolist()
    out = [trunk]
    for depth in (6, 7, 8, 9, 16, 17):
        for length in (3, 5, 11):
            out.append(trunk[:depth] + torch.randint(0, vocab, (length,), generator=g).tolist())
    out.append(out[7][:14] + torch.randint(0, vocab, (6,), generator=g).tolist())  # depth 7 + 11, forks at 14
    return [prompt_completion(s[:4], s[4:]) for s in out]


CASES = {**SHAPES, "around-window-8": lambda vocab, g: around_window(8, vocab, g),
         "around-length-8": lambda vocab, g: around_length(8, vocab, g), "nope-crossing": nope_crossing}


def test_registered_with_their_layers():
    gemma, llama = tiny_model("gemma4"), tiny_model("llama4")
    assert (family_of(gemma).name, family_of(llama).name) == ("gemma4_text", "llama4_text")
    assert layer_windows(gemma.config) == [8, None, 8, None]
    assert layer_kinds(gemma.config) == ["attention", "attention", "stateless", "stateless"]  # K/V reused
    assert [head_dim(gemma.config, i) for i in range(4)] == [16, 32, 16, 32] and head_dim(gemma.config) == 32
    assert [kv_heads(gemma.config, i) for i in range(4)] == [2, 1, 2, 1]
    # keys + values x heads x head_dim x 4 bytes: full layer 1 per position; sliding layer 0 at most 7 positions
    assert state_bytes_per_token(gemma.config, torch.float32) == (2 * 1 * 32 * 4, 2 * 2 * 16 * 4 * 7)
    windows = layer_windows(llama.config)
    assert windows == [Chunk(8), None, Chunk(8), None] and all(isinstance(w, Chunk) for w in windows[::2])
    assert Chunk(8) != 8 and len({Chunk(8), 8}) == 2  # a chunk is not a sliding window of the same length
    assert len(QueryTemperature(llama).layers) == 2  # the NoPE layers
    assert decoder_and_head(llama)[0] is llama.model  # its base_model_prefix names its place in the VLM


def test_chunk_keeps_the_positions_of_its_own_chunk():
    assert [kept_positions(P, Chunk(8)) for P in (0, 5, 7, 8, 9, 16, 23)] == [0, 5, 7, 0, 1, 0, 7]
    P = 13  # a pack of two nodes of 3 and 5 tokens after 13 positions: keys 8 ... 12 kept
    local, segment = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]), torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    mask = tree_mask(P, local, segment, [Chunk(8), None], torch.float64, True)
    allowed = mask["chunked_attention"][0, 0] == 0
    assert allowed.shape == (8, 5 + 8) and mask["full_attention"].shape[-1] == 13 + 8
    q = P + local
    for i in range(8):  # prefix keys 8 ... 12: seen by the queries of chunk 1 (positions 13 ... 15), not later ones
        assert allowed[i, :5].tolist() == [bool(q[i] < 16)] * 5
        own = [bool(segment[j] == segment[i] and local[j] <= local[i] and q[j] // 8 == q[i] // 8) for j in range(8)]
        assert allowed[i, 5:].tolist() == own


@pytest.mark.parametrize("P", [3, 7, 8, 9, 17])
def test_transformers_chunked_mask_from_our_mask_sizes(P, tiny64):
    """Without our mask (the rows of a batch pack), transformers builds its chunked and full masks from the cache's
    `get_mask_sizes`: after P cached positions whose chunked layers serve only P % 8, the hidden states equal those
    of the full forward."""
    model = tiny64("llama4")
    decoder, _, _ = decoder_and_head(model)
    windows = layer_windows(model.config)
    ids = torch.randint(0, 256, (1, P + 12), generator=torch.Generator().manual_seed(P))
    with torch.no_grad():
        full = decoder(input_ids=ids).last_hidden_state
        prefix = PrefixCache([], len(windows), windows=windows, prefix_length=0)
        decoder(input_ids=ids[:, :P], position_ids=torch.arange(P)[None], cache=prefix, use_cache=True)
        state = prefix.node_state(0, P)
        assert [k.shape[-2] for k, _ in state] == [P % 8, P, P % 8, P]
        for q in (1, 4, 12):
            cache = PrefixCache([state], len(windows), windows=windows, prefix_length=P)
            out = decoder(input_ids=ids[:, P : P + q], position_ids=torch.arange(P, P + q)[None], cache=cache,
                          use_cache=True).last_hidden_state
            assert (out - full[:, P : P + q]).abs().max() <= 1e-12, (P, q)


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(CASES))
@pytest.mark.parametrize("arch", ARCHS)
def test_float64_equals_naive(arch, shape, tiny64):
    """Every shape, branch points around the window / chunk boundary (8) and across Llama 4's NoPE layers; packs of
    many nodes (64 tokens) and of one node."""
    model = tiny64(arch)
    g = torch.Generator().manual_seed(5)
    rollouts = make_rollouts(CASES[shape](model.config.vocab_size, g), g)
    for pack in (64, 1):
        grad_err, lp_err, norm = compare(model, rollouts, max_pack_tokens=pack)
        assert norm > 0
        assert grad_err <= TOL64 and lp_err <= TOL64, f"{arch}/{shape}/pack {pack}: {grad_err:.2e}, {lp_err:.2e}"


def test_llama4_temperature_needs_the_pack_positions(tiny64, monkeypatch):
    """Control: with transformers' own scale (the i-th query of a pack at P + i) a pack of several siblings is off,
    so `nope-crossing` exercises `QueryTemperature`."""
    model = tiny64("llama4")
    g = torch.Generator().manual_seed(5)
    rollouts = make_rollouts(nope_crossing(model.config.vocab_size, g), g)
    monkeypatch.setattr(QueryTemperature, "__init__", lambda self, model: setattr(self, "layers", []))
    grad_err, _, _ = compare(model, rollouts, max_pack_tokens=64)
    assert grad_err > 1e-6, grad_err


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_float32_against_float64_on_random_trees(arch):
    """20 random trees in float32, the engine and naive both against a float64 copy: the engine's largest error at
    most 1.25x naive's largest, and on no tree more than 3x naive's own there."""
    rounding = judge_rounding(tiny_model(arch, dtype=torch.float32))
    assert max(rounding.naive) > 0 and rounding.passed, str(rounding)


def test_refusals_by_name():
    llama = tiny_model("llama4", output_router_logits=True)
    with pytest.raises(UnsupportedModelError, match="llama4_text: config.output_router_logits"):
        family_of(llama)
    gemma = tiny_model("gemma4")
    gemma.config.use_bidirectional_attention = "vision"
    with pytest.raises(UnsupportedModelError, match="gemma4_text: bidirectional"):
        family_of(gemma)
    config = tiny_config("gemma4", per_layer_config={1: {"head_dim": 32, "sliding_window": 4}})
    config._attn_implementation = "sdpa"  # (transformers' Gemma 4 cannot build this one: it reads the window once)
    with pytest.raises(UnsupportedModelError, match="gemma4_text: the config sets sliding_window per layer"):
        family_of(types.SimpleNamespace(config=config))
