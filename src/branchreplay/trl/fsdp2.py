"""accelerate's FSDP2 (`fsdp_version: 2`: `fully_shard` on the decoder layers and on the whole model) around the tree.

Ranks run different trees, hence different numbers of pack forwards and backwards, so no collective may depend on a
pack: every unit is gathered once for the micro-batch (`fsdp2_unsharded`), its gradient sync off while the tree's
backward passes accumulate full local gradients, and at the accumulation window's end `fsdp2_reduce` runs one
zero-loss token through the root so that FSDP2's own post-backward hooks (armed only by a forward through each unit)
reduce-scatter the accumulated gradients into the shards. During the step a rank holds the whole model's parameters
and gradients (ZeRO-2's memory), between steps its shards, whatever `reshard_after_forward` says; that setting
holds for every forward outside the tree (TRL's generation and logprob passes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def fsdp2_gathered(model: torch.nn.Module, reshard_after_forward: bool, sync: bool,
                   device: torch.device) -> Iterator[None]:
    """accelerate's FSDP2 model (`fully_shard` on its decoder layers and on the whole model) with its parameters
    gathered while inside (`fsdp2_unsharded`) and its gradient sync off: the tree's backward passes accumulate full
    local gradients. On exit with `sync`, `fsdp2_reduce` hands them to FSDP2's own reduce-scatter. So during the
    step a rank holds the whole model's parameters and gradients (ZeRO-2's memory), and between steps its shards."""
    with fsdp2_unsharded(model, reshard_after_forward) as units:
        for unit in units:
            unit.set_reshard_after_backward(False, recurse=False)
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
            if sync:
                fsdp2_reduce(model, units, device)
        finally:
            for unit in units:
                unit.set_reshard_after_backward(True, recurse=False)
                unit.set_requires_gradient_sync(True, recurse=False)


@contextlib.contextmanager
def fsdp2_unsharded(model: torch.nn.Module, reshard_after_forward: bool) -> Iterator[list]:
    """Every FSDP2 unit of `model` (yielded) with its full parameters while inside: one all-gather per unit, on
    every rank alike, however many packs each rank then runs; on exit each unit reshards and gets back
    `reshard_after_forward` (accelerate's setting)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield units
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard_after_forward, recurse=False)


def fsdp2_reduce(model: torch.nn.Module, units: list, device: torch.device) -> None:
    """The FSDP2 `units`' gradient sync on, then one zero-loss forward and backward of one token through `model`
    (the root): every unit reduce-scatters its accumulated gradient into its shards."""
    for unit in units:
        unit.set_requires_gradient_sync(True, recurse=False)
    logits = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device)).logits
    (logits.sum() * 0.0).backward()
