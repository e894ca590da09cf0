"""float64 formulas for the gated delta-net layers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo Hybrid) and Kimi Linear's
delta attention, which compute in float32 in a float64 model, for `float64.keep_float64` (checked against
transformers 5.25's model files):
    `torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule` (Kimi: `chunk_kimi_delta_attention`,
        `recurrent_kimi_delta_attention`; module functions: every such model of the process while active, float64
        inputs only): the gated delta rule (Yang et al. 2024, "Gated Delta Networks", eq. 10; Kimi's with a decay
        per key channel) as its recurrence, one position at a time, in float64 (`gated_delta_rule`). The chunked form
        transformers runs is the same recurrence regrouped, so the two agree in exact arithmetic;
    their gated RMSNorms (`*RMSNormGated`): weight * x / sqrt(mean(x^2) + eps) * act(gate), act the module's
        `activation` (silu; Kimi's sigmoid).
Without these a float64 model's reference computes its delta rule in float32, in the chunking of a whole sequence,
and a float32 run judged against it (`check.rounding`) looks worse than it is wherever it chunks otherwise.
"""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN

GATED_DELTA_FILES = tuple(f"transformers.models.{m}.modeling_{m}"
                          for m in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear"))
"""Model files whose delta rules (`DELTA_RULE_NAMES`) take (query, key, value, g, beta, [chunk_size,]
initial_state, output_final_state, use_qk_l2norm_in_kernel) and compute in float32."""
DELTA_RULE_NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "chunk_kimi_delta_attention",
                    "recurrent_kimi_delta_attention")
GATED_NORMS = ("Qwen3NextRMSNormGated", "Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated", "OlmoHybridRMSNormGated",
               "KimiLinearRMSNormGated")
"""Gated RMSNorm classes (norm before the gate; attribute `variance_epsilon`) whose forward(x, gate) computes in
float32."""


def gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule in float64, position by position.

    query, key: [B, T, H_k, d_k]; value: [B, T, H_v, d_v] (H_v a multiple of H_k: each query / key head serves
    H_v / H_k consecutive value heads); g (log decay): [B, T, H_v], or [B, T, H_v, d_k] for a decay per key channel
    (Kimi); beta (write strength): [B, T, H_v]; initial_state: [B, H_v, d_k, d_v] or None (zeros). With q and k
    L2-normalised when asked (eps 1e-6) and q scaled by d_k^-0.5:

        S_t = diag(exp(g_t)) S_{t-1};   S_t += k_t (beta_t (v_t - S_t^T k_t))^T;   o_t = S_t^T q_t

    Returns (o [B, T, H_v, d_v] in value's dtype, S_T in float64 when `output_final_state`, else None)."""
    dtype = value.dtype
    q, k, v, g, beta = (x.double() for x in (query, key, value, g, beta))
    repeat = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q / q.shape[-1] ** 0.5
    B, T, H, dk = k.shape
    state = (torch.zeros(B, H, dk, v.shape[-1], dtype=torch.float64, device=v.device) if initial_state is None
             else initial_state.double())
    out = []
    for t in range(T):
        decay = g[:, t].exp()
        state = state * (decay[..., None] if g.dim() == 4 else decay[..., None, None])
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, dim=1).to(dtype), state if output_final_state else None


def _delta_rule_float64(original):
    """`original` (a model file's chunked or recurrent gated delta rule: a function, or transformers' hub-kernel
    module wrapping one) computing `gated_delta_rule` for float64 queries without packed sequences (cu_seqlens);
    anything else goes to `original` as it came."""

    def delta_rule(query, key, value, *args, **kwargs):
        if query.dtype != torch.float64 or args or kwargs.get("cu_seqlens") is not None:
            return original(query, key, value, *args, **kwargs)
        names = ("g", "beta", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel")
        return gated_delta_rule(query, key, value, **{n: kwargs[n] for n in names if n in kwargs})

    delta_rule.branchreplay_float64 = True
    return delta_rule


DELTA_RULES = tuple((name, _delta_rule_float64) for name in DELTA_RULE_NAMES)
"""(module function name, its float64 wrapper's maker) for the `GATED_DELTA_FILES` (the names a file has)."""


def gated_rms_norm(module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`*RMSNormGated.forward(x, gate)` in float64: weight * x / sqrt(mean(x^2) + eps) * act(gate)."""
    act = ACT2FN[getattr(module, "activation", "silu")]
    return module.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)) * act(gate)
