"""Which shared nodes the execution stack runs once, and which it runs again inside each child: `schedule`.

A node of L tokens at start s shared by c children saves (c - 1) x (L + attention) positions, attention =
(L x s + L (L + 1) / 2) x 2 n_layers d_attn / N_params its attention FLOPs in positions (the FLOP formula of
`reference.work`; N_params: the decoder's matmul parameters). It costs one pack (`EngineConfig.pack_overhead_tokens`,
a pack's fixed cost in positions) plus, for a node at the root, `prefix_overhead` x its children's positions (split
attention's second kernel and merge; charged only where the model runs it, `attention.PrefixSplit`). Every node
whose saving is below its cost is merged into its children, bottom-up: each child gets the node's tokens in front
of its own. When every shared node merges, the engine takes the dense packed schedule (each rollout alone, side by
side in packs). Exact either way: the losses are sums over (rollout, position), split over the children.
Design notes and measurements: docs/notes/execution-stack.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import Node


@dataclass(frozen=True)
class Schedule:
    """The tree the engine runs (`root`, a copy when any node merged), the number of shared nodes kept and merged,
    and the positions computed beyond the tree's unique ones (the merged nodes' copies)."""

    root: Node
    kept: int
    merged: int
    extra_positions: int


def schedule(root: Node, overhead_tokens: float, attention_per_key: float, prefix_overhead: float = 0.0) -> Schedule:
    """Merge the shared nodes under the virtual `root` whose sharing saves fewer position-equivalents than it costs:
    `overhead_tokens`, plus `prefix_overhead` x its children's positions for a node at the root (module docstring).
    attention_per_key: position-equivalents of one (query, key) pair of attention, 2 n_layers d_attn / N_params
    (`attention_per_key`). overhead_tokens and prefix_overhead 0 keep every shared node. Recursive in the tree's
    depth, as the traversal (`stack.py`)."""
    counts = [0, 0, 0]  # kept, merged, extra positions
    children = []
    for child in root.children:
        children.extend(_scheduled(child, overhead_tokens, prefix_overhead, attention_per_key, counts))
    if not counts[1]:
        return Schedule(root, counts[0], 0, 0)
    return Schedule(Node(root.tokens, root.start, root.rollouts, children), counts[0], counts[1], counts[2])


def attention_per_key(config, n_params: int) -> float:
    """Position-equivalents of one (query, key) pair: 4 n_attention_layers d_attn attention FLOPs against the
    2 N_params of a position's matmuls (forward; the backward scales both by 3). 0 for a model without attention
    layers (Mamba, Mamba2: their configs have no attention fields)."""
    from ..models import head_dim
    from .recurrent import attention_layers

    n_attention = sum(attention_layers(config))
    if not n_attention:
        return 0.0
    d_attn = config.num_attention_heads * head_dim(config)
    return 2 * n_attention * d_attn / max(n_params, 1)


def _scheduled(node: Node, pack: float, per_child_position: float, per_key: float, counts: list[int]) -> list[Node]:
    """The nodes that replace `node` (itself, with its children scheduled; or, merged, one copy per child). pack: a
    pack's cost, per_child_position: a child position's extra cost under a root node, both in positions."""
    children = []
    for child in node.children:
        children.extend(_scheduled(child, pack, per_child_position, per_key, counts))
    continuing = {i for c in children for i in c.rollouts}
    ending = [i for i in node.rollouts if i not in continuing]
    shares = len(children) + (1 if ending else 0)  # the copies a merge would make
    if shares < 2:  # not shared: nothing to decide
        return [Node(node.tokens, node.start, node.rollouts, children)]
    L, s = len(node), node.start
    saving = (shares - 1) * (L + per_key * (L * s + L * (L + 1) / 2))
    cost = pack + (per_child_position * sum(len(c) for c in children) if s == 0 else 0.0)
    if saving >= cost:
        counts[0] += 1
        return [Node(node.tokens, node.start, node.rollouts, children)]
    counts[1] += 1
    counts[2] += (shares - 1) * L
    merged = [Node(torch.cat([node.tokens, c.tokens]), node.start, c.rollouts, c.children) for c in children]
    if ending:
        merged.append(Node(node.tokens, node.start, ending))
    return merged
