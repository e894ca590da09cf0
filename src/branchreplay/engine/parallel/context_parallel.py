"""Context parallelism for a shared prefix: a node longer than a rank's share (a long prompt, a shared system prompt or
agent history) runs ONCE across the ranks instead of once on every rank that has one of its branches.

Layout: zigzag (ring attention's causal balance; Llama 3's context parallelism, Dubey et al. 2024, section 3.3.2):
the prefix [0, P) is cut into 2W near-equal chunks, rank r owns chunks r and 2W - 1 - r, run as two rounds (chunks
0..W-1, then W..2W-1); fewer than 2W positions run as one round of W pieces, fewer than W are refused. In each
attention layer a round's K/V are all-gathered (backward: a reduce-scatter), so after the forward every rank holds
the prefix's full K/V, the state its own branches need, and dK, dV return to each piece's owner. The prefix carries
no trained position. Bytes per rank and step, each way: about (W - 1) / W x P x 2 x n_layers x n_kv_heads x
head_dim x element size. Full-attention families only (`sharding.supports_context_parallel`); every rank runs the
same `ContextParallelTree`s in the same order, after its whole trees.
Design notes and measurements: docs/distributed.md, docs/notes/execution-stack.md.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from ...tree import Node, RolloutTree, TreeStats
from ..cache import _PrefixLayer
from .lockstep import CP_BACKWARD, CP_FORWARD

Piece = tuple[int, int, int]
"""(start, end, owner rank) of a piece of the prefix: positions [start, end), run by rank `owner`."""


def zigzag_rounds(length: int, world_size: int) -> list[list[Piece]]:
    """The pieces of a prefix of `length` positions on `world_size` ranks, round by round, each round in position
    order (module docstring). Raises ValueError when length < world_size (some rank would get no position)."""
    if length < world_size:
        raise ValueError(f"a context-parallel prefix needs at least one position per rank: {length} positions for "
                         f"{world_size} ranks")
    chunks = 2 * world_size if length >= 2 * world_size else world_size
    bounds = [round(i * length / chunks) for i in range(chunks + 1)]
    pieces = [(bounds[i], bounds[i + 1]) for i in range(chunks)]
    first = [(a, b, r) for r, (a, b) in enumerate(pieces[:world_size])]
    if chunks == world_size:
        return [first]
    second = [(a, b, world_size - 1 - j) for j, (a, b) in enumerate(pieces[world_size:])]
    return [first, second]


@dataclass
class ContextParallelTree:
    """This rank's part of a tree whose shared prefix runs once across the ranks (module docstring).

    prefix: [P] token ids of the shared prefix (no trained position); every rollout of `tree` starts with it.
    tree: this rank's rollouts of the tree (its branches below the prefix), or None when the rank runs only its
        pieces of the prefix.
    rounds: the pieces of every rank (`zigzag_rounds`), the same on every rank.
    rank: this process's rank in the default process group.
    """

    prefix: torch.Tensor
    tree: RolloutTree | None
    rounds: list[list[Piece]]
    rank: int

    def __post_init__(self):
        self.prefix = torch.as_tensor(self.prefix, dtype=torch.long)
        P = self.prefix.numel()
        for i, r in enumerate(self.rollouts):
            if len(r) < P or not torch.equal(r.token_ids[:P], self.prefix):
                raise ValueError(f"rollout {i} of a context-parallel part does not start with its {P}-token prefix")
            if r.loss_mask[:P].any():
                raise ValueError(f"rollout {i} trains a position of the context-parallel prefix (the first "
                                 f"{P} positions): the prefix must stop before the first trained position")

    @property
    def rollouts(self) -> list:
        return [] if self.tree is None else self.tree.rollouts

    @property
    def stats(self) -> TreeStats:
        """The part's sizes: its rollouts' logical positions, and the positions this rank computes (its pieces and
        its branches below the prefix)."""
        mine = sum(b - a for pieces in self.rounds for a, b, owner in pieces if owner == self.rank)
        if self.tree is None:
            return TreeStats(0, mine, 1, 1, 0)
        s = self.tree.stats
        return TreeStats(s.logical_tokens, s.physical_tokens - self.prefix.numel() + mine, s.nodes, s.depth,
                         s.rollouts)

    def below(self) -> Node:
        """The part's tree from the end of the prefix: a root holding the prefix (start 0, end P) whose children
        are the tree's nodes after it, cut at position P where a node spans it."""
        P = self.prefix.numel()
        root = Node(self.prefix, 0, list(range(len(self.rollouts))))
        todo = list(self.tree.root.children) if self.tree is not None else []
        while todo:
            node = todo.pop()
            if node.end <= P:
                todo.extend(node.children)
            elif node.start >= P:
                root.children.append(node)
            else:
                root.children.append(Node(node.tokens[P - node.start :], P, node.rollouts, node.children))
        root.children.sort(key=lambda n: min(n.rollouts))  # depth-first order of the rollouts, as the tree's
        return root


def run_prefix(run, part: ContextParallelTree, below, final):
    """Forward of this rank's pieces of `part.prefix`, round after round, then `below(ancestors, h)` (the branches,
    against the prefix's full state and last hidden state), then the rounds' backward in reverse order, the first
    round's inside `final` when given (the step's last backward). `run` is the engine's `stack._Run`. A generator
    of collective events (`lockstep.py`): CP_FORWARD before each round's forward, CP_BACKWARD before its backward,
    the events of `below` (a generator too) between."""
    yield from _round(run, part, 0, [], below, final)


