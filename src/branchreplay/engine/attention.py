"""Attention of a pack against a cached prefix, split in two: the prefix keys without a mask, the pack's own keys with
the tree mask, merged by their log-sum-exp (the merge of blockwise / ring attention: Milakov & Gimelshein 2018,
"Online normalizer calculation for softmax"; Dao et al. 2022, FlashAttention, section 3.1):

    out = (exp(lse_p) * out_p + exp(lse_s) * out_s) / exp(lse),   lse = logaddexp(lse_p, lse_s)

The backward runs the kernel's backward on each block with the merged `out` and `lse`, so each block's dK, dV and dQ
share are exactly those of one attention over all K + S keys. Attention sinks (gpt-oss's per-head logit s_h, passed
by transformers as `s_aux`; its eager attention appends s_h as one more softmax column and drops that column's weight)
are one more block of value 0 and log-sum-exp s_h, merged once per query: lse' = logaddexp(lse, s_h),
out' = out * exp(lse - lse'); the blocks' backward then takes out' and lse', and ds_h = -sum_q exp(s_h - lse'_q)
rowsum(dout * out')_q (the softmax gradient of a column whose value is 0).
Used (`PrefixSplit.applies`) on the CPU in float32 or float64 and on CUDA in float32 (unless `CUDA_SPLIT` opts out;
kernels: `kernels.py`), not under autocast (half precision keeps the masked call, whose rounding follows naive's),
with "sdpa" attention (or eager in an `EAGER_SPLIT` family: gpt-oss), full attention in every layer and no
attention-logit softcap; per pack when it has a prefix. Everything else: the single masked call of the model's own
attention.
Design notes and measurements: docs/notes/split-attention.md.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cache import PREFIX_ATTR
from .kernels import kernels_for
from .latent import LatentExpansion, same_width

_MARK = "_branchreplay_own_keys"  # attribute of a mask that covers only the pack's own keys
_SPLIT_DTYPES = {("cpu", torch.float32), ("cpu", torch.float64), ("cuda", torch.float32)}  # (kernels.py)
CUDA_SPLIT = "BRANCHREPLAY_CUDA_SPLIT_ATTENTION"
"""Environment variable: "0" opts CUDA out of split prefix attention (into the masked SDPA path, exact too). On by
default: on a GPU it ran the headline step faster and in less memory than the masked path (figures:
docs/notes/split-attention.md)."""


def own_keys_mask(mask: torch.Tensor | None, length: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The attention_mask handed to the decoder for a split pack of `length` tokens: `mask` [1, 1, S, S] (additive,
    the tree mask over the pack's own keys), or, for None, a stride-0 placeholder meaning "causal". Marked, so that
    `split_sdpa` recognises it; transformers passes a 4D mask to the layers as it is."""
    if mask is None:
        mask = torch.zeros((), dtype=dtype, device=device).expand(1, 1, length, length)
        setattr(mask, _MARK, "causal")
    else:
        setattr(mask, _MARK, "mask")
    return mask


