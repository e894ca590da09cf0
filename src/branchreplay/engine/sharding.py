"""Tree-aware sharding of a step's work over data-parallel ranks: whole trees (prompt groups) to ranks by predicted
cost, balanced greedily, and a tree split by its branches only when there are fewer trees than ranks.

Cost of a tree: the forward FLOPs of its unique positions, 2 * N_params per position plus 4 * n_layers * d_attn per
attention key (each computed position attends to its start + t + 1 keys), the planner's two terms (positions and
keys) weighted as `bench.flops` weighs them. Greedy longest-processing-time assignment (largest first, to the
least-loaded rank) is within 4/3 of the optimal makespan (Graham 1969).

A tree too large for one rank's share (the headline: ONE prompt of 32k tokens with 64 rollouts on 8 ranks) is split
into parts of consecutive rollouts in the tree's depth-first order, so that rollouts sharing a deep prefix stay
together; every part recomputes the prefix it shares with the others (`ShardPlan.recomputed_positions`). The loss is a
sum over (rollout, position) pairs with weights computed over the whole step, so every split gives the same
gradient once the ranks' gradients are summed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..models import head_dim
from ..tree import Node, RolloutTree


@dataclass
class ShardPlan:
    """Which trees each rank runs. parts: per rank, its RolloutTrees (whole trees or parts of a split one).
    costs: per rank, the predicted cost (FLOPs of one forward). physical_tokens: per rank, unique positions run.
    recomputed_positions: positions run more than once because a tree was split (its shared prefix, once per extra
    part). sources: per rank, the index in the step's trees of each part's tree. imbalance: max over mean
    predicted cost (1.0 = perfect)."""

    parts: list[list[RolloutTree]]
    costs: list[float]
    physical_tokens: list[int]
    recomputed_positions: int = 0
    sources: list[list[int]] = field(default_factory=list)

    @property
    def imbalance(self) -> float:
        mean = sum(self.costs) / max(len(self.costs), 1)
        return max(self.costs) / mean if mean > 0 else 1.0


def tree_cost(tree: RolloutTree, config) -> float:
    """Predicted forward FLOPs of `tree` on a model of `config`: 2 * N * positions + 4 * n_layers * d_attn * keys."""
    positions, keys = _positions_and_keys(tree.root)
    n_params = _non_embedding_params(config)
    d_attn = config.num_attention_heads * head_dim(config) if getattr(config, "num_attention_heads", None) else 0
    return 2.0 * n_params * positions + 4.0 * config.num_hidden_layers * d_attn * keys


def shard(trees: list[RolloutTree], world_size: int, config, allow_empty: bool = False) -> ShardPlan:
    """Assign `trees` to `world_size` ranks (module docstring). With fewer rollouts than ranks, some ranks get no
    tree when `allow_empty` (the trainer then runs an idle tree there, to join the reduction), else ValueError
    (some rank would have nothing to run: lower the world size or raise prompts_per_step)."""
    rollouts = sum(len(t.rollouts) for t in trees)
    if rollouts < world_size and not allow_empty:
        raise ValueError(f"the step has {rollouts} rollouts for {world_size} ranks: every rank needs at least one; "
                         "raise grpo.prompts_per_step or grpo.num_generations, or start fewer processes")
    items = [(tree_cost(t, config), t, i) for i, t in enumerate(trees)]
    recomputed = 0
    while len(items) < min(world_size, rollouts):  # split the most costly tree that has more than one rollout
        k = max((j for j, (_, t, _) in enumerate(items) if len(t.rollouts) > 1), key=lambda j: items[j][0])
        _, tree, source = items.pop(k)
        halves = _split(tree)
        recomputed += sum(h.stats.physical_tokens for h in halves) - tree.stats.physical_tokens
        items += [(tree_cost(h, config), h, source) for h in halves]
    parts, costs, sources = [[] for _ in range(world_size)], [0.0] * world_size, [[] for _ in range(world_size)]
    for cost, tree, source in sorted(items, key=lambda x: -x[0]):
        rank = min(range(world_size), key=lambda r: (costs[r], r))
        parts[rank].append(tree)
        sources[rank].append(source)
        costs[rank] += cost
    physical = [sum(t.stats.physical_tokens for t in p) for p in parts]
    return ShardPlan(parts, costs, physical, recomputed, sources)


def _split(tree: RolloutTree) -> list[RolloutTree]:
    """Two trees of consecutive rollouts in depth-first order (halves by count)."""
    order = _depth_first_rollouts(tree.root)
    half = len(order) // 2
    return [RolloutTree([tree.rollouts[i] for i in part]) for part in (order[:half], order[half:])]


def _depth_first_rollouts(root: Node) -> list[int]:
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        if not node.children:
            out += [i for i in node.rollouts if i not in out]
        else:
            ending = set(node.rollouts) - {i for c in node.children for i in c.rollouts}
            out += [i for i in sorted(ending) if i not in out]
        stack.extend(reversed(node.children))
    return out


def _positions_and_keys(root: Node) -> tuple[int, int]:
    positions = keys = 0
    stack = list(root.children)
    while stack:
        node = stack.pop()
        L = len(node)
        positions += L
        keys += L * node.start + L * (L + 1) // 2
        stack.extend(node.children)
    return positions, keys


def _non_embedding_params(config) -> int:
    """Parameters per layer times layers, from the config: 4 * hidden^2 (attention) + 3 * hidden * intermediate
    (gated MLP), a Llama-style estimate; only ratios between trees matter here."""
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    return config.num_hidden_layers * (4 * hidden * hidden + 3 * hidden * intermediate)
