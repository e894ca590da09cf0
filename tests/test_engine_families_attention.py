"""Attention families beyond Llama: Gemma2 (softcapping), Gemma3 (sliding + global layers), Qwen2 with sliding
layers, Qwen3-MoE and Mixtral (mixture of experts), and the bounded sliding-window state.

Reference: `naive_backward`, the same HF model on each rollout alone. float64 models run with `keep_float64`
(Gemma norms, Gemma2's eager softmax and the MoE routers compute in float32 otherwise, on both sides alike).
The shapes of `reference.shapes.SHAPES` x {float64, float32} for every family run in tests/test_engine_replay.py
(`test_replay_equals_naive` is parametrised over TINY_ARCHS, which holds these families); here: branch points
placed around the sliding window, chunks across it, the mask sizes transformers reads from our cache, the state
kept per branch, and the registry's refusals.
"""

import json

import pytest
import torch
from transformers import DynamicCache, GPTNeoXConfig, GPTNeoXForCausalLM

from branchreplay.bench.state import kept_state_bytes
from branchreplay.cli import main
from branchreplay.engine import EngineConfig, replay_backward, replay_logprobs
from branchreplay.engine.cache import PrefixCache
from branchreplay.engine.config import EVERY_SHARED_NODE
from branchreplay.engine.families import (
    FAMILIES,
    UnsupportedModelError,
    family_of,
    layer_windows,
    state_bytes_per_token,
)
from branchreplay.engine.head import decoder_and_head
from branchreplay.losses import GRPOLoss
from branchreplay.reference.float64 import keep_float64
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.reference.shapes import around_window, make_rollouts
from branchreplay.tiny_models import TINY_ARCHS, tiny_model
from branchreplay.tree import Rollout, RolloutTree
from helpers import grads

TOL = {torch.float64: 1e-6, torch.float32: 1e-4}
LOGPROB_TOL = {torch.float64: 1e-9, torch.float32: 1e-4}
NEW_ARCHS = ["gemma2", "gemma3", "qwen2-sliding", "qwen3_moe", "mixtral"]
SLIDING_ARCHS = ["mistral", "gemma2", "gemma3", "qwen2-sliding", "mixtral"]




def compare(model, rollouts, temperature=0.7, trusted=False, naive=None, **engine_kw):
    """(max relative grad error, max logprob error, gradient L1 norm) of replay vs naive, GRPO + entropy loss.
    `naive`: a previous `run_naive(model, rollouts)` to reuse."""
    naive_logprobs, g_naive = naive or run_naive(model, rollouts, temperature)
    model.zero_grad(set_to_none=True)
    replay = replay_backward(model, RolloutTree(rollouts), GRPOLoss(entropy_coef=0.01), temperature=temperature,
                             engine=EngineConfig(**{**EVERY_SHARED_NODE, **engine_kw}), trusted=trusted)
    lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive_logprobs, strict=True))
    return max_rel_grad_err(grads(model), g_naive), lp_err, sum(g.abs().sum().item() for g in g_naive)


def run_naive(model, rollouts, temperature=0.7):
    """(per-rollout logprobs, parameter gradients) of the naive reference."""
    model.zero_grad(set_to_none=True)
    naive = naive_backward(model, rollouts, GRPOLoss(entropy_coef=0.01), temperature=temperature)
    return naive.logprobs, grads(model)


def _window(model):
    return min(w for w in layer_windows(model.config) if w is not None)


def test_new_families_are_registered_and_in_the_engine_matrix():
    assert set(NEW_ARCHS) <= set(TINY_ARCHS)
    for arch in NEW_ARCHS:
        model = tiny_model(arch)
        assert family_of(model).name == model.config.model_type
    gemma3 = layer_windows(tiny_model("gemma3").config)
    assert None in gemma3 and 8 in gemma3, gemma3  # both layer kinds occur
    assert layer_windows(tiny_model("qwen2-sliding").config) == [None, 12]
    assert layer_windows(tiny_model("mixtral").config) == [16, 16]
    assert layer_windows(tiny_model("qwen3_moe").config) == [None, None]


# -- exactness around the window --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_branch_points_before_inside_and_after_the_window(arch, dtype, tiny64):
    """Forks at W/2 + 1, W - 1, W, W + 1, 2W + 3 and a fork inside a branch's window; packs of several siblings
    (our tree mask over the kept keys) and of one node (max_pack_tokens=1)."""
    g = torch.Generator().manual_seed(11)
    model = tiny64(arch, dtype)
    rollouts = make_rollouts(around_window(_window(model), model.config.vocab_size, g), g)
    naive = run_naive(model, rollouts)
    for pack in (64, 1):
        grad_err, lp_err, norm = compare(model, rollouts, naive=naive, max_pack_tokens=pack)
        assert norm > 0
        assert grad_err <= TOL[dtype], f"{arch}/{dtype}/pack {pack}: max relative grad error {grad_err:.3e}"
        assert lp_err <= LOGPROB_TOL[dtype], f"{arch}/{dtype}/pack {pack}: max logprob error {lp_err:.3e}"