def _round(run, part: ContextParallelTree, k: int, ancestors: list, below, final):
    pieces = part.rounds[k]
    ((a, b),) = [(a, b) for a, b, owner in pieces if owner == part.rank]
    train = run.loss is not None
    defer = run.deferred is not None and not (final is not None and k == 0)  # as `stack._Run.pack`
    capture = run.deferred.capture if defer else contextlib.nullcontext
    split = run.prefix_split.applies and a > 0  # as the engine's packs: the earlier keys unmasked
    cache = GatheredCache(ancestors, run.view.num_layers, pieces, part.rank, run.view.kinds, run.view.windows, split)
    yield CP_FORWARD
    with capture() as embedded:
        hidden, cache = run.forward([Node(part.prefix[a:b].to(run.view.device), a, [])], [ancestors], cache=cache)
    state = cache.round_state()
    last = k == len(part.rounds) - 1
    h = _gather(hidden[-1:], [1] * len(pieces))[pieces[-1][2]][0] if last else None
    if not train:
        yield from _next(run, part, k, ancestors + [state], h, below, final)
        return
    leaves = [tuple(_leaf(t) for t in layer) for layer in state]
    h_leaf = _leaf(h) if h is not None else None
    yield from _next(run, part, k, ancestors + [leaves], h_leaf, below, final)
    outputs, grads = [], []
    pairs = [(out, leaf) for layer, leaf_layer in zip(state, leaves, strict=True)
             for out, leaf in zip(layer, leaf_layer, strict=True)]
    if h is not None:
        pairs.append((h, h_leaf))
    for out, leaf in pairs:  # every rank passes every gathered output, with zeros where its branches gave none,
        if out.requires_grad:  # so that every rank runs the same reduce-scatters in the same order
            outputs.append(out)
            grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
    if (final is not None and k == 0) or run.lockstep:  # through every layer all the same (`stack._Run.pack_backward`)
        outputs.append(hidden.sum() * 0)
        grads.append(torch.ones((), dtype=hidden.dtype, device=hidden.device))
    yield CP_BACKWARD
    if final is not None and k == 0:
        if run.deferred is not None:  # the earlier packs' embedding gradients, in the same backward
            more_outputs, more_grads = run.deferred.outputs()
            outputs, grads = outputs + more_outputs, grads + more_grads
        with final, torch.autocast(run.view.device.type, enabled=False):
            torch.autograd.backward(outputs, grads)
    elif outputs:
        with torch.autocast(run.view.device.type, enabled=False):
            torch.autograd.backward(outputs, grads)
    if defer:
        run.deferred.keep(embedded)


def _next(run, part, k, ancestors, h, below, final):
    if k + 1 < len(part.rounds):
        yield from _round(run, part, k + 1, ancestors, below, final)
    else:
        yield from below(ancestors, h)


class _GatheredLayer(_PrefixLayer):
    """One attention layer's cache in a context-parallel round: the earlier rounds' K/V (the ancestors) in; in
    `update`, this rank's keys and values all-gathered with the other ranks' pieces of the round, the earlier
    pieces added to what the layer attends to, and the whole round kept as the state for what follows."""

    def __init__(self, ancestors, pieces: list[Piece], rank: int, split: bool):
        super().__init__(ancestors, None, None, split)
        self.pieces, self.rank = pieces, rank
        ((self.start, _),) = [(a, b) for a, b, owner in pieces if owner == rank]
        self.prefix_length = self.kept = self.start  # the queries start after every earlier position
        self.round = None

    def update(self, key_states, value_states, *args, **kwargs):
        lengths = [0] * len(self.pieces)
        for a, b, owner in self.pieces:
            lengths[owner] = b - a
        gathered = _gather(torch.stack([key_states, value_states]), lengths, dim=-2)  # per rank [2, 1, H, L, D]
        in_order = [gathered[owner] for _, _, owner in self.pieces]
        self.round = torch.cat(in_order, dim=-2)
        earlier = [gathered[owner] for a, _, owner in self.pieces if a < self.start]
        self.ancestors = self.ancestors + [(kv[0], kv[1]) for kv in earlier]
        return super().update(key_states, value_states, *args, **kwargs)

    def node_state(self, a: int, b: int):
        return self.round[0], self.round[1]


class GatheredCache(Cache):
    """The transformers Cache of a context-parallel round: a `_GatheredLayer` per decoder layer, over the earlier
    rounds' states (`ancestors`, root first); `split` as `cache.PrefixCache`'s. `round_state()` after the forward
    is the round's `NodeState` (every rank's pieces, in position order). Raises ValueError for a model with a
    recurrent, hybrid or sliding-window layer (module docstring)."""

    def __init__(self, ancestors, num_layers: int, pieces: list[Piece], rank: int, kinds, windows, split: bool):
        if any(kind != "attention" for kind in kinds) or any(w is not None for w in windows):
            raise ValueError("context parallelism needs every layer to be full attention (no recurrent, hybrid or "
                             "sliding-window layer): run this tree whole or split by its branches")
        super().__init__(layers=[_GatheredLayer([state[i] for state in ancestors], pieces, rank, split)
                                 for i in range(num_layers)])

    def round_state(self):
        return [(layer.round[0], layer.round[1]) for layer in self.layers]


def _gather(x: torch.Tensor, lengths: list[int], dim: int = 0) -> list[torch.Tensor]:
    """Every rank's `x` (this rank's has lengths[rank] along `dim`), with autograd: padded to the longest for the
    all-gather, cut back after. The gradient of each returned tensor reaches its owner, summed over the ranks."""
    from torch.distributed.nn.functional import all_gather

    longest = max(lengths)
    pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, longest - x.shape[dim]]
    with warnings.catch_warnings():  # "deprecated for _functional_collectives", whose all_gather has no autograd
        warnings.filterwarnings("ignore", message=".*all_gather is deprecated", category=FutureWarning)
        out = all_gather(F.pad(x, pad))
    return [o.narrow(dim, 0, n) for o, n in zip(out, lengths, strict=True)]


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(True)
