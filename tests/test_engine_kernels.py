"""The block kernels of split prefix attention (`engine/kernels.py`).

The CUDA wrapper cannot run its kernel here, so it is tested two ways on the CPU: against the real operators'
meta kernels (argument order and shapes, the padded log-sum-exp), and, swapped in for the CPU kernels, through the
whole engine against the naive reference, with an emulation of the memory-efficient kernel's contract (no grouped
heads, an aligned bias, a log-sum-exp padded to 32 queries, a backward that takes the merged output and
log-sum-exp). The tests marked `cuda` run the real kernels and skip without a GPU (scripts/gpu_check.sh runs them).
"""

import types

import pytest
import torch

from branchreplay.engine import EngineConfig, kernels, replay_backward
from branchreplay.engine.attention import CUDA_SPLIT, PrefixSplit
from branchreplay.engine.families import layer_windows
from branchreplay.engine.recurrent import layer_kinds
from branchreplay.losses import GRPOLoss
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.reference.shapes import SHAPES, make_rollouts
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import RolloutTree
from helpers import grads


def _scores(q, k, bias, is_causal, scale):
    scores = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias
    if is_causal:
        S, L = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(S, L, dtype=torch.bool).tril(), float("-inf"))
    return scores


def fake_efficient(q, k, v, bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    """The memory-efficient kernel's contract, in plain torch (any dtype)."""
    assert q.shape[1] == k.shape[1] == v.shape[1], "the kernel has no grouped heads"
    assert bias is None or (bias.shape == (*q.shape[:3], k.shape[2]) and bias.stride(-2) % 16 == 0)
    assert compute_log_sumexp and dropout_p == 0.0
    scores = _scores(q, k, bias, is_causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    S = q.shape[2]
    padded = lse.new_full((*lse.shape[:2], -(-S // 32) * 32), float("inf"))  # padding rows: garbage
    padded[..., :S] = lse
    return torch.softmax(scores, dim=-1) @ v, padded, torch.tensor(0), torch.tensor(0)


def fake_efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                            is_causal=False, *, scale=None):
    S = q.shape[2]
    assert lse.shape[-1] % 32 == 0 and lse.shape[-1] >= S, "the backward takes the padded log-sum-exp"
    assert q.shape[1] == k.shape[1] and list(grad_input_mask) == [True, True, True, False]
    p = torch.exp(_scores(q, k, bias, is_causal, scale) - lse[..., :S, None])  # from the GIVEN (merged) lse
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ dout, None


def test_cuda_wrapper_matches_the_operators_meta_kernels():
    """Argument order and shapes against the real operators' schemas (meta tensors: no kernel runs)."""
    B, h, h_kv, S, L, d = 1, 4, 2, 20, 37, 16
    q = torch.empty(B, h, S, d, device="meta")
    k, v = torch.empty(B, h_kv, L, d, device="meta"), torch.empty(B, h_kv, L, d, device="meta")
    mask = torch.empty(1, 1, S, L, device="meta")
    for block_mask, lse_shape in ((mask, (B, h, 32)), (None, (B, h_kv, 64))):  # own block; prefix block, folded
        out, lse, saved = kernels._cuda_forward(q, k, v, block_mask, False, d**-0.5)
        assert out.shape == (B, h, S, d) and lse.shape == (B, h, S) and saved[0] == lse_shape
        dq, dk, dv = kernels._cuda_backward(out, q, k, v, block_mask, out, lse, False, d**-0.5, saved)
        assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


@pytest.mark.slow
def test_cuda_wrapper_through_the_engine_equals_naive(monkeypatch, keep64):
    """The CUDA wrapper (grouped heads expanded and summed, bias aligned, log-sum-exp sliced and re-padded) with an
    emulated kernel, in place of the CPU kernels: the engine's float64 gradient equals naive's. A wrapper that
    forgot to sum the grouped heads' gradients, or fed the backward the block's own log-sum-exp, fails."""
    monkeypatch.setattr(kernels, "_efficient", fake_efficient)
    monkeypatch.setattr(kernels, "_efficient_backward", fake_efficient_backward)
    monkeypatch.setitem(kernels._KERNELS, "cpu", kernels.Kernels(kernels._cuda_forward, kernels._cuda_backward))
    model = keep64(tiny_model("llama", dtype=torch.float64))
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped heads exercised
    assert PrefixSplit(model, layer_windows(model.config), layer_kinds(model.config)).applies
    g = torch.Generator().manual_seed(0)
    rollouts = make_rollouts(SHAPES["branches-of-branches"](model.config.vocab_size, g), g)
    loss = GRPOLoss(entropy_coef=0.01)
    naive_backward(model, rollouts, loss)
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    replay_backward(model, RolloutTree(rollouts), loss, engine=EngineConfig(max_pack_tokens=16, chunk_tokens=8))
    assert max_rel_grad_err(grads(model), expected) < 1e-10


@pytest.mark.parametrize("setting, applies", [(None, True), ("1", True), ("0", False)])
def test_cuda_takes_split_attention_unless_opted_out(setting, applies, monkeypatch):
    """A float32 model on CUDA (only its device is read: no GPU needed) takes the split path by default and keeps the
    masked SDPA path when `CUDA_SPLIT` is "0"."""
    model = tiny_model("llama", dtype=torch.float32)
    on_cuda = types.SimpleNamespace(config=model.config, device=torch.device("cuda"), dtype=torch.float32)
    if setting is None:
        monkeypatch.delenv(CUDA_SPLIT, raising=False)
    else:
        monkeypatch.setenv(CUDA_SPLIT, setting)
    assert PrefixSplit(on_cuda, layer_windows(model.config), layer_kinds(model.config)).applies is applies


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_split_attention_on_cuda_equals_naive(arch, monkeypatch):
    """float32 on CUDA: the split path (memory-efficient kernels, CUDA's default) against naive, and against float64
    by the level bound (verify.VS_FLOAT64_FACTOR)."""
    from branchreplay.check.verify import verify_model

    monkeypatch.delenv(CUDA_SPLIT, raising=False)
    model = tiny_model(arch, dtype=torch.float32).cuda()
    assert PrefixSplit(model, layer_windows(model.config), layer_kinds(model.config)).applies
    results, _ = verify_model(model, random_trees=2)
    for r in results:
        assert r.passed, r
        assert r.max_rel_grad_err < 1e-4, r


@pytest.mark.cuda
@cuda
def test_cuda_kernels_against_sdpa():
    """One block pair on the GPU: the split forward and backward equal one SDPA call over all keys."""
    from branchreplay.engine.attention import split_attention

    torch.manual_seed(0)
    B, h, h_kv, S, P, d = 1, 8, 2, 50, 70, 64
    q = torch.randn(B, h, S, d, device="cuda", requires_grad=True)
    k, v = (torch.randn(B, h_kv, P + S, d, device="cuda", requires_grad=True) for _ in range(2))
    own = torch.zeros(S, S, device="cuda").masked_fill(~torch.ones(S, S, dtype=torch.bool, device="cuda").tril(),
                                                       float("-inf"))[None, None]
    out = split_attention(q, k[:, :, P:], v[:, :, P:], own, d**-0.5, [k[:, :, :P]], [v[:, :, :P]])
    full = torch.cat([torch.zeros(1, 1, S, P, device="cuda"), own], dim=-1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full, enable_gqa=True)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    g_ref = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