@pytest.mark.parametrize("arch", ["gemma3", "qwen2-sliding"])
def test_chunks_across_the_window_with_replay(arch, tiny64):
    """Mixed sliding / full layers; chunks one short of, equal to and longer than the window."""
    g = torch.Generator().manual_seed(12)
    model = tiny64(arch)
    W = _window(model)
    rollouts = make_rollouts(around_window(W, model.config.vocab_size, g), g)
    naive = run_naive(model, rollouts)
    for chunk in (W - 1, W, 2 * W + 1):
        grad_err, lp_err, _ = compare(model, rollouts, naive=naive, chunk_tokens=chunk, replay="replay",
                                      max_pack_tokens=20)
        assert grad_err <= 1e-6 and lp_err <= 1e-9, (chunk, grad_err, lp_err)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
@pytest.mark.parametrize("P", [3, 7, 8, 15, 16, 17, 40])
def test_transformers_mask_from_our_mask_sizes(arch, P, tiny64):
    """Without our mask (attention_mask=None), transformers builds the causal / sliding masks from
    `PrefixCache.get_mask_sizes` and `get_seq_length`: a query sequence after P cached positions, whose sliding
    layers serve only the last W - 1 of them, must give the hidden states of the full uncached forward."""
    model = tiny64(arch)
    decoder, _, _ = decoder_and_head(model)
    windows = layer_windows(model.config)
    ids = torch.randint(0, 256, (1, P + 20), generator=torch.Generator().manual_seed(P))
    with torch.no_grad():
        full = decoder(input_ids=ids).last_hidden_state
        prefix = PrefixCache([], len(windows), windows=windows, prefix_length=0)
        decoder(input_ids=ids[:, :P], position_ids=torch.arange(P)[None], cache=prefix, use_cache=True)
        state = prefix.node_state(0, P)
        W = _window(model)
        assert all(k.shape[-2] == (P if w is None else min(P, W - 1)) for (k, _), w in zip(state, windows, strict=True))
        for q in (1, 3, 20):
            cache = PrefixCache([state], len(windows), windows=windows, prefix_length=P)
            out = decoder(input_ids=ids[:, P : P + q], position_ids=torch.arange(P, P + q)[None], cache=cache,
                          use_cache=True).last_hidden_state
            assert (out - full[:, P : P + q]).abs().max() <= 1e-12, (P, q)


@pytest.mark.parametrize("P", [0, 5, 15, 16, 40])
def test_mask_sizes_match_transformers_sliding_layer(P, tiny64):
    """`get_mask_sizes` and `get_seq_length` of a sliding `_PrefixLayer` equal those of transformers'
    `DynamicSlidingWindowLayer` after the same P tokens."""
    model = tiny64("mistral")
    config = model.config
    ref = DynamicCache(config=config)
    kv = torch.zeros(1, 2, P, 16, dtype=torch.float64)
    if P:
        ref.update(kv, kv, 0)
    ours = PrefixCache([[(kv, kv)] * 2] if P else [], 2, windows=[16, 16], prefix_length=P)
    for q in (1, 4, 20):
        assert ours.get_mask_sizes(q, 0) == ref.get_mask_sizes(q, 0), (P, q)
    assert ours.get_seq_length() == ref.get_seq_length() == P


# -- state bounded by the window ---------------------------------------------------------------------------------------


def test_sliding_state_is_bounded_by_the_window_not_the_prompt():
    """bench.state: K/V bytes the engine hands a branch. Mistral (every layer slides, W=16): constant in P;
    Llama (full attention): proportional to P; both as `state_bytes_per_token` says."""
    lengths = (64, 256, 1024)
    mistral = tiny_model("mistral", max_position_embeddings=2048)
    llama = tiny_model("llama", max_position_embeddings=2048)
    m = [kept_state_bytes(mistral, P) for P in lengths]
    ll = [kept_state_bytes(llama, P) for P in lengths]
    assert m[0] == m[1] == m[2] == state_bytes_per_token(mistral.config, torch.float32)[1] == 2 * 2 * 2 * 16 * 4 * 15
    assert ll == [state_bytes_per_token(llama.config, torch.float32)[0] * P for P in lengths]
    from branchreplay.engine import cache, stack

    assert cache._observers == [] and stack.PrefixCache is PrefixCache  # the observer is gone; nothing was swapped


def test_state_bytes_per_token():
    per_position = 2 * 2 * 16  # keys and values, 2 KV heads, head_dim 16 (elements)
    assert state_bytes_per_token(tiny_model("llama").config, torch.float32) == (2 * per_position * 4, 0)
    assert state_bytes_per_token(tiny_model("mistral").config, torch.bfloat16) == (0, 2 * per_position * 2 * 15)
    gemma3 = tiny_model("gemma3", num_hidden_layers=3).config  # sliding, full, sliding; W = 8
    assert state_bytes_per_token(gemma3, torch.float64) == (per_position * 8, 2 * per_position * 8 * 7)


