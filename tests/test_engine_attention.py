"""Split prefix attention (`branchreplay.engine.attention`): the prefix block unmasked, the pack's own block masked
(or causal), merged by log-sum-exp, with a hand-written backward. Checked against finite differences (gradcheck),
against one SDPA call over all keys with the full mask, and inside the engine against the naive reference.
"""

import pytest
import torch

import branchreplay.engine.attention as attention
from branchreplay.engine import EngineConfig, replay_backward, replay_logprobs
from branchreplay.engine.cache import PrefixCache
from branchreplay.engine.families import layer_windows
from branchreplay.losses import GRPOLoss
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.reference.shapes import make_rollouts, prompt_completion, random_ids, shared_prompt
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import RolloutTree


def _inputs(K, S, dtype, seed=0, heads=4, kv_heads=2):
    """q [1, 4, S, 8]; k, v [1, 2, K + S, 8] (grouped-query); the own-keys tree mask of two siblings [1, 1, S, S]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, S, 8, generator=g, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, K + S, 8, generator=g, dtype=dtype, requires_grad=True) for _ in range(2))
    segment = torch.tensor([0] * (S // 2) + [1] * (S - S // 2))
    local = torch.cat([torch.arange(S // 2), torch.arange(S - S // 2)])
    allowed = (segment[None] == segment[:, None]) & (local[None] <= local[:, None])
    zero = torch.zeros((), dtype=dtype)
    own = torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]
    return q, k, v, own


def _split(q, k, v, own, K, scale, pieces=(2,)):
    """`_SplitAttention` with the K prefix keys cut into pieces of the given sizes (the rest in a last piece)."""
    cuts = list(pieces) + [K - sum(pieces)]
    ks, vs = k[:, :, :K].split(cuts, dim=2), v[:, :, :K].split(cuts, dim=2)
    return attention.split_attention(q, k[:, :, K:], v[:, :, K:], own, scale, ks, vs)


@pytest.mark.parametrize("causal", [True, False], ids=["one-node-causal", "two-siblings-masked"])
def test_gradcheck_float64(causal):
    q, k, v, own = _inputs(K=5, S=6, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: _split(q, k, v, None if causal else own, 5, 0.3), (q, k, v))


@pytest.mark.parametrize("causal", [True, False], ids=["one-node-causal", "two-siblings-masked"])
def test_equals_one_sdpa_call_with_the_full_mask(causal):
    K, S = 40, 24
    q, k, v, own = _inputs(K, S, torch.float32, seed=1)
    if causal:
        own_full = torch.where(torch.ones(S, S, dtype=torch.bool).tril(), 0.0, torch.finfo(torch.float32).min)
        own_full = own_full[None, None]
    else:
        own_full = own
    full = torch.cat([torch.zeros(1, 1, S, K), own_full], dim=-1)
    dout = torch.randn(1, 4, S, 8, generator=torch.Generator().manual_seed(2))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=0.3, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    out = _split(q, k, v, None if causal else own, K, 0.3, pieces=(7, 13))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rows_of_a_batch_share_one_prefix():
    """A batch of 3 rows below one prefix (prefix pieces [1, 2, K, 8], the rows' own keys [3, 2, S, 8], causal):
    each row's output and gradients equal one SDPA call over the prefix and that row's keys; the prefix's
    gradients are the sum over the rows. Then gradcheck in float64 on 2 rows."""
    K, S, B = 12, 7, 3
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, 4, S, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(B, 2, S, 8, generator=g, requires_grad=True) for _ in range(2))
    kp, vp = (torch.randn(1, 2, K, 8, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(B, 4, S, 8, generator=g)
    out = attention.split_attention(q, k, v, None, 0.3, [kp[:, :, :5], kp[:, :, 5:]], [vp[:, :, :5], vp[:, :, 5:]])
    grads = torch.autograd.grad(out, (q, k, v, kp, vp), dout)
    causal = torch.ones(S, K + S, dtype=torch.bool).tril(K)
    ref_out, ref_grads = [], [[] for _ in range(5)]
    for b in range(B):
        keys, values = torch.cat([kp, k[b : b + 1]], dim=2), torch.cat([vp, v[b : b + 1]], dim=2)
        ref = torch.nn.functional.scaled_dot_product_attention(q[b : b + 1], keys, values, attn_mask=causal,
                                                               scale=0.3, enable_gqa=True)
        ref_out.append(ref)
        for i, grad in enumerate(torch.autograd.grad(ref, (q, k, v, kp, vp), dout[b : b + 1], allow_unused=True)):
            ref_grads[i].append(grad)
    torch.testing.assert_close(out, torch.cat(ref_out), rtol=1e-5, atol=1e-6)
    for name, grad, ref in zip("q k v kp vp".split(), grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, sum(ref), rtol=1e-5, atol=1e-5, msg=name)

    with pytest.raises(RuntimeError, match="prefix pieces of one row"):  # the CPU kernel would read out of bounds
        attention.split_attention(q, k, v, None, 0.3, [kp.expand(B, -1, -1, -1)], [vp.expand(B, -1, -1, -1)])

    q64, k64, v64, kp64, vp64 = (t[:2].detach().double().requires_grad_() for t in (q, k, v, kp, vp))
    assert torch.autograd.gradcheck(
        lambda q, k, v, kp, vp: attention.split_attention(q, k, v, None, 0.3, [kp], [vp]), (q64, k64, v64, kp64, vp64))


def test_queries_below_different_parents_see_their_own_prefix():
    """Rows 0-1 below one parent, row 2 below another (`cache.Prefix.groups`): each row's output and gradients equal
    one SDPA call over its own prefix (the common piece, then its parent's) and its own keys; the common piece's
    gradient is the sum over all rows, each parent's over its rows. Then gradcheck in float64."""
    S, B = 5, 3
    g = torch.Generator().manual_seed(6)
    q = torch.randn(B, 4, S, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(B, 2, S, 8, generator=g, requires_grad=True) for _ in range(2))
    common, first, second = ((torch.randn(1, 2, n, 8, generator=g, requires_grad=True),
                              torch.randn(1, 2, n, 8, generator=g, requires_grad=True)) for n in (6, 3, 4))
    keys, values = [common[0], first[0], second[0]], [common[1], first[1], second[1]]
    groups = ((0, 2 * S, (0, 1)), (2 * S, 3 * S, (0, 2)))
    dout = torch.randn(B, 4, S, 8, generator=g)
    inputs = (q, k, v, *keys, *values)
    out = attention.split_attention(q, k, v, None, 0.3, keys, values, groups)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_out, ref_grads = [], [torch.zeros_like(t) for t in inputs]
    for b, parent in ((0, first), (1, first), (2, second)):
        kp, vp = torch.cat([common[0], parent[0]], dim=2), torch.cat([common[1], parent[1]], dim=2)
        K = kp.shape[2]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b : b + 1], torch.cat([kp, k[b : b + 1]], dim=2), torch.cat([vp, v[b : b + 1]], dim=2),
            attn_mask=torch.ones(S, K + S, dtype=torch.bool).tril(K), scale=0.3, enable_gqa=True)
        ref_out.append(ref)
        for i, grad in enumerate(torch.autograd.grad(ref, inputs, dout[b : b + 1], allow_unused=True)):
            if grad is not None:
                ref_grads[i] += grad
    torch.testing.assert_close(out, torch.cat(ref_out), rtol=1e-5, atol=1e-6)
    for name, grad, ref in zip("q k v kc k1 k2 vc v1 v2".split(), grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5, msg=name)
    wrong = attention.split_attention(q, k, v, None, 0.3, keys, values, ((0, 3 * S, (0, 1)),))  # all below one
    assert (wrong[2] - out[2]).abs().max() > 1e-2
    with pytest.raises(RuntimeError, match="do not cover"):  # a gap: queries 2S ... 3S - 1 would see no prefix
        attention.split_attention(q, k, v, None, 0.3, keys, values, ((0, 2 * S, (0, 1)),))
    with pytest.raises(ValueError, match="full attention layers"):  # a sliding window would cut each group apart
        PrefixCache([], 1, windows=[4], split=True, groups=[(0, S, [[first]]), (S, 2 * S, [[second]])])

    doubles = [t.detach().double().requires_grad_() for t in inputs]
    assert torch.autograd.gradcheck(
        lambda q, k, v, *p: attention.split_attention(q, k, v, None, 0.3, list(p[:3]), list(p[3:]), groups), doubles)


