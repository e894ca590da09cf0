"""Which shared nodes the execution stack runs once, and which it runs again inside each child: `schedule`.

Sharing a node saves positions: a node of L tokens shared by c children runs once instead of c times, (c - 1) x L
positions fewer (each with its attention over the node's prefix). It also costs: the node is a forward and a
backward of its own (a pack), and its children run as separate packs after it, where without it they would run in
their parent's packs (with split prefix attention they may share packs with the children of the node's siblings,
`stack._Run.packs_of`, so this overcharges there: not measured). A pack's fixed cost (the decoder's Python and
per-layer kernel launches, mask and cache objects, the LM head's chunks, the leaves and the extra backward call)
does not shrink with its size; on the CPU it is worth tens of positions (`EngineConfig.pack_overhead_tokens`,
measured by scripts/pack_overhead.py). Trees built from sampled rollouts are full of nodes that share a few tokens
by chance (two completions that both open with "The"), and a low-sharing tree (short prompt, long responses) saves
little even at its root.

`schedule(root, overhead)` merges every node whose sharing saves fewer position-equivalents than the pack it
costs into its children: each child gets the node's tokens in front of its own (a rollout that ends at the node
gets a copy of it as a child of its own), so those positions are computed once per child. Decided bottom-up, so a
node that keeps its children shared is weighed with its own subtree. When every shared node merges, each rollout
runs alone against nothing: the dense packed schedule (rollouts side by side in packs of `max_pack_tokens`, a
block-diagonal mask), which the engine then takes. The result is still exact: a merged tree is a prefix tree
whose siblings may share a first token, and the losses are sums over (rollout, position), split over the children
(`losses.py`).

The saving counted for a node of L tokens at start position s with c children: (c - 1) x (L + attention), where
attention = (L x s + L (L + 1) / 2) x 2 n_layers d_attn / N_params converts its attention FLOPs to positions
(the FLOP formula of `bench.flops`; N_params: the matmul parameters of the decoder).

The cost counted: one pack, plus, for a node at the root (s = 0), `prefix_overhead` x the positions of its
children. Its children attend to a cached prefix (split attention: a second kernel, the merge, their leaves), where
merged they would run alone, as a plain causal forward; deeper nodes' children attend to a prefix either way.
`scripts/pack_overhead.py` measures it on the bench Llama: a child position costs 9% more than a standalone one at
1 thread, and a child pack 12 ms more (33 positions) at 2 threads (`EngineConfig.prefix_position_overhead`, 0.1;
the engine charges it only where the model runs split prefix attention, `attention.PrefixSplit`).
Without it a 64-token prompt shared by 8 responses of 1024 tokens (5% of the positions) ran 5% slower as a tree
than as the dense packed schedule.
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


