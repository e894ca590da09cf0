"""Numerics shared by the reference and the engine in exactness checks.

Hugging Face's RMSNorm (Llama, Qwen2, Qwen3, Mistral, ...) casts its input to float32 even in a float64 model:
`hidden_states.to(torch.float32)`. Both the naive reference and the execution stack then round to float32 there,
but at slightly different inputs (the sum of the same terms in another order), which turns 1e-16 differences into
1e-7 ones. `keep_float64` makes those norms compute in float64, on both sides alike, so that a float64 check
measures the engine and not that cast. The formula is unchanged: weight * x / sqrt(mean(x^2) + eps).
"""

from __future__ import annotations

import types

import torch


def _rms_norm_float64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != torch.float64:
        return self._branchreplay_forward(hidden_states)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def keep_float64(model) -> int:
    """Make the model's Llama-style RMSNorm modules (class name ending in "RMSNorm", attribute `variance_epsilon`,
    output `weight * normed`) compute in float64 when their input is float64. Returns how many were patched.

    Modules with another formula (e.g. Gemma's `(1 + weight)`) are left as they are."""
    patched = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and not name.startswith("Gemma"):
            if not hasattr(module, "_branchreplay_forward"):
                module._branchreplay_forward = module.forward
                module.forward = types.MethodType(_rms_norm_float64, module)
            patched += 1
    return patched