def test_engine_routes_prefix_packs_through_the_split_and_stays_exact(monkeypatch, keep64):
    """A chunked prompt (causal chunks against the cache) and packs of siblings (masked own block) go through
    `_SplitAttention`; the gradients equal naive in float64 and the masked-SDPA path within float64 rounding."""
    model = keep64(tiny_model("llama", dtype=torch.float64, seed=3))
    g = torch.Generator().manual_seed(4)
    prompt = random_ids(50, model.config.vocab_size, g)  # completions of uneven length: packs, not batches
    rollouts = make_rollouts([prompt_completion(prompt, random_ids(n, model.config.vocab_size, g))
                              for n in (7, 8, 9, 10, 11)], g)
    loss = GRPOLoss()
    naive_backward(model, rollouts, loss)
    ref = [p.grad.clone() for p in model.parameters()]
    calls = []
    forward = attention._SplitAttention.forward
    monkeypatch.setattr(attention._SplitAttention, "forward",
                        staticmethod(lambda ctx, q, k, v, own, *rest: calls.append(own is None) or
                                     forward(ctx, q, k, v, own, *rest)))
    model.zero_grad(set_to_none=True)
    replay_backward(model, RolloutTree(rollouts), loss, engine=EngineConfig(max_pack_tokens=20, chunk_tokens=16))
    split = [p.grad.clone() for p in model.parameters()]
    assert True in calls and False in calls, calls  # causal chunks and masked packs both ran split
    assert max_rel_grad_err(split, ref) < 1e-12
    monkeypatch.setattr(attention.PrefixSplit, "__init__", lambda self, *a: setattr(self, "applies", False))
    calls.clear()
    model.zero_grad(set_to_none=True)
    replay_backward(model, RolloutTree(rollouts), loss, engine=EngineConfig(max_pack_tokens=20, chunk_tokens=16))
    assert not calls
    assert max_rel_grad_err([p.grad for p in model.parameters()], split) < 1e-12


