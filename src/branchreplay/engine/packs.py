"""Packs: how the children of a node are grouped into forwards, and the chunks of long nodes.

A pack is a list of sibling nodes run as ONE forward against their parent's cached state (under split prefix
attention, of nodes whose parents are in one pack, each against its own: `stack._Run.packs_of`): concatenated into
one query sequence under a tree mask, or, for nodes of one length, as the rows of one [B, L] batch
(`batched_packs`). A node longer than `EngineConfig.chunk_tokens` runs as a chain of chunks (`chunked`). Pure
functions of the tree's shape.
"""

from __future__ import annotations

from ..tree import Node


def packs(nodes: list[Node], max_tokens: int) -> list[list[Node]]:
    """Greedy packs of consecutive siblings with at most `max_tokens` tokens (a longer node gets a pack alone)."""
    packs, current, size = [], [], 0
    for node in nodes:
        if current and size + len(node) > max_tokens:
            packs.append(current)
            current, size = [], 0
        current.append(node)
        size += len(node)
    if current:
        packs.append(current)
    return packs


def batched_packs(nodes: list[Node], max_tokens: int, batch_tokens: int, with_children: bool = False
                  ) -> list[list[Node]]:
    """The packs of `nodes` (the children of one parent, or of the nodes of one pack: `stack._Run.packs_of`): childless
    nodes of one length (with `with_children`, nodes of one length whether or not they have children), two or more, as
    batches of at most `batch_tokens` tokens (one [B, L] forward each, `is_batch`: at the root, the dense packed
    schedule's rollouts, side by side as in a padded batch but without pads; below a prefix, the rollouts' last tokens,
    as Prefix Grouper runs a group's responses); the other nodes as `packs`. A batch's rows attend only to the prefix
    and themselves, under the causal mask, where a pack of them would take a [S, S] tree mask of which all but the
    diagonal blocks are wasted; and a short row's [B, L] call parallelises better over CPU threads than B calls of one
    row (`EngineConfig.max_batch_tokens`). A node longer than `batch_tokens` runs alone. Nodes stay in their order
    within a pack (the children of one parent next to each other)."""
    by_length: dict[int, list[Node]] = {}
    rest = []
    for node in nodes:
        (rest if node.children and not with_children else by_length.setdefault(len(node), [])).append(node)
    batches = []
    for length, same in by_length.items():
        if len(same) == 1:
            rest.extend(same)
            continue
        rows = max(1, batch_tokens // length)
        batches.extend(same[i : i + rows] for i in range(0, len(same), rows))
    return packs(rest, max_tokens) + batches


def is_batch(nodes: list[Node], P: int, split: bool, with_children: bool = False) -> bool:
    """Whether a pack runs as one [B, L] forward (`batched_packs`): two or more nodes of one length, childless
    unless `with_children`, at the root (P = 0) or below a prefix with split prefix attention (`split`; the masked
    path's prefix K/V are concatenated with one row's keys, so there such nodes run as a pack). A batch of one row
    is the same forward as a pack of one node."""
    batch = len(nodes) > 1 and len({len(n) for n in nodes}) == 1
    return batch and (with_children or not any(n.children for n in nodes)) and (P == 0 or split)


def chunked(root: Node, chunk_tokens: int) -> Node:
    """A copy of the tree under `root` in which every node longer than `chunk_tokens` is a chain of chunks."""
    new_root = Node(root.tokens, root.start, root.rollouts)
    todo = [(child, new_root) for child in reversed(root.children)]
    while todo:
        node, parent = todo.pop()
        for a in range(0, len(node), chunk_tokens):
            piece = Node(node.tokens[a : a + chunk_tokens], node.start + a, node.rollouts)
            parent.children.append(piece)
            parent = piece
        todo.extend((child, parent) for child in reversed(node.children))
    return new_root


def spans(nodes: list[Node]) -> list[tuple[Node, int, int]]:
    """(node, start, end) of each node's positions within its pack's query sequence."""
    out, offset = [], 0
    for node in nodes:
        out.append((node, offset, offset + len(node)))
        offset += len(node)
    return out