class _SplitAttention(torch.autograd.Function):
    """q [B, h, S, d]; k, v [B, h_kv, S, d] (the pack's own keys; h a multiple of h_kv, grouped as `repeat_kv`);
    own_mask [1, 1, S, S] or None (causal); `groups`, a tuple of (a, b, pieces) in order, covering the B x S queries
    of the folded sequence (`_fold_rows`: the rows one after the other): queries a ... b - 1 see the prefix pieces
    with those indices, root first; then n prefix key pieces and n prefix value pieces [1, h_kv, L_i, d] (the
    ancestors' states, alive anyway). `sinks`: None, or [h] per-head sink logits (module docstring), in every query's
    softmax once; with n = 0 pieces (and no groups) the queries see only their own keys. Returns out [B, h, S, d].
    Saved for backward: q, the pack's own k / v and mask, out, lse, the sinks and the pieces; a group's concatenated
    prefix exists only inside forward and backward. The block kernels are the device's (`kernels.py`).

    A group's queries are folded into one query sequence against its prefix as it is, never copied per row: the
    rows of a batch below one prefix (`packs.batched_packs`), or the nodes of a pack that hang below different
    parents (one group per parent, `stack._Run.packs_of`). A piece several groups see (their common ancestors) gets
    the sum of their dK, dV."""

    @staticmethod
    def forward(ctx, q, k, v, own_mask, scale, groups, n, sinks, *pieces):
        kernels = kernels_for(q.device)
        causal = own_mask is None
        bounds = [a for a, _, _ in groups] + [groups[-1][1]] if groups else [0, 0]
        if n and (bounds[0] != 0 or bounds[-1] != q.shape[0] * q.shape[2] or [b for _, b, _ in groups] != bounds[1:]):
            raise RuntimeError(f"split attention's query groups {[g[:2] for g in groups]} do not cover its "
                               f"{q.shape[0] * q.shape[2]} queries in order")
        if any(piece.shape[0] != 1 for piece in pieces):  # the CPU kernel does not check q's and k's batch sizes
            raise RuntimeError(f"split attention takes prefix pieces of one row, got {[p.shape for p in pieces]}")
        rows, folded = q.shape[0], _fold_rows(q)
        outs, lses, saved_p = [], [], []
        for a, b, used in groups if n else ():
            kp, vp = torch.cat([pieces[i] for i in used], dim=2), torch.cat([pieces[n + i] for i in used], dim=2)
            out_g, lse_g, saved_g = kernels.forward(_queries(folded, a, b, groups), kp, vp, None, False, scale)
            outs.append(out_g)
            lses.append(lse_g)
            saved_p.append(saved_g)
            del kp, vp
        out, lse, saved_s = kernels.forward(q, k, v, own_mask, causal, scale)
        if n:
            out_p, lse_p = _unfold_rows(_joined(outs, 2), rows), _unfold_rows(_joined(lses, 2), rows)
            out, lse = _merged(out_p, lse_p, out, lse)  # lse [B, h, S]
        if sinks is not None:
            out, lse = _sunk(out, lse, sinks)
        ctx.save_for_backward(q, k, v, own_mask, out, lse, sinks, *pieces)
        ctx.scale, ctx.groups, ctx.n, ctx.saved = scale, groups, n, (saved_p, saved_s)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, own_mask, out, lse, sinks, *pieces = ctx.saved_tensors
        kernels = kernels_for(q.device)
        n, groups, dout, (saved_p, saved_s) = ctx.n, ctx.groups, dout.contiguous(), ctx.saved
        folded = [_fold_rows(x) for x in (dout, q, out, lse)] if n else []
        dq_parts, dk, dv = [], [None] * n, [None] * n
        for (a, b, used), saved_g in zip(groups if n else (), saved_p, strict=True):
            kp, vp = torch.cat([pieces[i] for i in used], dim=2), torch.cat([pieces[n + i] for i in used], dim=2)
            dout_g, q_g, out_g, lse_g = (_queries(x, a, b, groups) for x in folded)
            dq_g, dk_g, dv_g = kernels.backward(dout_g, q_g, kp, vp, None, out_g, lse_g, False, ctx.scale, saved_g)
            dq_parts.append(dq_g)
            sizes = [pieces[i].shape[2] for i in used]
            for i, dk_i, dv_i in zip(used, dk_g.split(sizes, dim=2), dv_g.split(sizes, dim=2), strict=True):
                dk[i] = dk_i if dk[i] is None else dk[i] + dk_i
                dv[i] = dv_i if dv[i] is None else dv[i] + dv_i
            del kp, vp
        dq, dk_s, dv_s = kernels.backward(dout, q, k, v, own_mask, out, lse, own_mask is None, ctx.scale, saved_s)
        if n:
            dq = _unfold_rows(_joined(dq_parts, 2), q.shape[0]) + dq
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[7]:  # module docstring: -sum_q p_sink * rowsum(dout * out)
            weight = torch.exp(sinks.to(lse.dtype)[None, :, None] - lse)  # [B, h, S]
            dsinks = -(weight * (dout * out).sum(-1).to(lse.dtype)).sum((0, 2)).to(sinks.dtype)
        return (dq, dk_s, dv_s, None, None, None, None, dsinks, *dk, *dv)


def split_attention(q, k, v, own_mask, scale, keys, values, groups=None, sinks=None) -> torch.Tensor:
    """`_SplitAttention` (its shapes): the queries against the prefix pieces `keys`, `values` (lists, root first, or
    empty: own keys only) and their own keys; `groups` as `cache.Prefix.groups`, None: every query sees every piece;
    `sinks` None or the [h] sink logits. K and V of different widths (MLA, `latent.py`) run zero-padded to one width
    (`latent.same_width`: exact, the padding adds zero terms and zero output columns, cut off here)."""
    if v.shape[-1] != q.shape[-1]:
        width = v.shape[-1]
        q, k, v, keys, values = same_width(q, k, v, keys, values)
        return split_attention(q, k, v, own_mask, scale, keys, values, groups, sinks)[..., :width]
    if groups is None:
        groups = ((0, q.shape[0] * q.shape[2], tuple(range(len(keys)))),) if keys else ()
    return _SplitAttention.apply(q, k, v, own_mask, scale, groups, len(keys), sinks, *keys, *values)


