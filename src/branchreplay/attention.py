"""Attention of a pack against a cached prefix, split in two: the prefix keys without a mask, the pack's own keys with
the tree mask, merged by their log-sum-exp (the merge of blockwise / ring attention: Milakov & Gimelshein 2018,
"Online normalizer calculation for softmax"; Dao et al. 2022, FlashAttention, section 3.1).

Every query of a pack sees all K prefix keys, so that block needs no mask: the flash kernel runs it at full speed,
and no [S, K + S] mask is built or kept for backward. Only the [S, S] block of the pack's own keys takes the tree
mask; a pack of one node (a chunk of a long prompt) takes the causal flag instead, whose blocks the kernel skips.

    out = (exp(lse_p) * out_p + exp(lse_s) * out_s) / exp(lse),   lse = logaddexp(lse_p, lse_s)

The backward calls the kernel's backward on each block with the merged `out` and `lse`: it computes
P = exp(scores - lse) and D = rowsum(dout * out) from them, so each block's dK, dV and dQ share are exactly those of
one attention over all K + S keys.

Used on the CPU (`aten._scaled_dot_product_flash_attention_for_cpu`), for float32 and float64, in attention layers
without a sliding window; everything else keeps the single masked SDPA call (`PrefixSplit.applies`).
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.modeling_utils import AttentionInterface

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_MARK = "_branchreplay_own_keys"  # attribute of a mask that covers only the pack's own keys


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
    """q [B, h, S, d]; k, v [B, h, K + S, d] (K prefix keys first); own_mask [1, 1, S, S] or None (causal).
    Returns out [B, h, S, d]."""

    @staticmethod
    def forward(ctx, q, k, v, own_mask, prefix, scale):
        causal = own_mask is None
        kp, vp, ks, vs = k[:, :, :prefix], v[:, :, :prefix], k[:, :, prefix:], v[:, :, prefix:]
        out_p, lse_p = _flash(q, kp, vp, 0.0, False, scale=scale)
        out_s, lse_s = _flash(q, ks, vs, 0.0, causal, attn_mask=own_mask, scale=scale)
        lse = torch.logaddexp(lse_p, lse_s)  # [B, h, S]
        out = out_p * torch.exp(lse_p - lse)[..., None].to(q.dtype) + out_s * torch.exp(lse_s - lse)[..., None].to(
            q.dtype)
        ctx.save_for_backward(q, k, v, own_mask, out, lse)
        ctx.prefix, ctx.scale = prefix, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, own_mask, out, lse = ctx.saved_tensors
        K, causal, dout = ctx.prefix, own_mask is None, dout.contiguous()
        dq_p, dk_p, dv_p = _flash_backward(dout, q, k[:, :, :K], v[:, :, :K], out, lse, 0.0, False, scale=ctx.scale)
        dq_s, dk_s, dv_s = _flash_backward(dout, q, k[:, :, K:], v[:, :, K:], out, lse, 0.0, causal,
                                           attn_mask=own_mask, scale=ctx.scale)
        return dq_p + dq_s, torch.cat([dk_p, dk_s], dim=2), torch.cat([dv_p, dv_s], dim=2), None, None, None


def split_sdpa(original):
    """transformers' sdpa attention function, extended: a mask marked by `own_keys_mask` runs `_SplitAttention`;
    any other call goes to `original` unchanged. Returns (attn_output [B, S, h, d], None) as transformers'."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        kind = getattr(attention_mask, _MARK, None)
        if kind is None:
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if dropout or kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
            raise RuntimeError("split prefix attention got dropout, softcap or a sliding window (an engine bug)")
        groups = getattr(module, "num_key_value_groups", 1)
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        S = query.shape[2]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        own = None if kind == "causal" else attention_mask.to(query.dtype)
        out = _SplitAttention.apply(query, key, value, own, key.shape[2] - S, scale)
        return out.transpose(1, 2).contiguous(), None

    return attention


class PrefixSplit:
    """Context manager that routes marked masks of `model`'s attention layers to `split_sdpa` while the engine runs
    (transformers' global "sdpa" entry, restored on exit); reusable. `applies` says whether the model qualifies."""

    def __init__(self, model, windows: list[int | None], recurrent: bool):
        config = model.config
        self.applies = (
            getattr(config, "_attn_implementation", None) == "sdpa"
            and model.device.type == "cpu"
            and model.dtype in (torch.float32, torch.float64)
            and all(w is None for w in windows)
            and not recurrent
            and getattr(config, "attn_logit_softcapping", None) is None
        )
        self.saved = None

    def __enter__(self):
        if self.applies:
            self.saved = AttentionInterface._global_mapping["sdpa"]
            AttentionInterface._global_mapping["sdpa"] = split_sdpa(self.saved)
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            AttentionInterface._global_mapping["sdpa"] = self.saved
            self.saved = None
