"""Attention of a pack against a cached prefix, split in two: the prefix keys without a mask, the pack's own keys with
the tree mask, merged by their log-sum-exp (the merge of blockwise / ring attention: Milakov & Gimelshein 2018,
"Online normalizer calculation for softmax"; Dao et al. 2022, FlashAttention, section 3.1):

    out = (exp(lse_p) * out_p + exp(lse_s) * out_s) / exp(lse),   lse = logaddexp(lse_p, lse_s)

The backward runs the kernel's backward on each block with the merged `out` and `lse`, so each block's dK, dV and dQ
share are exactly those of one attention over all K + S keys. Used (`PrefixSplit.applies`) on the CPU in float32 or
float64 and on CUDA in float32 (unless `CUDA_SPLIT` opts out; kernels: `kernels.py`), not under autocast (half
precision keeps the masked call, whose rounding follows naive's), with "sdpa" attention, full attention in every
layer and no attention-logit softcap; per pack when it has a prefix. Everything else: the single masked SDPA call.
Design notes and measurements: docs/notes/engine-docstrings.md.
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

_MARK = "_branchreplay_own_keys"  # attribute of a mask that covers only the pack's own keys
_SPLIT_DTYPES = {("cpu", torch.float32), ("cpu", torch.float64), ("cuda", torch.float32)}  # (kernels.py)
CUDA_SPLIT = "BRANCHREPLAY_CUDA_SPLIT_ATTENTION"
"""Environment variable: "0" opts CUDA out of split prefix attention (into the masked SDPA path, exact too). On by
default: on a GPU it ran the headline step faster and in less memory than the masked path (figures:
docs/notes/engine-docstrings.md)."""


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
    ancestors' states, alive anyway). Returns out [B, h, S, d]. Saved for backward: q, the pack's own k / v and mask,
    out, lse and the pieces; a group's concatenated prefix exists only inside forward and backward. The block kernels
    are the device's (`kernels.py`).

    A group's queries are folded into one query sequence against its prefix as it is, never copied per row: the
    rows of a batch below one prefix (`packs.batched_packs`), or the nodes of a pack that hang below different
    parents (one group per parent, `stack._Run.packs_of`). A piece several groups see (their common ancestors) gets
    the sum of their dK, dV."""

    @staticmethod
    def forward(ctx, q, k, v, own_mask, scale, groups, n, *pieces):
        kernels = kernels_for(q.device)
        causal = own_mask is None
        bounds = [a for a, _, _ in groups] + [groups[-1][1]]
        if bounds[0] != 0 or bounds[-1] != q.shape[0] * q.shape[2] or [b for _, b, _ in groups] != bounds[1:]:
            raise RuntimeError(f"split attention's query groups {[g[:2] for g in groups]} do not cover its "
                               f"{q.shape[0] * q.shape[2]} queries in order")
        if any(piece.shape[0] != 1 for piece in pieces):  # the CPU kernel does not check q's and k's batch sizes
            raise RuntimeError(f"split attention takes prefix pieces of one row, got {[p.shape for p in pieces]}")
        rows, folded = q.shape[0], _fold_rows(q)
        outs, lses, saved_p = [], [], []
        for a, b, used in groups:
            kp, vp = torch.cat([pieces[i] for i in used], dim=2), torch.cat([pieces[n + i] for i in used], dim=2)
            out_g, lse_g, saved_g = kernels.forward(_queries(folded, a, b, groups), kp, vp, None, False, scale)
            outs.append(out_g)
            lses.append(lse_g)
            saved_p.append(saved_g)
        del kp, vp
        out_p, lse_p = _unfold_rows(_joined(outs, 2), rows), _unfold_rows(_joined(lses, 2), rows)
        out_s, lse_s, saved_s = kernels.forward(q, k, v, own_mask, causal, scale)
        out, lse = _merged(out_p, lse_p, out_s, lse_s)  # lse [B, h, S]
        ctx.save_for_backward(q, k, v, own_mask, out, lse, *pieces)
        ctx.scale, ctx.groups, ctx.n, ctx.saved = scale, groups, n, (saved_p, saved_s)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, own_mask, out, lse, *pieces = ctx.saved_tensors
        kernels = kernels_for(q.device)
        n, groups, dout, (saved_p, saved_s) = ctx.n, ctx.groups, dout.contiguous(), ctx.saved
        folded = [_fold_rows(x) for x in (dout, q, out, lse)]
        dq_parts, dk, dv = [], [None] * n, [None] * n
        for (a, b, used), saved_g in zip(groups, saved_p):
            kp, vp = torch.cat([pieces[i] for i in used], dim=2), torch.cat([pieces[n + i] for i in used], dim=2)
            dout_g, q_g, out_g, lse_g = (_queries(x, a, b, groups) for x in folded)
            dq_g, dk_g, dv_g = kernels.backward(dout_g, q_g, kp, vp, None, out_g, lse_g, False, ctx.scale, saved_g)
            dq_parts.append(dq_g)
            sizes = [pieces[i].shape[2] for i in used]
            for i, dk_i, dv_i in zip(used, dk_g.split(sizes, dim=2), dv_g.split(sizes, dim=2)):
                dk[i] = dk_i if dk[i] is None else dk[i] + dk_i
                dv[i] = dv_i if dv[i] is None else dv[i] + dv_i
        del kp, vp
        dq_p = _unfold_rows(_joined(dq_parts, 2), q.shape[0])
        dq_s, dk_s, dv_s = kernels.backward(dout, q, k, v, own_mask, out, lse, own_mask is None, ctx.scale, saved_s)
        return (dq_p + dq_s, dk_s, dv_s, None, None, None, None, *dk, *dv)