@pytest.mark.parametrize("arch, applies", [("llama", True), ("qwen3", True), ("gpt2", True), ("mistral", False)])
def test_split_only_where_every_query_sees_every_prefix_key(arch, applies):
    """A sliding window hides part of the prefix, a recurrent layer has no keys: such models keep the single masked
    call; so do half precision and a non-sdpa attention."""
    model = tiny_model(arch, dtype=torch.float32)
    windows, kinds = layer_windows(model.config), ["attention"] * model.config.num_hidden_layers
    assert attention.PrefixSplit(model, windows, kinds).applies == applies
    assert not attention.PrefixSplit(model, windows, kinds[:-1] + ["hybrid"]).applies
    model.config._attn_implementation = "eager"
    assert not attention.PrefixSplit(model, windows, kinds).applies
    model.config._attn_implementation = "sdpa"
    assert not attention.PrefixSplit(model.to(torch.bfloat16), windows, kinds).applies


def test_split_is_scoped_to_the_model_and_loud_when_a_marked_call_is_lost():
    """Split attention is registered under its own name and the model runs it only inside `PrefixSplit` (nested
    uses restore in order); transformers' "sdpa" is never touched, so after the engine a plain forward of this
    model and of a second one runs transformers' own SDPA path. The split function passes unmarked calls through;
    keys that carry prefix pieces with an unmarked mask raise instead of silently attending to the pack alone."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from branchreplay.engine.cache import PREFIX_ATTR, Prefix

    model, other = tiny_model("llama", dtype=torch.float32), tiny_model("llama", dtype=torch.float32, seed=1)
    kinds = ["attention"] * model.config.num_hidden_layers
    split = attention.PrefixSplit(model, layer_windows(model.config), kinds)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    before = model(ids).logits
    second = attention.PrefixSplit(model, layer_windows(model.config), kinds)  # built before either enters
    with split:
        assert model.config._attn_implementation == attention.SPLIT_ATTENTION
        second.__enter__()
    assert model.config._attn_implementation == attention.SPLIT_ATTENTION  # the other engine is still inside
    second.__exit__(None, None, None)
    assert model.config._attn_implementation == "sdpa"
    with split:
        with attention.PrefixSplit(model, layer_windows(model.config), kinds):
            pass
        assert model.config._attn_implementation == attention.SPLIT_ATTENTION
        assert other.config._attn_implementation == "sdpa"
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)  # unmarked: transformers' SDPA
    g = torch.Generator().manual_seed(0)
    replay_backward(model, RolloutTree(make_rollouts(shared_prompt(20, 3, 4, 256, g), g)), GRPOLoss())
    assert model.config._attn_implementation == other.config._attn_implementation == "sdpa"
    assert AttentionInterface()["sdpa"] is sdpa_attention_forward
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("sdpa", spy)
    try:
        model(ids), other(ids)
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
    assert len(calls) == 2 * model.config.num_hidden_layers  # both models took transformers' own path
    wrapper = AttentionInterface()[attention.SPLIT_ATTENTION]
    q, k, v, _ = _inputs(4, 6, torch.float32)
    module = model.model.layers[0].self_attn
    out, _ = wrapper(module, q, k, v, None, scaling=0.3)  # unmarked: plain SDPA
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(
        q, k, v, scale=0.3, is_causal=True, enable_gqa=True).transpose(1, 2))
    setattr(k, PREFIX_ATTR, Prefix([k[:, :, :4]], [v[:, :, :4]], ((0, 6, (0,)),)))
    with pytest.raises(RuntimeError, match="lost the split mark"):
        wrapper(module, q, k, v, None, scaling=0.3)


def test_a_model_that_cannot_switch_keeps_the_masked_path(monkeypatch):
    """transformers only warns when a class cannot switch its attention; the engine then runs the masked SDPA path
    (split attention off), still exact, instead of marking masks that plain SDPA would misread."""
    model = tiny_model("llama", dtype=torch.float64, seed=1)
    monkeypatch.setattr(model, "set_attn_implementation", lambda implementation: None)
    kinds = ["attention"] * model.config.num_hidden_layers
    with attention.PrefixSplit(model, layer_windows(model.config), kinds) as split:
        assert not split.applies and model.config._attn_implementation == "sdpa"
    g = torch.Generator().manual_seed(2)
    rollouts = make_rollouts(shared_prompt(30, 3, 5, model.config.vocab_size, g), g)
    ours = replay_logprobs(model, RolloutTree(rollouts)).logprobs
    theirs = naive_backward(model, rollouts, None).logprobs
    assert max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True)) <= 1e-6


def test_activation_checkpointing_is_refused():
    model = tiny_model("llama", dtype=torch.float32)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    g = torch.Generator().manual_seed(0)
    rollouts = make_rollouts(shared_prompt(8, 2, 3, model.config.vocab_size, g), g)
    with pytest.raises(ValueError, match="checkpointing_disable"):
        replay_backward(model, RolloutTree(rollouts), GRPOLoss())


def test_grouped_prefix_attention_equals_one_softmax_over_each_rows_keys():
    """grouped_prefix_attention (the sampler's decoding rows, each group's prompt held once) against SDPA over each
    row's own concatenation [its group's prompt; its generated keys under the mask], float64, grouped heads (4 query
    heads on 2 KV heads): groups of 2, 0 and 3 rows of prompts of 5, 3 and 7 keys, and a padding row in no group
    that sees only its own keys. A row given the wrong group's prompt differs (control)."""
    g = torch.Generator().manual_seed(0)
    C, h, h_kv, L, d = 6, 4, 2, 5, 8
    q = torch.randn(C, h, 1, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(C, h_kv, L, d, generator=g, dtype=torch.float64) for _ in range(2))
    seen = torch.tensor([3, 1, 5, 2, 4, 1])  # generated slots each row sees
    bias = torch.where(torch.arange(L) < seen[:, None], 0.0, float("-inf")).to(torch.float64)[:, None, None, :]
    prompts = [(torch.randn(1, h_kv, n, d, generator=g, dtype=torch.float64),
                torch.randn(1, h_kv, n, d, generator=g, dtype=torch.float64)) for n in (5, 3, 7)]
    spans = [(0, 2), (2, 2), (2, 5)]  # row 5: padding, in no span
    out = attention.grouped_prefix_attention(q, k, v, bias, d ** -0.5, spans, [p[0] for p in prompts],
                                             [p[1] for p in prompts])
    group = [0, 0, 2, 2, 2, None]
    for r in range(C):
        pk, pv = prompts[group[r]] if group[r] is not None else (k[:0, :, :0], v[:0, :, :0])
        keys = torch.cat([pk[0], k[r, :, : seen[r]]], dim=1) if pk.shape[0] else k[r, :, : seen[r]]
        values = torch.cat([pv[0], v[r, :, : seen[r]]], dim=1) if pv.shape[0] else v[r, :, : seen[r]]
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[r], keys.repeat_interleave(h // h_kv, 0), values.repeat_interleave(h // h_kv, 0))
        torch.testing.assert_close(out[r], expected, rtol=0, atol=1e-12)
    wrong = attention.grouped_prefix_attention(q, k, v, bias, d ** -0.5, spans, [p[0] for p in prompts[::-1]],
                                               [p[1] for p in prompts[::-1]])
    assert (wrong[:5] - out[:5]).abs().max() > 1e-3
