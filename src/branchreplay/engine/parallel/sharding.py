"""Tree-aware sharding of a step's work over data-parallel ranks, in one of three layouts chosen by a cost model:

    whole trees       every tree (prompt group) on one rank, balanced greedily by predicted cost
    split branches    as many trees as ranks: the costliest trees split into parts of consecutive rollouts in
                      depth-first order, each part recomputing the prefix it shares with the others
    context-parallel  the costliest eligible trees' shared prefix runs ONCE across all ranks (`context_parallel.py`),
                      their branches split over the ranks below it, the other trees whole

A tree's cost: the forward FLOPs of its unique positions, 2 * N_params per position plus 4 * n_layers * d_attn per
attention key (`reference.work`); greedy longest-processing-time assignment is within 4/3 of the optimal makespan
(Graham 1969). The layout with the smallest predicted step on the `CostModel` wins (on a tie, fewer bytes). Every
layout gives the same gradient once the ranks' gradients are summed (loss weights are computed over the whole step).
Design notes and measurements: docs/distributed.md, docs/notes/execution-stack.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...models import head_dim, kv_heads
from ...tree import Node, RolloutTree
from .context_parallel import ContextParallelTree, zigzag_rounds

LAYOUTS = ("auto", "whole-or-split", "context-parallel")


@dataclass(frozen=True)
class CostModel:
    """Seconds of a rank's step: forward FLOPs / flops_per_s + collective bytes / bytes_per_s + calls x latency_s.

    flops_per_s: forward FLOPs (`tree_cost`) per second of one rank's forward and backward together; the default,
        24e9, is fitted to the headline step (P=32,000, G=64, R=768, bench tiny Llama) on one CPU thread per rank.
    bytes_per_s: bytes per second one rank sends or receives in an all-gather; default 0.22e9, gloo on loopback.
    latency_s: seconds of one small collective call; default 5.5e-4, gloo on loopback (256 floats).
    On a GPU with NVLink all three are orders of magnitude larger or smaller: pass the GPU's own. The fits:
    docs/notes/execution-stack.md."""

    flops_per_s: float = 24e9
    bytes_per_s: float = 0.22e9
    latency_s: float = 5.5e-4


@dataclass
class ShardPlan:
    """Which trees each rank runs. parts: per rank, its RolloutTrees (whole trees or parts of a split one) and then
    its `ContextParallelTree`s (in the same order on every rank). costs: per rank, the predicted cost (FLOPs of one
    forward). physical_tokens: per rank, positions it computes. recomputed_positions: positions run more than once
    because a tree was split (a shared prefix, once per extra part). sources: per rank, the index in the step's
    trees of each part's tree. layout: "whole trees", "split branches" or "context-parallel". context_parallel: the
    indices of the trees whose prefix runs across the ranks. bytes_moved: per rank, bytes it sends (and receives)
    in the context-parallel collectives, forward and backward. predicted_seconds: per rank, on the plan's
    `CostModel`. why: the reason a context-parallel layout was not taken, or "" (for people)."""

    parts: list[list]
    costs: list[float]
    physical_tokens: list[int]
    recomputed_positions: int = 0
    sources: list[list[int]] = field(default_factory=list)
    layout: str = "whole trees"
    context_parallel: list[int] = field(default_factory=list)
    bytes_moved: list[float] = field(default_factory=list)
    predicted_seconds: list[float] = field(default_factory=list)
    why: str = ""

    @property
    def imbalance(self) -> float:
        mean = sum(self.costs) / max(len(self.costs), 1)
        return max(self.costs) / mean if mean > 0 else 1.0

    @property
    def predicted_step_seconds(self) -> float:
        return max(self.predicted_seconds, default=0.0)


def tree_cost(tree: RolloutTree, config) -> float:
    """Predicted forward FLOPs of `tree` on a model of `config`: 2 * N * positions + 4 * n_layers * d_attn * keys."""
    return _flops(*_positions_and_keys(tree.root), config)


def shard(trees: list[RolloutTree], world_size: int, config, allow_empty: bool = False, layout: str = "auto",
          cost: CostModel = CostModel(), element_bytes: int = 4) -> ShardPlan:
    """Assign `trees` to `world_size` ranks (module docstring); every rank computes the same plan.

    layout: "auto" (the cost model's choice), or one forced: "whole-or-split" (whole trees, split only when there
        are fewer trees than ranks) or "context-parallel" (every eligible tree's prefix across the ranks; the
        others whole; ValueError when no tree is eligible).
    element_bytes: bytes of one K/V element (4 for float32), for the bytes moved.
    With fewer rollouts than ranks and no context-parallel tree, some ranks get no tree when `allow_empty` (the
    trainer then runs an idle tree there, to join the reduction), else ValueError (some rank would have nothing to
    run: lower the world size or raise prompts_per_step). Raises ValueError for an unknown layout, or trees with
    images (`vision.py`: they run on one process)."""
    if any(getattr(t, "images", None) is not None for t in trees):
        raise ValueError("trees with images (vision-language prompts) run on one process, not sharded")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    costs = [tree_cost(t, config) for t in trees]
    eligible, why = _eligible(trees, world_size, config)
    if layout == "context-parallel":
        if not eligible:
            raise ValueError(f"no tree can run context-parallel: {why}")
        return _context_parallel(trees, costs, eligible, world_size, config, cost, element_bytes)
    rollouts = sum(len(t.rollouts) for t in trees)
    candidates = []
    if layout == "auto" and eligible:
        share = sum(costs) / world_size
        large = [i for i in eligible if costs[i] > share] if len(trees) >= world_size else eligible
        by_cost = sorted(large, key=lambda i: -costs[i])
        candidates = [_context_parallel(trees, costs, by_cost[:k], world_size, config, cost, element_bytes)
                      for k in range(1, len(by_cost) + 1)]
    if rollouts < world_size and not allow_empty and not candidates:
        raise ValueError(f"the step has {rollouts} rollouts for {world_size} ranks: every rank needs at least one; "
                         "raise grpo.prompts_per_step or grpo.num_generations, or start fewer processes")
    plain = _whole_or_split(trees, costs, world_size, config, cost) if rollouts >= world_size or allow_empty \
        else None
    if plain is not None and not candidates:
        plain.why = "layout forced" if layout != "auto" else why or "no tree is larger than a rank's share"
    best = min([p for p in [plain, *candidates] if p is not None],
               key=lambda p: (round(p.predicted_step_seconds, 9), sum(p.bytes_moved)))
    if best is plain and candidates:
        plain.why = "the cost model predicts it faster than a context-parallel prefix"
    return best


def _whole_or_split(trees, costs, world_size: int, config, cost: CostModel) -> ShardPlan:
    """Whole trees, the costliest split in halves while there are fewer parts than ranks (and rollouts)."""
    rollouts = sum(len(t.rollouts) for t in trees)
    items = list(zip(costs, trees, range(len(trees)), strict=True))
    recomputed = 0
    while len(items) < min(world_size, rollouts):  # split the most costly tree that has more than one rollout
        k = max((j for j, (_, t, _) in enumerate(items) if len(t.rollouts) > 1), key=lambda j: items[j][0])
        _, tree, source = items.pop(k)
        halves = _split(tree)
        recomputed += sum(h.stats.physical_tokens for h in halves) - tree.stats.physical_tokens
        items += [(tree_cost(h, config), h, source) for h in halves]
    parts, loads, sources = [[] for _ in range(world_size)], [0.0] * world_size, [[] for _ in range(world_size)]
    _assign(items, parts, loads, sources)
    physical = [sum(t.stats.physical_tokens for t in p) for p in parts]
    return ShardPlan(parts, loads, physical, recomputed, sources, "split branches" if recomputed else "whole trees",
                     [], [0.0] * world_size, [c / cost.flops_per_s for c in loads])


def _context_parallel(trees, costs, chosen: list[int], world_size: int, config, cost: CostModel,
                      element_bytes: int) -> ShardPlan:
    """The trees `chosen` with their prefix across the ranks and their branches split below it, the rest whole."""
    loads, physical = [0.0] * world_size, [0] * world_size
    bytes_moved, calls = [0.0] * world_size, 0
    cp_parts: list[list] = [[] for _ in range(world_size)]
    recomputed = 0
    kv_bytes = 2 * config.num_hidden_layers * _kv_heads(config) * head_dim(config) * element_bytes  # per position
    for i in sorted(chosen):
        tree = trees[i]
        P = shared_prefix_length(tree)
        rounds = zigzag_rounds(P, world_size)
        groups = _branch_groups(tree, P, world_size, config)
        below = _positions_below(tree.root, P)
        for rank in range(world_size):
            positions, keys = _pieces(rounds, rank)
            part = RolloutTree([tree.rollouts[j] for j in groups[rank]]) if groups[rank] else None
            extra_positions, extra_keys = _positions_below(part.root, P) if part else (0, 0)
            recomputed += extra_positions
            loads[rank] += _flops(positions + extra_positions, keys + extra_keys, config)
            physical[rank] += positions + extra_positions
            cp_parts[rank].append(ContextParallelTree(tree.rollouts[0].token_ids[:P], part, rounds, rank))
            bytes_moved[rank] += _bytes_moved(rounds, world_size, kv_bytes)
        recomputed -= below[0]
        calls += _calls(rounds, config)
    rest = [(costs[i], trees[i], i) for i in range(len(trees)) if i not in chosen]
    parts, sources = [[] for _ in range(world_size)], [[] for _ in range(world_size)]
    _assign(rest, parts, loads, sources)
    for rank in range(world_size):
        physical[rank] += sum(t.stats.physical_tokens for t in parts[rank])
        parts[rank] += cp_parts[rank]  # after the whole trees, in the same order on every rank (replay._replay)
        sources[rank] += sorted(chosen)
    seconds = [loads[r] / cost.flops_per_s + bytes_moved[r] / cost.bytes_per_s + calls * cost.latency_s
               for r in range(world_size)]
    return ShardPlan(parts, loads, physical, recomputed, sources, "context-parallel", sorted(chosen), bytes_moved,
                     seconds)


def prefix_seconds(P: int, world_size: int, config, cost: CostModel = CostModel(), element_bytes: int = 4,
                   own: int | None = None) -> tuple[float, float]:
    """(recomputed, context-parallel): predicted seconds, on `cost`, of the forward and backward of an untrained
    prefix of P positions (P >= world_size) on a rank that computes its last `own` positions itself (default all P;
    fewer where the rank's other trees already compute its start, as a prefix forest does), and on the slowest of
    `world_size` ranks that run all P once across them (its pieces' FLOPs, the K/V bytes it moves, the collective
    calls)."""
    rounds = zigzag_rounds(P, world_size)
    kv_bytes = 2 * config.num_hidden_layers * _kv_heads(config) * head_dim(config) * element_bytes
    own = P if own is None else own
    whole = _flops(own, own * (P - own) + own * (own + 1) // 2, config) / cost.flops_per_s
    pieces = max(_flops(*_pieces(rounds, rank), config) for rank in range(world_size)) / cost.flops_per_s
    return whole, (pieces + _bytes_moved(rounds, world_size, kv_bytes) / cost.bytes_per_s
                   + _calls(rounds, config) * cost.latency_s)


def _pieces(rounds, rank: int) -> tuple[int, int]:
    """(positions, attention keys) of `rank`'s pieces of a context-parallel prefix."""
    mine = [(a, b) for pieces in rounds for a, b, owner in pieces if owner == rank]
    return sum(b - a for a, b in mine), sum((b - a) * a + (b - a) * (b - a + 1) // 2 for a, b in mine)


def _bytes_moved(rounds, world_size: int, kv_bytes: int) -> float:
    """Bytes a rank sends (and receives) for a context-parallel prefix: the forward's all-gather of each round's
    K/V and the backward's all-to-all of their gradients; `kv_bytes` per position, every layer."""
    return 2 * sum((world_size - 1) * max(b - a for a, b, _ in pieces) * kv_bytes for pieces in rounds)


def _calls(rounds, config) -> int:
    """Collective calls of a context-parallel prefix, forward and backward: one per round and layer, and the last
    hidden state's."""
    return 2 * (len(rounds) * config.num_hidden_layers + 1)


def _assign(items, parts, loads, sources) -> None:
    """Longest processing time first: each (cost, tree, source) to the least-loaded rank, largest first."""
    for c, tree, source in sorted(items, key=lambda x: -x[0]):
        rank = min(range(len(parts)), key=lambda r: (loads[r], r))
        parts[rank].append(tree)
        sources[rank].append(source)
        loads[rank] += c


def shared_prefix_length(tree: RolloutTree) -> int:
    """Positions of the prefix that every rollout of `tree` shares and none trains: the root's one child, cut at
    the first trained position of any rollout (that position is predicted from the prefix's last hidden state,
    which every rank receives). 0 when the root has several children."""
    if len(tree.root.children) != 1:
        return 0
    first = [int(r.loss_mask.nonzero()[0]) if r.loss_mask.any() else len(r) for r in tree.rollouts]
    return min(len(tree.root.children[0]), *first)


def supports_context_parallel(config) -> str:
    """"" when a model of `config` can run a context-parallel prefix, else the reason (for the plan's `why`): every
    layer full attention (no recurrent, hybrid or sliding-window layer) and a rotary encoding whose frequencies do
    not follow the sequence's length (longrope, dynamic NTK)."""
    from ..families import layer_windows
    from ..recurrent import layer_kinds

    if any(kind != "attention" for kind in layer_kinds(config)):
        return f"{config.model_type} has recurrent layers (their state would pass from piece to piece in rank order)"
    if any(w is not None for w in layer_windows(config)):
        return f"{config.model_type} has sliding-window layers"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    types = [rope.get("rope_type", rope.get("type", ""))] if isinstance(rope, dict) else []
    if any(t == "longrope" or "dynamic" in (t or "") for t in types):
        return f"{config.model_type}'s rotary encoding depends on the sequence length ({types[0]})"
    return ""


def _eligible(trees, world_size: int, config) -> tuple[list[int], str]:
    """The trees whose prefix can run context-parallel on `world_size` ranks, and why none can (or "")."""
    if world_size < 2:
        return [], "one rank"
    reason = supports_context_parallel(config)
    if reason:
        return [], reason
    eligible = [i for i, t in enumerate(trees) if shared_prefix_length(t) >= world_size]
    return eligible, "" if eligible else f"no tree shares an untrained prefix of at least {world_size} positions"


def _branch_groups(tree: RolloutTree, P: int, world_size: int, config) -> list[list[int]]:
    """The tree's rollouts in depth-first order, cut into `world_size` consecutive groups of about equal cost below
    the prefix (each node's cost counted on its first rollout), so rollouts that share a response prefix stay
    together where the cut allows."""
    order = _depth_first_rollouts(tree.root)
    marginal = {i: 0.0 for i in order}
    rank_in_order = {i: k for k, i in enumerate(order)}
    stack = list(tree.root.children)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        a = max(node.start, P)
        if node.end > a:
            L = node.end - a
            marginal[min(node.rollouts, key=rank_in_order.get)] += _flops(L, L * a + L * (L + 1) // 2, config)
    total = sum(marginal.values()) or 1.0
    groups, done = [[] for _ in range(world_size)], 0.0
    for i in order:  # a rollout goes to the group its cost's midpoint falls in
        g = min(int((done + marginal[i] / 2) / total * world_size), world_size - 1)
        groups[g].append(i)
        done += marginal[i]
    return groups


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
    return _positions_below(root, 0)


def _positions_below(root: Node, P: int) -> tuple[int, int]:
    """(positions, attention keys) of the tree under `root` from position P on."""
    positions = keys = 0
    stack = list(root.children)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        a = max(node.start, P)
        L = node.end - a
        if L > 0:
            positions += L
            keys += L * a + L * (L + 1) // 2
    return positions, keys


def _flops(positions: int, keys: int, config) -> float:
    d_attn = config.num_attention_heads * head_dim(config) if getattr(config, "num_attention_heads", None) else 0
    return 2.0 * _non_embedding_params(config) * positions + 4.0 * config.num_hidden_layers * d_attn * keys


def _kv_heads(config) -> int:
    return kv_heads(config) if getattr(config, "num_attention_heads", None) else 1


def _non_embedding_params(config) -> int:
    """Parameters per layer times layers, from the config: 4 * hidden^2 (attention) + 3 * hidden * intermediate
    (gated MLP), a Llama-style estimate; only ratios between trees matter here."""
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    return config.num_hidden_layers * (4 * hidden * hidden + 3 * hidden * intermediate)
