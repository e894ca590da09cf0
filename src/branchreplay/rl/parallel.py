"""The training side of data parallelism: who runs which prompts, and what the ranks agree on.

A step under torchrun: every rank computes the step's prompt indices (the same on all ranks); rank r samples and
scores the groups k with k % world_size == r, each group with its own generator seeded by (train.seed, step, k), so
a group's samples do not depend on the world size; the groups are gathered, so every rank holds the whole batch and
computes the same advantages and loss weights (normalised over the whole step); the trees then go to ranks by
predicted cost (`engine.sharding`) and the gradient is reduced once (`engine.distributed`). Losses, loss statistics
and stop requests are reduced across ranks; rank 0 alone writes the run folder.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import yaml

from ..engine.distributed import init


@dataclass(frozen=True)
class Ranks:
    """This process's place among the data-parallel ranks (torch.distributed's default group)."""

    rank: int
    world_size: int

    def mine(self, n: int) -> list[int]:
        """The indices of `n` groups that this rank samples and scores: k with k % world_size == rank."""
        return list(range(self.rank, n, self.world_size))

    def gather(self, obj) -> list:
        """`obj` of every rank, in rank order (all_gather_object: small picklable values only)."""
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """Whether any rank's flag is set (e.g. a stop request), so that all ranks stop at the same step."""
        return self.sum([float(flag)])[0] > 0


def launch(strategy: str, config: dict, timeout_s: float = 600.0) -> Ranks | None:
    """Start data parallelism for `strategy` (`ParallelConfig.strategy`): None for one process ("auto" without
    torchrun, or with a world size of 1), else the initialised `Ranks`, after checking that every rank was started
    with the same configuration (`config`, the run config as a dict, hashed); collectives time out after
    `timeout_s` seconds (a rank that died stops the others with torch.distributed's error).

    Raises ValueError: "fsdp2" / "ddp" without torchrun's environment, or ranks with different configurations."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if strategy == "auto" and world == 1:
        return None
    if "RANK" not in os.environ:
        raise ValueError(f"parallel.strategy={strategy!r} needs torchrun: launch with `torchrun --nproc_per_node N "
                         "-m branchreplay train ...`, or leave parallel.strategy at 'auto' for one process")
    rank, world = init(timeout_s=timeout_s)
    ranks = Ranks(rank, world)
    digest = hashlib.sha256(yaml.safe_dump(config, sort_keys=True).encode()).hexdigest()
    digests = ranks.gather(digest)
    different = [r for r, d in enumerate(digests) if d != digests[0]]
    if different:
        raise ValueError(f"ranks {different} were started with a configuration different from rank 0's: start every "
                         "rank with the same --config and overrides")
    return ranks
