"""A step's trained trees over the data-parallel ranks: which parts this rank runs, and every rollout's values on
every rank.

In one process a rank's part is the whole step: `local` is the trees themselves. Under torchrun the trees go to the
ranks by predicted cost (`engine.parallel.sharding.shard`: whole trees, split branches or a context-parallel prefix),
each rank runs the passes of its parts only, and `everywhere` gathers what the passes computed per rollout (logprobs,
entropies, values: small, per token) so that every rank holds them for every rollout of the step. The estimators
(RLOO's leave-one-out baseline, REINFORCE++'s and PPO's whitening over the step, the entropy quantile) and the
losses of whole sequences (RLOO, GSPO, DPO) then compute on every rank what one process computes, whatever the
layout; each rank trains its own parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..engine.parallel.sharding import ShardPlan, shard
from ..tree import Rollout, RolloutTree

if TYPE_CHECKING:
    from .run.parallel import Ranks


@dataclass
class Shards:
    """The trained trees of a step and this rank's part of them.

    trees: every trained tree of the step, in the step's order (the same on every rank).
    local: this rank's parts (`RolloutTree`s, whole or split, then its `ContextParallelTree` parts).
    sources: for each of `local`, the index in `trees` of the tree it is part of.
    plan: the `ShardPlan` (None in one process).
    ranks: the run's `rl.run.parallel.Ranks` (None in one process).
    model_config, layout: what the plan was made for (the model's config, parallel.layout).
    """

    trees: list[RolloutTree]
    local: list
    sources: list[int]
    plan: ShardPlan | None = None
    ranks: Ranks | None = None
    model_config: object | None = None
    layout: str = "auto"

    @classmethod
    def of(cls, trees: list[RolloutTree], ranks: Ranks | None, model_config, layout: str = "auto") -> Shards:
        """The step's `trees` over `ranks` (None: one process, every tree local); `layout` as
        `engine.parallel.sharding.shard`. Every rank must call it with the same trees."""
        if ranks is None or not trees:
            return cls(list(trees), list(trees), list(range(len(trees))), None, ranks, model_config, layout)
        plan = shard(list(trees), ranks.world_size, model_config, allow_empty=True, layout=layout)
        return cls(list(trees), plan.parts[ranks.rank], plan.sources[ranks.rank], plan, ranks, model_config, layout)

    def of_trees(self, trees: list[RolloutTree]) -> Shards:
        """Other trees over the same ranks, for the same model and layout."""
        return Shards.of(trees, self.ranks, self.model_config, self.layout)

    @property
    def rollouts(self) -> list[Rollout]:
        """Every rollout of `trees`, in order (the same on every rank)."""
        return [r for t in self.trees for r in t.rollouts]

    @property
    def local_rollouts(self) -> list[Rollout]:
        """The rollouts of this rank's parts, in the order of `local`."""
        return [r for part in self.local for r in part.rollouts]

    def keep(self, trains) -> Shards:
        """The trees for which `trains(tree)` holds, and this rank's parts of them (the same choice on every rank,
        so that context-parallel parts stay in step)."""
        kept = [i for i, t in enumerate(self.trees) if trains(t)]
        index = {old: new for new, old in enumerate(kept)}
        mine = [(part, index[s]) for part, s in zip(self.local, self.sources, strict=True) if s in index]
        return Shards([self.trees[i] for i in kept], [p for p, _ in mine], [s for _, s in mine], self.plan, self.ranks,
                      self.model_config, self.layout)

    def everywhere(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per rollout of `local_rollouts` (this rank's values, e.g. a pass's logprobs [T]) -> per rollout of
        `rollouts` (every rank's, gathered): the same list on every rank. A collective under torchrun. `values` None
        (a pass over no tree may give no values) counts as none."""
        values = [] if values is None else values
        if self.ranks is None:
            return list(values)
        position = {id(r): k for k, r in enumerate(self.rollouts)}
        mine = [(position[id(r)], v.detach().cpu()) for r, v in zip(self.local_rollouts, values, strict=True)]
        out: list[torch.Tensor | None] = [None] * len(position)
        for part in self.ranks.gather(mine):
            for k, v in part:
                out[k] = v
        missing = [k for k, v in enumerate(out) if v is None]
        if missing:
            raise RuntimeError(f"rollouts {missing} of the step are on no rank's part: the shard plan lost them")
        return out

    def mine(self, values: list) -> list:
        """Per rollout of `rollouts` -> per rollout of `local_rollouts` (this rank's share of a step-wide list)."""
        position = {id(r): k for k, r in enumerate(self.rollouts)}
        return [values[position[id(r)]] for r in self.local_rollouts]