def split_attention(q, k, v, own_mask, scale, keys, values, groups=None) -> torch.Tensor:
    """`_SplitAttention` (its shapes): the queries against the prefix pieces `keys`, `values` (lists, root first) and
    their own keys; `groups` as `cache.Prefix.groups`, None: every query sees every piece."""
    if groups is None:
        groups = ((0, q.shape[0] * q.shape[2], tuple(range(len(keys)))),)
    return _SplitAttention.apply(q, k, v, own_mask, scale, groups, len(keys), *keys, *values)


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


def grouped_prefix_attention(q, k, v, bias, scale, spans, prompt_keys, prompt_values) -> torch.Tensor:
    """One decoding step of the rows of several groups, each group's prompt held once (the sampler's static rows,
    `decode/rows/static.py`): q [C, h, 1, d]; k, v [C, h_kv, L, d] the rows' own generated keys under `bias`
    [C, 1, 1, L]; rows spans[g] = (a, b) belong to group g, whose prompt keys / values are prompt_keys[g],
    prompt_values[g] [1, h_kv, P_g, d], seen by every query of the group without a mask (its rows folded into one
    query sequence, as `_SplitAttention` runs a batch below one prefix). Rows in no span see no prompt. The blocks
    are merged by their log-sum-exp, as `_SplitAttention.forward`; no autograd (sampling). Returns out [C, h, 1, d]."""
    kernels = kernels_for(q.device)
    out_s, lse_s, _ = kernels.forward(q, k, v, bias, False, scale)
    out_p, lse_p = torch.zeros_like(out_s), torch.full_like(lse_s, float("-inf"))
    for (a, b), kp, vp in zip(spans, prompt_keys, prompt_values):
        if a < b:
            out, lse, _ = kernels.forward(_fold_rows(q[a:b]), kp, vp, None, False, scale)
            out_p[a:b], lse_p[a:b] = _unfold_rows(out, b - a), _unfold_rows(lse, b - a)
    return _merged(out_p, lse_p, out_s, lse_s)[0]


