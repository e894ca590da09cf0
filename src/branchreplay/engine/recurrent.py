"""Recurrent layers (SSM, linear attention, short convolution): what a branch needs from its prefix, and the fixes
that make transformers' own code exact under the execution stack.

A recurrent layer's `NodeState` is its state AFTER the node's last token, constant in the prefix length: (conv,) for
LFM2's short convolution (conv [1, C, K]); (conv, recurrent) for Mamba and Jamba (SSM state [1, D, N]), Mamba2,
Bamba, NemotronH, Granite 4.0 hybrid and Zamba2 ([1, H, P, N]), the gated delta-nets of Qwen3-Next and OLMo Hybrid
([1, H_v, D_k, D_v]) and Kimi Linear's delta attention ([1, H, D, D]), the last three float32 whatever the model
dtype; (k, v, conv, recurrent) for FalconH1 and for Zamba2's "hybrid" layers (a shared attention block feeding the
layer's Mamba2 mixer, both at one layer index). A child starts from its PARENT's state only, so such
a family runs every node as a pack of one (`Family.recurrent`). transformers' mixers write cached states in place,
and Mamba's multi-token scan ignores a cached state: `RecurrentLayer` records the past and assigns new states, and
`EngineForwards` installs `mamba2_forward` / `mamba_forward` on the mixers while the engine runs.
Design notes and measurements: docs/notes/execution-stack.md.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

LAYER_KINDS = {"linear_attention": "recurrent", "conv": "recurrent", "hybrid": "hybrid", "moe": "stateless",
               "mlp": "stateless"}
"""transformers' `config.layer_types` entries -> our layer kind ("attention" for any other entry). "moe" and "mlp"
are NemotronH's layers without a token mixer: they read nothing from the prefix and hand nothing on."""


def layer_kinds(config) -> list[str]:
    """Per decoder layer: "attention" (K/V of every ancestor), "recurrent" (conv/SSM state of the parent), "hybrid"
    (both in one layer index: FalconH1) or "stateless" (an MLP or MoE layer alone: NemotronH; an attention layer
    that reuses an earlier layer's K/V, Gemma 4's `kv_sharing_modes` "reuse": it computes and caches none), from
    `config.layer_types` (all "attention" without it)."""
    n = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * n
    kinds = [LAYER_KINDS.get(t, "attention") for t in layer_types[:n]]
    if getattr(config, "num_kv_shared_layers", 0) and hasattr(type(config), "kv_sharing_modes"):
        kinds = ["stateless" if mode == "reuse" else k for k, mode in zip(kinds, config.kv_sharing_modes, strict=True)]
    return kinds


def attention_layers(config) -> list[bool]:
    """Per decoder layer: whether it holds attention K/V (an "attention" or "hybrid" layer of `layer_kinds`)."""
    return [kind in ("attention", "hybrid") for kind in layer_kinds(config)]