def _queries(folded: torch.Tensor, a: int, b: int, groups) -> torch.Tensor:
    """Queries a ... b - 1 of a folded [1, h, N, ...] tensor: all of it for one group, else a contiguous copy (the
    kernels take the layouts PyTorch's own SDPA hands them)."""
    return folded if len(groups) == 1 else folded[:, :, a:b].contiguous()


def _joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


GROUPS_ATTR = "_branchreplay_groups"  # set on the decoding rows' own keys: (spans, prompt keys, prompt values)


def groups_mask(bias: torch.Tensor) -> torch.Tensor:
    """Mark `bias` [rows, 1, 1, L] (additive: 0 for a generated slot a row sees, -inf else) as the attention_mask of a
    decoding step whose rows see their group's prompt as a prefix (`grouped_prefix_attention`); returns it."""
    setattr(bias, _MARK, "groups")
    return bias


def grouped_prefix_attention(q, k, v, bias, scale, spans, prompt_keys, prompt_values, sinks=None) -> torch.Tensor:
    """One decoding step of the rows of several groups, each group's prompt held once (the sampler's static rows,
    `decode/rows/static.py`): q [C, h, 1, d]; k, v [C, h_kv, L, d] the rows' own generated keys under `bias`
    [C, 1, 1, L]; rows spans[g] = (a, b) belong to group g, whose prompt keys / values are prompt_keys[g],
    prompt_values[g] [1, h_kv, P_g, d], seen by every query of the group without a mask (its rows folded into one
    query sequence, as `_SplitAttention` runs a batch below one prefix). Rows in no span see no prompt. The blocks
    are merged by their log-sum-exp, as `_SplitAttention.forward`, with the [h] `sinks` logits where given (module
    docstring); no autograd (sampling). Returns out [C, h, 1, d]."""
    kernels = kernels_for(q.device)
    out_s, lse_s, _ = kernels.forward(q, k, v, bias, False, scale)
    out_p, lse_p = torch.zeros_like(out_s), torch.full_like(lse_s, float("-inf"))
    for (a, b), kp, vp in zip(spans, prompt_keys, prompt_values, strict=True):
        if a < b:
            out, lse, _ = kernels.forward(_fold_rows(q[a:b]), kp, vp, None, False, scale)
            out_p[a:b], lse_p[a:b] = _unfold_rows(out, b - a), _unfold_rows(lse, b - a)
    out, lse = _merged(out_p, lse_p, out_s, lse_s)
    return out if sinks is None else _sunk(out, lse, sinks)[0]