def _merged(out_p, lse_p, out_s, lse_s) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention blocks over disjoint keys ([..., S, d] outputs, [..., S] log-sum-exps) as one attention over
    all their keys (the module docstring's formula): (out, lse)."""
    lse = torch.logaddexp(lse_p, lse_s)
    w_p, w_s = torch.exp(lse_p - lse)[..., None].to(out_p.dtype), torch.exp(lse_s - lse)[..., None].to(out_p.dtype)
    return out_p * w_p + out_s * w_s, lse


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
    Raises RuntimeError when the two disagree (keys carrying prefix pieces with an unmarked mask, or the reverse) or
    when the layer asks for what split attention does not do (dropout, softcap, sliding window, position bias,
    attention sinks): wrong results would otherwise pass silently."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        kind = getattr(attention_mask, _MARK, None)
        prefix = getattr(key, PREFIX_ATTR, None)  # cache.Prefix
        groups = getattr(key, GROUPS_ATTR, None)
        unsupported = [k for k in ("softcap", "sliding_window", "position_bias", "s_aux") if kwargs.get(k) is not None]
        if (kind == "groups") != (groups is not None):
            raise RuntimeError("decoding rows and their group prompts reached attention apart (the mask lost its "
                               "mark, or keys carry prompts under another mask): a model that copies or moves its "
                               "attention mask is not supported; set sampling.cache_implementation=dynamic")
        if kind == "groups":
            if dropout or unsupported:
                raise RuntimeError(f"grouped prefix attention cannot run this layer (dropout {dropout}, "
                                   f"{unsupported}); set sampling.cache_implementation=dynamic")
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            out = grouped_prefix_attention(query, key, value, attention_mask, scale, *groups)
            return out.transpose(1, 2).contiguous(), None
        if kind is None:
            if prefix is not None:
                raise RuntimeError("keys without their prefix reached plain SDPA: the layer's mask lost the split "
                                   "mark (a model that copies or slices its attention mask is not supported)")
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if dropout or unsupported or prefix is None:
            raise RuntimeError(f"split prefix attention cannot run this layer (dropout {dropout}, {unsupported}, "
                               f"prefix pieces {'missing' if prefix is None else 'present'}); run it with "
                               "EngineConfig defaults on a supported family, or report the model")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        own = None if kind == "causal" else attention_mask.to(query.dtype)
        out = split_attention(query, key, value, own, scale, prefix.keys, prefix.values, prefix.groups)
        return out.transpose(1, 2).contiguous(), None

    return attention


SPLIT_ATTENTION = "branchreplay_split_sdpa"
"""The name under which split prefix attention is registered with transformers' `AttentionInterface` (and the SDPA
mask function with `AttentionMaskInterface`, for the root packs that take transformers' causal mask)."""


class PrefixSplit:
    """Whether `model` runs split prefix attention (`applies`; see the module docstring for the conditions).
    kinds: per decoder layer "attention", "recurrent" or "hybrid" (`recurrent.layer_kinds`); windows: per layer the
    sliding window or None (`families.layer_windows`).

    As a context manager it switches the model to `SPLIT_ATTENTION` while the engine runs, and back to its own
    implementations (the model's and its sub-configs') when the last engine on that model exits (a count per model
    under a lock: engines nested or in threads share the switch). Nothing of transformers is replaced and other
    models never see it. A model where it does not apply is left untouched; one whose class cannot switch its
    attention (transformers then only warns) runs the masked SDPA path instead (`applies` turns False)."""

    _active: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [engines inside, previous]
    _lock = threading.Lock()

    def __init__(self, model, windows: list[int | None], kinds: list[str]):
        config = model.config
        self.model = model
        self.applies = (
            getattr(config, "_attn_implementation", None) in ("sdpa", SPLIT_ATTENTION)
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
            self.model.set_attn_implementation(SPLIT_ATTENTION)
            if self.model.config._attn_implementation != SPLIT_ATTENTION:
                self.applies = False  # transformers refused the switch: keep the masked path, which is exact
                return self
            self._active[self.model] = [1, previous]
        return self

    def __exit__(self, *exc) -> None:
        if not self.applies:
            return
        with self._lock:
            active = self._active[self.model]
            active[0] -= 1
            if active[0] == 0:
                del self._active[self.model]
                self.model.set_attn_implementation(active[1])


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
    AttentionInterface.register(SPLIT_ATTENTION, _SPLIT)
    AttentionMaskInterface.register(SPLIT_ATTENTION, sdpa_mask)


_SPLIT = split_sdpa(sdpa_attention_forward)
