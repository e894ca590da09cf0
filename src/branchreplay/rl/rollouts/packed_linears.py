"""The policy's linear layers with MKL-packed weights while the in-process sampler runs (CPU, float32).

A decoding step multiplies a few dozen rows by every weight matrix. On the CPU, MKL's sgemm then spends much of its
time packing W into its internal blocked layout, again at every call; `cblas_sgemm_pack` does it once
(`torch.ops.mkl._mkl_reorder_linear_weight` / `_mkl_linear`, what inductor's CPU weight freezing uses). On SmolLM2's
shapes at 32 rows (2 threads) the LM head takes 10.6 instead of 15.8 ms and an MLP matrix 0.19-0.22 instead of
0.39-0.50 ms. MKL reserves a buffer of W's size plus about 10 MB of blocking per matrix, so a matrix is packed only
where that stays within MAX_PACKED_RATIO of its own bytes: SmolLM2's LM head (2.1x) and MLP (3.9x), not its
attention projections (8.7x and 21x); on larger models most matrices (1.2-1.8x), not the key / value projections of
grouped-query attention where they are narrow (Qwen2.5-1.5B: 6.7x). Resident memory grows by about the packed
matrices' own bytes while sampling (the demo's peak, set by training, did not move). `sampling.pack_weights: false`
turns it off.

Packing is not a global patch: `packed_linears(model)` sets an instance `forward` on each packed nn.Linear for the
duration of a `with` block and removes it on leaving. A forward runs nn.Linear's own (with the module's current
weight and bias) when grad is enabled, under CPU autocast, on another dtype or device, with an input of the wrong
width, or when the weight was replaced or changed in place since it was packed (its version counter moved).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

MAX_PACKED_RATIO = 4
"""A weight is packed only where MKL's packed buffer is at most this many times its own elements."""


def available() -> bool:
    """Whether this torch build has MKL's packed sgemm (the x86 CPU builds do)."""
    try:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


def _packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module) is nn.Linear and "forward" not in module.__dict__ and type(weight) in (torch.Tensor,
            nn.Parameter) and weight.dtype == torch.float32 and weight.device.type == "cpu")


def _forward(module: nn.Linear, packed: torch.Tensor):
    """x @ W.T (+ b) through MKL's packed sgemm: x [..., in] float32 -> [..., out] float32, or nn.Linear's own."""
    weight, version = module.weight, module.weight._version

    def forward(x: torch.Tensor) -> torch.Tensor:
        w, b = module.weight, module.bias
        if (torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or x.dtype != torch.float32
                or x.device.type != "cpu" or x.numel() == 0 or x.shape[-1] != w.shape[1] or w is not weight
                or w._version != version):
            return F.linear(x, w, b)
        return torch.ops.mkl._mkl_linear(x, packed, w, b, x.numel() // x.shape[-1])
    forward.packed_weight = packed
    return forward


@contextlib.contextmanager
def packed_linears(model: nn.Module, enabled: bool = True):
    """Inside the block, every float32 CPU nn.Linear of `model` (exactly nn.Linear: peft's base layers included, its
    LoRA wrappers not; DTensor weights not, but inside FSDP2's gathered parameters, as the sampler enters it, the
    layers hold plain ones) whose packed weight stays within MAX_PACKED_RATIO of its elements computes x @ W.T from
    it. Nothing changes with enabled=False, without MKL or under CPU autocast. Nested in another block on the same
    model it packs nothing (the outer block's packing stands). Results equal nn.Linear's up to the floating-point
    order of the matmul (float32: about 1e-6 relative; MKL's own small-batch kernels differ from it by as much)."""
    modules = []
    try:
        nested = any(hasattr(m.__dict__.get("forward"), "packed_weight") for m in model.modules())
        if enabled and not nested and available() and not torch.is_autocast_enabled("cpu"):
            for m in model.modules():
                if not _packable(m):
                    continue
                packed = torch.ops.mkl._mkl_reorder_linear_weight(m.weight.detach(), 32)
                if packed.numel() <= MAX_PACKED_RATIO * m.weight.numel():
                    m.forward = _forward(m, packed)
                    modules.append(m)
        yield model
    finally:
        for m in modules:
            m.__dict__.pop("forward", None)