# -- registry: refusals and --force ------------------------------------------------------------------------------------


def _neox(tmp_path=None):
    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=256, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(cfg).eval()
    if tmp_path is not None:
        model.save_pretrained(tmp_path)
    return model


def test_unsupported_family_refused_by_name_and_forced_run_is_exact(keep64):
    model = keep64(_neox().double())
    assert "gpt_neox" not in FAMILIES
    rollouts = make_rollouts(around_window(8, 64, torch.Generator().manual_seed(0)), torch.Generator().manual_seed(1))
    with pytest.raises(UnsupportedModelError, match="'gpt_neox'.*branchreplay verify"):
        replay_logprobs(model, RolloutTree(rollouts))
    grad_err, lp_err, norm = compare(model, rollouts, trusted=True, max_pack_tokens=16)
    assert norm > 0 and grad_err <= 1e-6 and lp_err <= 1e-9, (grad_err, lp_err)


def test_cli_verify_refuses_an_unregistered_model_unless_forced(tmp_path, capsys):
    _neox(tmp_path)
    assert main(["verify", "--model", str(tmp_path), "--random-trees", "0"]) == 2
    err = capsys.readouterr().err
    assert "gpt_neox" in err and "branchreplay verify" in err and "--force" in err
    assert main(["verify", "--model", str(tmp_path), "--random-trees", "0", "--force", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # 6 shapes + the tree across the engine's chunk_tokens (verify's length thresholds)
    assert out["arch"] == "gpt_neox" and out["passed"] is True and out["trees"] == 7
    assert out["thresholds_covered"] == {"engine.chunk_tokens": 24}
    assert out["state_bytes_per_token"] == {"full_layers_per_token": 2 * 32 * 8, "sliding_layers_max": 0}


def test_cli_verify_includes_the_window_shape_for_a_sliding_model(monkeypatch, capsys):
    def one_layer(arch, dtype, seed):
        return tiny_model(arch, dtype=dtype, seed=seed, num_hidden_layers=1)

    monkeypatch.setattr("branchreplay.tiny_models.tiny_model", one_layer)
    assert main(["verify", "--arch", "mistral", "--random-trees", "0"]) == 0
    out = capsys.readouterr().out
    assert "around-window" in out and "PASSED" in out
    assert "at most 7680 bytes" in out  # 1 layer x (K, V) x 2 heads x 16 x 8 bytes x (W - 1 = 15) positions


def test_router_aux_loss_and_jitter_are_refused():
    model = tiny_model("mixtral")
    model.config.output_router_logits = True  # training without the router loss (tests/test_engine_router.py)
    with pytest.raises(UnsupportedModelError, match="output_router_logits"):
        replay_backward(model, RolloutTree([Rollout([1, 2, 3], [0, 1, 1])]), GRPOLoss())
    model = tiny_model("mixtral", router_jitter_noise=0.1).train()
    with pytest.raises(ValueError, match="router_jitter_noise"):
        replay_backward(model, RolloutTree([Rollout([1, 2, 3], [0, 1, 1])]), GRPOLoss())


def test_keep_float64_patches_gemma_norms_routers_and_eager_softmax():
    """Inside the context the float32 casts compute in float64; on exit every module and the model file's
    function are transformers' own again, and the logits are bit-identical to before."""
    import transformers.models.gemma2.modeling_gemma2 as gemma2

    original = gemma2.eager_attention_forward
    model = tiny_model("gemma2", dtype=torch.float64)
    ids = torch.tensor([[1, 5, 9, 3]])
    before = model(ids).logits
    norms = [m for m in model.modules() if type(m).__name__ == "Gemma2RMSNorm"]
    x = torch.randn(3, 64, dtype=torch.float64)
    with keep_float64(model) as patched:
        assert patched == len(norms) > 0
        assert gemma2.eager_attention_forward is not original
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norms[0].eps) * (1 + norms[0].weight)
        assert torch.equal(norms[0](x), expected)
        with keep_float64(model):  # nested: the inner exit leaves the outer's patches
            pass
        assert torch.equal(norms[0](x), expected)
    assert gemma2.eager_attention_forward is original
    assert all("forward" not in vars(m) for m in model.modules())
    assert torch.equal(model(ids).logits, before)
    with keep_float64(model):  # a deepcopy made inside computes with its own weights
        import copy

        twin = copy.deepcopy(model)
        for p in twin.parameters():
            p.data.mul_(2)
        norm = [m for m in twin.modules() if type(m).__name__ == "Gemma2RMSNorm"][0]
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight)
        assert torch.equal(norm(x), expected)
    moe = tiny_model("qwen3_moe", dtype=torch.float64)
    routers = [m for m in moe.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    with keep_float64(moe) as patched:
        assert patched >= len(routers) > 0
        assert routers[0](torch.randn(5, 64, dtype=torch.float64))[1].dtype == torch.float64
    assert all("forward" not in vars(m) for m in moe.modules())
