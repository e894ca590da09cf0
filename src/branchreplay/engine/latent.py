"""Multi-head latent attention (MLA; DeepSeek-V2 / V3, Kimi K2 and K2.5's text model, GLM-4.7-Flash): what a branch
holds of its prefix, and how split prefix attention reads it.

An MLA layer hands the cache its compressed state, not K and V (transformers 5.25, `DeepseekV3Attention.forward`):
    "keys"   = kv_nope [B, 1, L, kv_lora_rank]      (kv_a_proj_with_mqa, then kv_a_layernorm)
    "values" = k_rot   [B, 1, L, qk_rope_head_dim]  (post-RoPE; one rotary key shared by every head)
and expands what the cache returns at every use (`expand_kv`: kv_b_proj per position):
    K [B, h, L, qk_nope_head_dim + qk_rope_head_dim],   V [B, h, L, v_head_dim]  (K and V of different widths).
So a node's `cache.NodeState` per layer is this latent pair, (kv_lora_rank + qk_rope_head_dim) elements per position
(`families.latent_state_width`), against h * (d_qk + d_v) for expanded K and V: 576 against 40960 elements per layer
and position in DeepSeek-V3 (bf16: 70 KB per token over its 61 layers). The masked path needs nothing more:
`cache._PrefixLayer.update` concatenates the ancestors' latents with the pack's, and the layer expands the whole.
Under split prefix attention the layer's keys carry the ancestors' latent pieces (`cache.Prefix`), which the
expansion would drop: `LatentExpansion` (entered by `attention.PrefixSplit` with its switch) gives each MLA
attention module an `expand_kv` that also expands every prefix piece and hands the expanded pieces on with the
expanded keys, so that `attention.split_sdpa` finds them. An expanded piece exists only inside the pack's forward
and backward (saved by split attention, as the masked path saves the concatenated expansion); what children hold is
the latent. K and V of different widths go through the block kernels zero-padded to one width
(`attention.split_attention`, `same_width`).
Only the attention's state changes; the rest of the layer (DeepSeek MoE: grouped sigmoid routing with a score
correction bias, shared experts, dense first layers) runs per position as transformers computes it.
"""

from __future__ import annotations

import types

import torch

from .cache import PREFIX_ATTR, Prefix


def is_latent_attention(module: torch.nn.Module) -> bool:
    """Whether `module` is an MLA attention layer of transformers' form: an `expand_kv(kv_nope, k_rot)` method and a
    `kv_lora_rank` (DeepSeek-V2 / V3, GLM-4-MoE-Lite and the models built from them)."""
    return callable(getattr(type(module), "expand_kv", None)) and hasattr(module, "kv_lora_rank")


def _expand_kv(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The instance `expand_kv` of an MLA module under `LatentExpansion`: the class's own expansion of (kv_nope,
    k_rot); where kv_nope carries prefix latents (`cache.PREFIX_ATTR`, split prefix attention), each prefix piece
    expanded by the same function, and the keys returned carry them as a `cache.Prefix` of expanded K [1, h, L_i,
    d_qk] and V [1, h, L_i, d_v] pieces with the same query groups."""
    expand = type(self).expand_kv
    keys, values = expand(self, kv_nope, k_rot)
    prefix = getattr(kv_nope, PREFIX_ATTR, None)
    if prefix is not None:
        pieces = [expand(self, latent, rot) for latent, rot in zip(prefix.keys, prefix.values, strict=True)]
        setattr(keys, PREFIX_ATTR, Prefix([k for k, _ in pieces], [v for _, v in pieces], prefix.groups))
    return keys, values


class LatentExpansion:
    """Context manager installing `_expand_kv` on the MLA attention modules of `model` (`is_latent_attention`) as
    instance attributes, restored on exit (an instance `expand_kv` set before is put back); reusable. A model
    without such modules gets a no-op. Nothing of transformers is replaced and other models never see it."""

    def __init__(self, model: torch.nn.Module):
        self.modules = [m for m in model.modules() if is_latent_attention(m)]
        self.saved: list = []

    def __enter__(self) -> LatentExpansion:
        self.saved = [m.__dict__.get("expand_kv") for m in self.modules]
        for m in self.modules:
            m.expand_kv = types.MethodType(_expand_kv, m)
        return self

    def __exit__(self, *exc) -> None:
        for m, saved in zip(self.modules, self.saved, strict=True):
            if saved is None:
                del m.expand_kv
            else:
                m.expand_kv = saved
        self.saved = []


def same_width(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: list[torch.Tensor],
               values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list, list]:
    """(q, k, v, keys, values) of split prefix attention with K and V of different widths (d_qk of q, k and the key
    pieces, d_v of v and the value pieces) zero-padded in the last dimension to one width D, max(d_qk, d_v) rounded
    up to a multiple of 8 (the block kernels take one head width; CUDA's wants it aligned). Exact: zero channels add
    zero terms to q . k, and zero columns of V give output columns the caller cuts off (their gradient is zero);
    the padding is differentiable, so the pieces' gradients are the unpadded slices of the padded ones'."""
    width = -(-max(q.shape[-1], v.shape[-1]) // 8) * 8

    def pad(x: torch.Tensor) -> torch.Tensor:
        return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))

    return pad(q), pad(k), pad(v), [pad(x) for x in keys], [pad(x) for x in values]