class RecurrentLayer(LinearAttentionCacheLayerMixin):
    """One recurrent layer's cache: the parent's conv/recurrent state in, this forward's final state out.

    Args:
        parent: the parent node's `NodeState` for this layer, (conv,) or (conv, recurrent), or None at a root (the
            state is then zero, as in a forward without cache).
    After the forward, `node_state(0, L)` is (conv, recurrent) after the last of the L query tokens (only the end of
    the whole query: a recurrent state exists only where the scan stopped).
    """

    def __init__(self, parent: tuple[torch.Tensor, ...] | None):
        super().__init__(number_of_states=1)
        # Mixers test `cache.is_recording_past(layer)` before their in-place single-token conv update: recording
        # sends every length down the path that concatenates the cached inputs with the new ones.
        self.record_past = True
        if parent:
            self.conv_states[0] = parent[0]
            self.recurrent_states[0] = parent[1] if len(parent) > 1 else None
            self.has_previous_state[0] = True
        self.new_conv = self.new_recurrent = None
        self.query_length = 0

    def lazy_initialization(self, *args, **kwargs) -> None:
        """Nothing to allocate: states are assigned, never copied into buffers."""

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """conv_states [1, C, L] (this forward's conv inputs) -> [1, C, K + L] with the parent's K cached inputs in
        front ([1, C, L] at a root: the conv pads with zeros itself). Keeps the last K inputs as the new state."""
        if state_idx != 0:
            raise ValueError("RecurrentLayer holds one conv state per layer (number_of_conv_states = 1)")
        previous = self.conv_states[0] if self.has_previous_state[0] else None
        K = previous.shape[-1] if previous is not None else conv_kernel_size
        if K is None:
            raise ValueError("update_conv_state needs conv_kernel_size at a root (no cached state to read it from)")
        full = conv_states if previous is None else torch.cat([previous.to(conv_states.dtype), conv_states], dim=-1)
        self.new_conv = F.pad(full, (max(K - full.shape[-1], 0), 0))[..., -K:]  # zeros before the first token
        self.query_length = conv_states.shape[-1]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Keep the state after the last query token (assigned: the parent's tensor is never written)."""
        self.new_recurrent = recurrent_states
        return recurrent_states

    def node_state(self, a: int, b: int) -> tuple[torch.Tensor, ...]:
        if (a, b) != (0, self.query_length):
            raise RuntimeError(f"a recurrent layer's state exists only after the whole query (0, {self.query_length}), "
                               f"not at ({a}, {b}): recurrent families must run as packs of one node")
        return (self.new_conv,) if self.new_recurrent is None else (self.new_conv, self.new_recurrent)


class HybridLayer(RecurrentLayer, CacheLayerMixin):
    """A layer index holding both an attention cache and a recurrent one (FalconH1: attention and Mamba2 mixer side
    by side). Attention calls (`update`, lengths, mask sizes) go to `attention`, the engine's attention layer; its
    `NodeState` is the attention part followed by (conv, recurrent)."""

    def __init__(self, attention: CacheLayerMixin, parent: tuple[torch.Tensor, ...] | None):
        CacheLayerMixin.__init__(self)
        RecurrentLayer.__init__(self, parent)
        self.attention = attention

    def update(self, key_states, value_states, *args, **kwargs):
        return self.attention.update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self.attention.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.attention.get_mask_sizes(query_length)

    @property
    def is_sliding(self) -> bool:
        return getattr(self.attention, "is_sliding", False)

    def node_state(self, a: int, b: int) -> tuple[torch.Tensor, ...]:
        return tuple(self.attention.node_state(a, b)) + RecurrentLayer.node_state(self, a, b)


# -- mixer forwards used under the engine ---------------------------------------------------------------------------


def mamba2_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """Mamba2Mixer / BambaMixer / FalconH1Mixer / NemotronHMamba2Mixer / GraniteMoeHybridMambaLayer / Zamba2MambaMixer
    forward under the engine: transformers' chunked path (conv1d over the cached inputs + the new ones,
    `mamba2_chunk_scan` from the cached SSM state), for every length, including the single token for which
    transformers would update the state in place (Zamba2's own forward then fails in backward: the state it read
    was modified in place). Same operations in the same order as transformers' chunked path (FalconH1's multipliers
    and `mamba_rms_norm` switch included); the kernels are the model file's own (mamba_ssm / causal_conv1d when
    installed, their torch fallbacks otherwise)."""
    if not _is_ours(cache, self.layer_idx) or attention_mask is not None:
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    hf = sys.modules[type(self).__module__]
    batch, L, _ = hidden_states.shape
    dtype = hidden_states.dtype
    if hasattr(self, "ssm_in_multiplier"):  # FalconH1
        hidden_states = hidden_states * self.ssm_in_multiplier
    projected = self.in_proj(hidden_states)
    if hasattr(self, "mup_vector"):  # FalconH1
        projected = projected * self.mup_vector
    A = -torch.exp(self.A_log.float())
    gate, xBC, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
    xBC = cache.update_conv_state(xBC.transpose(1, 2), self.layer_idx, conv_kernel_size=self.conv_kernel_size)
    xBC = hf.causal_conv1d_fn(xBC, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation)
    xBC = xBC[:, :, -L:].transpose(1, 2)
    groups_state = self.n_groups * self.ssm_state_size
    x, B, C = torch.split(xBC, [self.intermediate_size, groups_state, groups_state], dim=-1)
    y, state = hf.mamba2_chunk_scan(
        x.view(batch, L, -1, self.head_dim),
        dt,
        A,
        B.view(batch, L, self.n_groups, -1),
        C.view(batch, L, self.n_groups, -1),
        chunk_size=self.chunk_size,
        D=self.D,
        z=None,
        return_final_states=True,
        dt_bias=self.dt_bias,
        dt_softplus=True,
        initial_states=cache.get_recurrent_state(self.layer_idx),
        dt_limit=self.time_step_limit,
    )
    cache.update_recurrent_state(state, self.layer_idx)
    y = y.reshape(batch, L, -1)
    y = self.norm(y, gate) if getattr(self, "mamba_rms_norm", True) else y * F.silu(gate)
    return self.out_proj(y.to(dtype))


def mamba_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """MambaMixer / JambaMambaMixer forward under the engine: the scan continues from the cached SSM state.

    transformers' `mamba_selective_scan` starts every multi-token call from a zero state (mamba_ssm's
    `selective_scan_fn` takes no initial state), so a multi-token child of a cached prefix would be computed as
    if the prefix were absent. Here: conv1d over the cached inputs + the new ones, then transformers' sequential
    scan (`selective_scan_from`) started from the cached state; every length, the single token included (which
    transformers would update in place). Jamba's dt/B/C norms are applied as in its forward."""
    if not _is_ours(cache, self.layer_idx) or attention_mask is not None:
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    hf = sys.modules[type(self).__module__]
    L = hidden_states.shape[1]
    dtype = hidden_states.dtype
    projected = self.in_proj(hidden_states).transpose(1, 2)  # [1, 2D, L]
    A = -torch.exp(self.A_log.float())
    x, gate = projected.chunk(2, dim=1)
    x = cache.update_conv_state(x, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
    x = hf.causal_conv1d_fn(x, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation)[:, :, -L:]
    time_step, B, C = torch.split(
        self.x_proj(x.transpose(1, 2)), [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1
    )
    jamba = hasattr(self, "dt_layernorm")
    if jamba:
        time_step, B, C = self.dt_layernorm(time_step), self.b_layernorm(B), self.c_layernorm(C)
    if jamba and hasattr(self.config, "_is_quantized"):  # as Jamba's forward, for a quantized dt_proj
        time_step = (self.dt_proj(time_step) - self.dt_proj.bias).transpose(1, 2)
    else:
        time_step = self.dt_proj.weight @ time_step.transpose(1, 2)
    dt_bias = self.dt_proj.bias.float() if self.dt_proj.bias is not None else None
    y, state = selective_scan_from(
        cache.get_recurrent_state(self.layer_idx), x, time_step, A, B, C, D=self.D.float(), z=gate, dt_bias=dt_bias
    )
    cache.update_recurrent_state(state, self.layer_idx)
    return self.out_proj(y.transpose(1, 2).to(dtype))


def selective_scan_from(state, x, dt, A, B, C, D, z, dt_bias):
    """transformers' `mamba_selective_scan` (its sequential path, same operations in the same order) started from
    `state` instead of zeros.

    x, z, dt: [b, D, L]; A: [D, N]; B, C: [b, L, N]; D: [D]; dt_bias: [D] or None; state: [b, D, N] or None (zeros).
    Returns y [b, D, L] and the state after the last position [b, D, N].
    """
    batch, d_inner, L = x.shape
    input_dtype = x.dtype
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)[..., None]
    dt = F.softplus(dt)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    discrete_B = dt[:, :, :, None] * B[:, None, :, :].float()
    deltaB_u = discrete_B * x[:, :, :, None].float()
    if state is None:
        state = torch.zeros(batch, d_inner, A.shape[-1], dtype=input_dtype, device=x.device)
    ys = []
    for i in range(L):
        state = discrete_A[:, :, i] * state + deltaB_u[:, :, i]
        ys.append(torch.matmul(state.to(input_dtype), C[:, i, :].unsqueeze(-1))[:, :, 0])
    y = torch.stack(ys, dim=-1)
    y = y + x * D[None, :, None]
    return y * F.silu(z), state


ENGINE_FORWARDS = {
    "Mamba2Mixer": mamba2_forward,
    "BambaMixer": mamba2_forward,
    "FalconH1Mixer": mamba2_forward,
    "NemotronHMamba2Mixer": mamba2_forward,
    "GraniteMoeHybridMambaLayer": mamba2_forward,
    "Zamba2MambaMixer": mamba2_forward,
    "MambaMixer": mamba_forward,
    "JambaMambaMixer": mamba_forward,
}
"""Mixer class name -> its forward under the engine. LFM2's short conv, the gated delta-nets of Qwen3-Next and OLMo
Hybrid and Kimi Linear's delta attention need none: with `RecurrentLayer` (recording the past, assigning states)
their own forwards are exact for every length."""


def _is_ours(cache, layer_idx: int) -> bool:
    layers = getattr(cache, "layers", ())
    return layer_idx < len(layers) and isinstance(layers[layer_idx], RecurrentLayer)


class EngineForwards:
    """Context manager installing `ENGINE_FORWARDS` on the mixers of `model` (as instance attributes, restored on
    exit); reusable. A model without such mixers gets a no-op."""

    def __init__(self, model: torch.nn.Module):
        self.mixers = [m for m in model.modules() if type(m).__name__ in ENGINE_FORWARDS]
        self.saved: list = []

    def __enter__(self):
        self.saved = [m.__dict__.get("forward") for m in self.mixers]
        for m in self.mixers:
            m.forward = types.MethodType(ENGINE_FORWARDS[type(m).__name__], m)
        return self

    def __exit__(self, *exc) -> None:
        for m, saved in zip(self.mixers, self.saved, strict=True):
            if saved is None:
                del m.forward
            else:
                m.forward = saved
