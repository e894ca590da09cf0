"""The attention kernels that split prefix attention (`attention.py`) runs per block: fused SDPA kernels that return
the block's log-sum-exp and whose backward takes the MERGED output and log-sum-exp, per device.

    forward(q, k, v, mask, causal, scale) -> out [B, h, S, d], lse [B, h, S] (float32 or float64), saved
    backward(dout, q, k, v, mask, out, lse, causal, scale, saved) -> dq, dk, dv

q [B, h, S, d]; k, v [B, h_kv, L, d], h a multiple of h_kv (grouped as transformers' `repeat_kv`); mask None or an
additive [1, 1, S, L] bias; causal: top-left aligned; `saved`: what the forward hands its backward. CPU:
`aten._scaled_dot_product_flash_attention_for_cpu` (float32, float64, bfloat16). CUDA:
`aten._scaled_dot_product_efficient_attention` (Rabe & Staats 2021; float32 and an additive bias), its quirks
(no grouped heads, log-sum-exp padded to 32 queries, bias rows padded to 16) handled as PyTorch's SDPA dispatch does.
Design notes and measurements: docs/notes/split-attention.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

_BIAS_ALIGN = 16  # elements: the memory-efficient kernel's bias row stride
_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_efficient = torch.ops.aten._scaled_dot_product_efficient_attention  # log-sum-exp [B, h, ceil(S / 32) * 32]
_efficient_backward = torch.ops.aten._scaled_dot_product_efficient_attention_backward


class Kernels(NamedTuple):
    forward: object
    backward: object


def kernels_for(device: torch.device | str) -> Kernels | None:
    """The block kernels of `device`'s type ("cpu" or "cuda"), or None where split attention has none."""
    return _KERNELS.get(torch.device(device).type)


# -- CPU ------------------------------------------------------------------------------------------------------------

def _cpu_forward(q, k, v, mask, causal, scale):
    out, lse = _cpu_flash(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse, None


def _cpu_backward(dout, q, k, v, mask, out, lse, causal, scale, saved):
    return _cpu_flash_backward(dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


# -- CUDA -----------------------------------------------------------------------------------------------------------

def _cuda_forward(q, k, v, mask, causal, scale):
    groups = q.shape[1] // k.shape[1]
    fold = groups > 1 and mask is None and not causal  # the unmasked prefix block: no copies of K / V
    bias = _aligned_bias(mask, q.shape[0], q.shape[1])
    qk, kk, vk = (_fold(q, groups), k, v) if fold else (q, _expand_heads(k, groups), _expand_heads(v, groups))
    out, lse, seed, offset = _efficient(qk, kk, vk, bias, True, 0.0, causal, scale=scale)
    S = qk.shape[2]
    return _unfold(out, q.shape), lse[..., :S].reshape(q.shape[:3]), (lse.shape, seed, offset, fold)


def _cuda_backward(dout, q, k, v, mask, out, lse, causal, scale, saved):
    lse_shape, seed, offset, fold = saved
    groups = q.shape[1] // k.shape[1]
    if fold:
        qk, kk, vk, dout, out, lse = _fold(q, groups), k, v, _fold(dout, groups), _fold(out, groups), \
            lse.reshape(*k.shape[:2], -1)
    else:
        qk, kk, vk = q, _expand_heads(k, groups), _expand_heads(v, groups)
    padded = lse.new_zeros(lse_shape)
    padded[..., : lse.shape[-1]] = lse  # the merged log-sum-exp; the padding rows are no queries
    dq, dk, dv, _ = _efficient_backward(
        dout, qk, kk, vk, _aligned_bias(mask, q.shape[0], q.shape[1]), out, padded, seed, offset, 0.0,
        [True, True, True, False], causal, scale=scale)
    if fold:
        return _unfold(dq, q.shape), dk, dv
    return dq, _sum_heads(dk, groups), _sum_heads(dv, groups)


def _fold(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, h_kv * groups, S, d] -> [B, h_kv, groups * S, d]: the query heads of one KV head as one longer query
    sequence (`repeat_kv`'s grouping), valid for a block without a mask, where every query sees every key."""
    B, h, S, d = x.shape
    return x.reshape(B, h // groups, groups * S, d)


def _unfold(x: torch.Tensor, shape) -> torch.Tensor:
    """The inverse of `_fold` (a no-op for an unfolded block)."""
    return x.reshape(shape)


def _expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, h_kv, L, d] -> [B, h_kv * groups, L, d], each KV head repeated for its query heads (`repeat_kv`)."""
    if groups == 1:
        return x
    B, h, L, d = x.shape
    return x[:, :, None].expand(B, h, groups, L, d).reshape(B, h * groups, L, d)


def _sum_heads(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand_heads`: [B, h_kv * groups, L, d] -> [B, h_kv, L, d], summed over each group."""
    if groups == 1:
        return dx
    B, h, L, d = dx.shape
    return dx.view(B, h // groups, groups, L, d).sum(2)


def _aligned_bias(mask: torch.Tensor | None, batch: int, heads: int) -> torch.Tensor | None:
    """[1, 1, S, L] additive mask -> [B, h, S, L] (a stride-0 expansion) whose rows are `_BIAS_ALIGN`-aligned."""
    if mask is None:
        return None
    L = mask.shape[-1]
    padded = F.pad(mask, (0, -L % _BIAS_ALIGN))[..., :L]
    return padded.expand(batch, heads, *padded.shape[-2:])


_KERNELS = {"cpu": Kernels(_cpu_forward, _cpu_backward), "cuda": Kernels(_cuda_forward, _cuda_backward)}