def _merged(out_p, lse_p, out_s, lse_s) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention blocks over disjoint keys ([..., S, d] outputs, [..., S] log-sum-exps) as one attention over
    all their keys (the module docstring's formula): (out, lse)."""
    lse = torch.logaddexp(lse_p, lse_s)
    w_p, w_s = torch.exp(lse_p - lse)[..., None].to(out_p.dtype), torch.exp(lse_s - lse)[..., None].to(out_p.dtype)
    return out_p * w_p + out_s * w_s, lse


def _sunk(out, lse, sinks) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention block (out [B, h, S, d], lse [B, h, S]) merged with the per-head sink logits `sinks` [h], a block
    of value 0 (module docstring): (out * exp(lse - lse'), lse'), lse' = logaddexp(lse, sinks)."""
    total = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    return out * torch.exp(lse - total)[..., None].to(out.dtype), total


def _fold_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, h, S, ...] -> [1, h, B x S, ...]: the rows of a batch as one query sequence, row after row (a view for
    B = 1, else a copy)."""
    if x.shape[0] == 1:
        return x
    return x.transpose(0, 1).reshape(1, x.shape[1], -1, *x.shape[3:])


def _unfold_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """The inverse of `_fold_rows`: [1, h, rows x S, ...] -> [rows, h, S, ...] (a view)."""
    if rows == 1:
        return x
    return x.reshape(x.shape[1], rows, -1, *x.shape[3:]).transpose(0, 1)


def split_sdpa(original):
    """transformers' sdpa attention function, extended: a mask marked by `own_keys_mask` runs `_SplitAttention`
    on the pack's own keys / values and the prefix pieces the keys carry (`cache.Prefix`); any other call
    goes to `original` unchanged. Returns (attn_output [B, S, h, d], None) as transformers'.
    A layer with attention sinks (`s_aux`, gpt-oss) takes them in every path: split, grouped and, since transformers'
    SDPA has none, the unmarked calls too (`_unsplit_with_sinks`).
    Raises RuntimeError when the two disagree (keys carrying prefix pieces with an unmarked mask, or the reverse) or
    when the layer asks for what split attention does not do (dropout, softcap, sliding window, position bias): wrong
    results would otherwise pass silently."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        kind = getattr(attention_mask, _MARK, None)
        prefix = getattr(key, PREFIX_ATTR, None)  # cache.Prefix
        groups = getattr(key, GROUPS_ATTR, None)
        sinks = kwargs.get("s_aux")  # [h] per-head sink logits (gpt-oss), or None
        unsupported = [k for k in ("softcap", "sliding_window", "position_bias") if kwargs.get(k) is not None]
        if (kind == "groups") != (groups is not None):
            raise RuntimeError("decoding rows and their group prompts reached attention apart (the mask lost its "
                               "mark, or keys carry prompts under another mask): a model that copies or moves its "
                               "attention mask is not supported; set sampling.cache_implementation=dynamic")
        if kind == "groups":
            if dropout or unsupported:
                raise RuntimeError(f"grouped prefix attention cannot run this layer (dropout {dropout}, "
                                   f"{unsupported}); set sampling.cache_implementation=dynamic")
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            out = grouped_prefix_attention(query, key, value, attention_mask, scale, *groups, sinks)
            return out.transpose(1, 2).contiguous(), None
        if kind is None:
            if prefix is not None:
                raise RuntimeError("keys without their prefix reached plain SDPA: the layer's mask lost the split "
                                   "mark (a model that copies or slices its attention mask is not supported)")
            if sinks is not None:
                return _unsplit_with_sinks(module, query, key, value, attention_mask, dropout, scaling, sinks, kwargs)
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if dropout or unsupported or prefix is None:
            raise RuntimeError(f"split prefix attention cannot run this layer (dropout {dropout}, {unsupported}, "
                               f"prefix pieces {'missing' if prefix is None else 'present'}); run it with "
                               "EngineConfig defaults on a supported family, or report the model")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        own = None if kind == "causal" else attention_mask.to(query.dtype)
        out = split_attention(query, key, value, own, scale, prefix.keys, prefix.values, prefix.groups, sinks)
        return out.transpose(1, 2).contiguous(), None

    return attention


def _unsplit_with_sinks(module, query, key, value, attention_mask, dropout, scaling, sinks, kwargs):
    """An unmarked call (a root pack, transformers' own mask) of a layer with attention sinks: `_SplitAttention` on
    the call's keys alone with the sinks, the mask read as transformers' `sdpa_attention_forward` reads it (boolean:
    the keys seen; float: added; None: causal, top-left aligned, for more than one query of a causal module, else
    every key). Returns (attn_output [B, S, h, d], None). Raises RuntimeError for dropout, softcap or a position
    bias, or a device without split kernels."""
    if dropout or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None \
            or kernels_for(query.device) is None:
        raise RuntimeError(f"attention with sinks under split prefix attention cannot run this layer (dropout "
                           f"{dropout}, softcap or position bias, or no kernels on {query.device.type}); run it "
                           "with EngineConfig defaults on a supported family, or report the model")
    S, L = query.shape[2], key.shape[2]
    is_causal = kwargs.get("is_causal")
    causal = S > 1 and attention_mask is None and (getattr(module, "is_causal", True) if is_causal is None
                                                   else is_causal)
    if causal and L > S:  # as sdpa_attention_forward: an empty static cache's slots are never seen
        key, value, L = key[:, :, :S], value[:, :, :S], S
    if attention_mask is None:
        mask = None if causal else torch.zeros((1, 1, S, L), dtype=query.dtype, device=query.device)
    elif attention_mask.dtype == torch.bool:
        mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
        mask.masked_fill_(~attention_mask, float("-inf"))
    else:
        mask = attention_mask.to(query.dtype)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = split_attention(query, key, value, mask, scale, [], [], sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


SPLIT_ATTENTION = "branchreplay_split_sdpa"
"""The name under which split prefix attention is registered with transformers' `AttentionInterface` (and the SDPA
mask function with `AttentionMaskInterface`, for the root packs that take transformers' causal mask)."""

SPLIT_ATTENTION_EAGER = "branchreplay_split_attention"
"""The same function under a name without "sdpa", for the `EAGER_SPLIT` families: transformers checks that a model
supports SDPA before switching it to any implementation whose name contains "sdpa"."""

EAGER_SPLIT = ("gpt_oss",)
"""model_type values that transformers runs with eager attention only (no SDPA: attention sinks) and whose eager
attention split prefix attention computes, sinks included (module docstring): q k^T * scaling + mask, the sink
column, softmax, times v (transformers' gpt_oss `eager_attention_forward`)."""


class PrefixSplit:
    """Whether `model` runs split prefix attention (`applies`; see the module docstring for the conditions).
    kinds: per decoder layer "attention", "recurrent" or "hybrid" (`recurrent.layer_kinds`); windows: per layer the
    sliding window or None (`families.layer_windows`).

    As a context manager it switches the model to `name` (`SPLIT_ATTENTION`, or `SPLIT_ATTENTION_EAGER` for an
    `EAGER_SPLIT` family) while the engine runs, and back to its own
    implementations (the model's and its sub-configs') when the last engine on that model exits (a count per model
    under a lock: engines nested or in threads share the switch); with it, MLA attention modules expand their prefix
    pieces (`latent.LatentExpansion`). Nothing of transformers is replaced and other
    models never see it. A model where it does not apply is left untouched; one whose class cannot switch its
    attention (transformers then only warns) runs the masked SDPA path instead (`applies` turns False)."""

    _active: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [engines, previous, MLA]
    _lock = threading.Lock()

    def __init__(self, model, windows: list[int | None], kinds: list[str]):
        config = model.config
        self.model = model
        impl = getattr(config, "_attn_implementation", None)
        eager = config.model_type in EAGER_SPLIT and impl in ("eager", SPLIT_ATTENTION_EAGER)
        self.name = SPLIT_ATTENTION_EAGER if eager else SPLIT_ATTENTION
        self.applies = (
            (impl in ("sdpa", SPLIT_ATTENTION) or eager)
            and (model.device.type, model.dtype) in _SPLIT_DTYPES
            and (model.device.type != "cuda" or os.environ.get(CUDA_SPLIT) != "0")
            and not torch.is_autocast_enabled(model.device.type)  # mixed precision: masked (module docstring)
            and all(w is None for w in windows)
            and all(k == "attention" for k in kinds)
            and getattr(config, "attn_logit_softcapping", None) is None
        )

    def __enter__(self) -> PrefixSplit:
        if not self.applies:
            return self
        with self._lock:
            active = self._active.get(self.model)
            if active is not None:
                active[0] += 1
                return self
            previous = _implementations(self.model.config)
            _register()
            self.model.set_attn_implementation(self.name)
            if self.model.config._attn_implementation != self.name:
                self.applies = False  # transformers refused the switch: keep the masked path, which is exact
                return self
            self._active[self.model] = [1, previous, LatentExpansion(self.model).__enter__()]  # MLA: latent.py
        return self

    def __exit__(self, *exc) -> None:
        if not self.applies:
            return
        with self._lock:
            active = self._active[self.model]
            active[0] -= 1
            if active[0] == 0:
                del self._active[self.model]
                try:
                    self.model.set_attn_implementation(active[1])
                finally:
                    active[2].__exit__(*exc)


def _implementations(config) -> dict[str, str]:
    """{"": the model's attention implementation, sub-config name: its own} (the form set_attn_implementation takes)."""
    out = {"": config._attn_implementation}
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and getattr(sub, "_attn_implementation", None) is not None:
            out[name] = sub._attn_implementation
    return out


def _register() -> None:
    """Register `SPLIT_ATTENTION` with transformers' public interfaces (the same functions each time: idempotent)."""
    for name in (SPLIT_ATTENTION, SPLIT_ATTENTION_EAGER):
        AttentionInterface.register(name, _SPLIT)
        AttentionMaskInterface.register(name, sdpa_mask)


_SPLIT = split_sdpa(sdpa_attention_forward)
