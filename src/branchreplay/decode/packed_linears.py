"""The policy's linear layers with MKL-packed weights while the in-process sampler runs (CPU, float32).

MKL's sgemm packs W into its blocked layout at every call; `cblas_sgemm_pack` does it once
(`torch.ops.mkl._mkl_reorder_linear_weight` / `_mkl_linear`, what inductor's CPU weight freezing uses). A packed copy
serves only the number of rows it was packed for, so a block packs for the decoding step's most rows (`rows`), pads a
product of more than half as many with zero rows, and runs nn.Linear for fewer or more (a prefill). A matrix is
packed only where MKL's buffer stays within MAX_PACKED_RATIO of its own elements; `sampling.pack_weights: false`
turns it off. Packing is not a global patch: `packed_linears(model)` sets an instance `forward` on each packed
nn.Linear for the duration of a `with` block and removes it on leaving.

Design notes and measurements: docs/notes/sampler.md.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.head import plain_cpu_linear

MAX_PACKED_RATIO = 4
"""A weight is packed only where MKL's packed buffer is at most this many times its own elements."""


@dataclass
class Block:
    """An open `packed_linears` block on a model: the rows it packs for, and a memo for weights derived from the
    model's for as long as the block lasts (`rows.llama`' layers and their packed matrices: built once for every
    decoding loop of a sampling step, checked against the parameters' versions)."""

    rows: int
    memo: dict = field(default_factory=dict)


_OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its open Block


def block(model: nn.Module) -> Block | None:
    """The `packed_linears` block open on `model` that packs its weights, or None."""
    return _OPEN.get(model)


def available() -> bool:
    """Whether this torch build has MKL's packed sgemm (the x86 CPU builds do)."""
    try:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """MKL's packed copy of a float32 CPU weight [out, in], for products of exactly `rows` rows (`linear`)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)


def linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int
           ) -> torch.Tensor:
    """x [..., in] @ weight.T + bias -> [..., out], from `packed` (`pack(weight, rows)`) when x has more than rows / 2
    and at most `rows` rows (padded with zero rows to `rows`), else F.linear. float32, CPU."""
    n = x.numel() // x.shape[-1]
    if not rows // 2 < n <= rows:
        return F.linear(x, weight, bias)
    flat = x.reshape(n, x.shape[-1])
    if n < rows:
        flat = torch.cat([flat, flat.new_zeros(rows - n, flat.shape[1])])
    out = torch.ops.mkl._mkl_linear(flat, packed, weight, bias, rows)
    return (out[:n] if n < rows else out).reshape(*x.shape[:-1], weight.shape[0])


@functools.lru_cache(maxsize=256)
def _packed_elements(out_features: int, in_features: int, rows: int) -> int:
    """The elements of MKL's packed buffer for a [out, in] float32 weight and `rows` rows (a function of the shape
    only: computed once per shape on a zero matrix, so a weight it rejects is never packed)."""
    return pack(torch.zeros(out_features, in_features), rows).numel()


def _forward(module: nn.Linear, packed: torch.Tensor, rows: int):
    """x @ W.T (+ b) through MKL's packed sgemm (`linear`): x [..., in] float32 -> [..., out] float32, or
    nn.Linear's own."""
    weight, version = module.weight, module.weight._version

    def forward(x: torch.Tensor) -> torch.Tensor:
        w, b = module.weight, module.bias
        if (torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or x.dtype != torch.float32
                or x.device.type != "cpu" or x.numel() == 0 or x.shape[-1] != w.shape[1] or w is not weight
                or w._version != version):
            return F.linear(x, w, b)
        return linear(x, packed, w, b, rows)
    forward.packed_weight, forward.packed_rows = packed, rows
    forward.current = lambda: module.weight is weight and weight._version == version
    return forward


def packed_copy(module: nn.Module, rows: int) -> torch.Tensor | None:
    """The packed copy of `module`'s weight that an open block made for `rows` rows, while the weight is still the
    tensor it packed at the same version (the checks its own forward makes), else None."""
    forward = module.__dict__.get("forward")
    if getattr(forward, "packed_rows", None) != rows or not forward.current():
        return None
    return forward.packed_weight


@contextlib.contextmanager
def packed_linears(model: nn.Module, enabled: bool = True, rows: int = 32):
    """Inside the block, every float32 CPU nn.Linear of `model` (exactly nn.Linear: peft's base layers included, its
    LoRA wrappers not; DTensor weights not, but inside FSDP2's gathered parameters, as the sampler enters it, the
    layers hold plain ones) whose packed weight stays within MAX_PACKED_RATIO of its elements computes x @ W.T from
    it, packed for products of `rows` rows (the decoding step's most: the streams of a step, prompts x G), used for
    more than rows / 2 of them (`linear`). Nothing changes with enabled=False, without MKL or under CPU autocast.
    Nested in another block on the same model it packs nothing (the outer block's packing stands). Results equal
    nn.Linear's up to the floating-point order of the matmul (float32: about 1e-6 relative; MKL's own small-batch
    kernels differ from it by as much). While it lasts, `block(model)` gives its rows and its memo. A packed forward
    runs nn.Linear's own (with the module's current weight and bias) when grad is enabled, under CPU autocast, on
    another dtype or device, with an input of the wrong width, or when the weight was replaced or changed in place
    since it was packed (its version counter moved)."""
    modules, opened = [], False
    try:
        nested = model in _OPEN or any(hasattr(m.__dict__.get("forward"), "packed_weight") for m in model.modules())
        if enabled and rows >= 1 and not nested and available() and not torch.is_autocast_enabled("cpu"):
            for m in model.modules():
                if not plain_cpu_linear(m):
                    continue
                if _packed_elements(*m.weight.shape, rows) <= MAX_PACKED_RATIO * m.weight.numel():
                    m.forward = _forward(m, pack(m.weight, rows), rows)
                    modules.append(m)
            _OPEN[model], opened = Block(rows), True
        yield model
    finally:
        if opened:
            del _OPEN[model]
        for m in modules:
            m.__dict__.pop("forward", None)
