"""float64 formulas for the Gemma 4 and Llama 4 text modules that compute in float32 in a float64 model, for
`float64.keep_float64` (checked against transformers 5.25's modeling_gemma4.py and modeling_llama4.py):
    Gemma4RMSNorm: x * (mean(x^2) + eps)^-0.5, times `weight` where it has one (`with_scale`);
    Llama4TextWeightlessRMSNorm (Llama 4's query / key norm): x / sqrt(mean(x^2) + eps), no weight;
    Gemma4TextRouter: its softmax, top-k, renormalisation and per-expert scale;
    Llama4Router: its sigmoid of the top-k logits;
    Llama 4's `apply_rotary_emb` (a module function: every Llama 4 model of the process while active, float64 inputs
        only): the complex rotation in complex128 instead of complex64.
Each takes (module, x) and returns what the module's forward returns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gemma4_rms_norm(module, x: torch.Tensor) -> torch.Tensor:
    normed = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon, -0.5)
    return normed * module.weight if module.with_scale else normed


def _weightless_rms_norm(module, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)


def _gemma4_router(module, hidden_states: torch.Tensor):
    """(router probabilities [N, E], top-k weights [N, k], top-k indices [N, k]) of `Gemma4TextRouter.forward`."""
    hidden = module.norm(hidden_states) * module.scale * module.scalar_root_size
    probabilities = torch.softmax(module.proj(hidden), dim=-1)
    weights, index = torch.topk(probabilities, k=module.config.top_k_experts, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return probabilities, weights * module.per_expert_scale[index], index


def _llama4_router(module, hidden_states: torch.Tensor):
    """(router scores [N, E]: sigmoid of the top-k logits, 0 elsewhere; router logits [N, E]) of `Llama4Router`."""
    logits = F.linear(hidden_states, module.weight, module.bias)
    top_value, top_index = torch.topk(logits, module.top_k, dim=1)
    scores = torch.full_like(logits, float("-inf")).scatter_(1, top_index, top_value)
    return torch.sigmoid(scores), logits


FORMULAS = {
    "Gemma4RMSNorm": _gemma4_rms_norm,
    "Llama4TextWeightlessRMSNorm": _weightless_rms_norm,
    "Gemma4TextRouter": _gemma4_router,
    "Llama4Router": _llama4_router,
}
"""Module class name -> its float64 formula (the module docstring)."""


def _llama4_rotary(original):
    """`original` (Llama 4's `apply_rotary_emb(xq, xk, freqs_cis)`) rotating float64 inputs in complex128."""

    def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
        if xq.dtype != torch.float64:
            return original(xq, xk, freqs_cis)
        freqs = freqs_cis.to(torch.complex128)[:, :, None, :]
        q = torch.view_as_complex(xq.contiguous().reshape(*xq.shape[:-1], -1, 2))
        k = torch.view_as_complex(xk.contiguous().reshape(*xk.shape[:-1], -1, 2))
        return torch.view_as_real(q * freqs).flatten(3), torch.view_as_real(k * freqs).flatten(3)

    apply_rotary_emb.branchreplay_float64 = True
    return apply_rotary_emb


MODULE_FUNCTIONS = {"transformers.models.llama4.modeling_llama4": ("apply_rotary_emb", _llama4_rotary)}
"""Model file -> (the name of a module function that computes in float32, its float64 wrapper's maker)."""
