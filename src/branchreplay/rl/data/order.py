"""Which items of a split a step takes, and the seeds a step draws from: pure functions of (train.seed, step), so
that step s gets the same prompts and samples whether the run was resumed or not, and on any world size."""

from __future__ import annotations

import torch


def prompt_indices(n: int, per_step: int, seed: int, step: int) -> list[int]:
    """Indices into a split of n items for `step` (>= 1): positions (step-1)*per_step ... of the concatenated
    epochs, epoch e being a permutation seeded by (seed, e). Pure function of its arguments."""
    out = []
    for k in range((step - 1) * per_step, step * per_step):
        epoch, pos = divmod(k, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(mix(seed, -1 - epoch)))
        out.append(int(perm[pos]))
    return out


def mix(seed: int, k: int) -> int:
    """A seed derived from `seed` and `k` (a step, a group), in the range of torch.Generator.manual_seed."""
    return (seed * 1_000_003 + k) % (2**63 - 1)
