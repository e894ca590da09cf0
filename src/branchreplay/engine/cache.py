"""The transformers `Cache` the engine passes to the model: ancestors' state in, each new node's state out."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, DummyLayer, DynamicLayer

from .families import Chunk, UnsupportedModelError
from .recurrent import HybridLayer, RecurrentLayer

PREFIX_ATTR = "_branchreplay_prefix"  # set on the keys `update` returns in split mode: a `Prefix`

NodeState = list[tuple[torch.Tensor, ...]]
"""What a node hands its descendants, per decoder layer. Attention layers: (keys, values) of the node's own
positions, each [1, H_kv, L, D] (post-RoPE, as transformers caches them); a sliding-window layer keeps only the
node's last min(L, window - 1) positions, the most any descendant can see. Multi-head latent attention layers hand the
cache their latent instead, (kv_nope [1, 1, L, kv_lora_rank], k_rot [1, 1, L, qk_rope_head_dim]) (`latent.py`).
Recurrent layers: their state after the node's last token (see `recurrent.py`)."""


def kept_positions(prefix_length: int, window: int | None) -> int:
    """How many of the last prefix positions an attention layer serves to a query sequence starting at position
    `prefix_length`: all of them, or in a sliding-window layer the last window - 1 (a query q sees keys k with
    q - k < window, so the first query, at q = prefix_length, sees keys >= prefix_length - window + 1; later ones
    see less of the prefix); in a chunked layer (`families.Chunk` C) those of the chunk holding `prefix_length`,
    prefix_length % C (a query q sees keys k with k // C == q // C). The engine's tree mask spans the same keys."""
    if isinstance(window, Chunk):
        return prefix_length % window
    return prefix_length if window is None else min(prefix_length, window - 1)


class Prefix(NamedTuple):
    """What a split pack's queries see before their own keys, in one attention layer (`attention._SplitAttention`):
    the distinct key and value pieces [1, H_kv, L_i, D] of their ancestors, and `groups`, a tuple of (a, b, indices):
    the queries a ... b - 1 of the pack, its rows one after the other, see the pieces with those indices, root
    first. One group unless the pack's nodes hang below different parents."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    groups: tuple[tuple[int, int, tuple[int, ...]], ...]


class _PrefixLayer(DynamicLayer):
    """One attention layer's cache: the ancestors' K/V, concatenated once with the K/V of this forward (or, with
    `split`, handed to split prefix attention as pieces: `update`).

    In a sliding-window layer (`window` not None) only the last `kept_positions(P, window)` ancestor positions are
    served, and a node keeps only its last window - 1 positions for its descendants, so the state held along a path
    is bounded by the window, not by the prefix length P. The slicing is differentiable: the gradient of a cut
    position is zero, as it is in the naive computation, where no query within the window reaches it.
    """

    def __init__(self, ancestors: list[tuple[torch.Tensor, torch.Tensor]], window: int | None = None,
                 prefix_length: int | None = None, split: bool = False, groups: tuple | None = None):
        super().__init__()
        self.split, self.groups = split, groups  # groups: `Prefix.groups`, indices into `ancestors` (all kept)
        available = sum(k.shape[-2] for k, _ in ancestors)
        self.window = window
        self.is_sliding = window is not None  # transformers sizes the sliding mask on the first such layer
        self.prefix_length = available if prefix_length is None else prefix_length
        self.kept = kept_positions(self.prefix_length, window)
        self.ancestors = ancestors if groups is not None else _last_positions(ancestors, self.kept)
        self.new_keys = self.new_values = None

    def update(self, key_states, value_states, *args, **kwargs):
        """The keys and values the layer attends to: the ancestors' and these, concatenated. With `split`
        (`attention.PrefixSplit`), these alone, the keys carrying the ancestors' pieces as `PREFIX_ATTR` (a `Prefix`):
        split attention concatenates them only while it computes, and keeps no concatenated copy for backward.

        Raises:
            UnsupportedModelError: the layer hands keys and values in another layout than [batch, kv_heads, tokens,
                head_dim] (a fused or transposed cache), which the engine cannot slice per node.
        """
        _check_layout(key_states, value_states, self.ancestors)
        self.new_keys, self.new_values = key_states, value_states
        if self.split:
            setattr(key_states, PREFIX_ATTR, self._prefix(key_states.shape[0] * key_states.shape[2]))
            return key_states, value_states
        if not self.ancestors:
            return key_states, value_states
        keys = torch.cat([k for k, _ in self.ancestors] + [key_states], dim=-2)
        values = torch.cat([v for _, v in self.ancestors] + [value_states], dim=-2)
        return keys, values

    def _prefix(self, queries: int) -> Prefix:
        """The `Prefix` of a split forward of `queries` positions (its rows one after the other)."""
        groups = self.groups or ((0, queries, tuple(range(len(self.ancestors)))),)
        return Prefix([k for k, _ in self.ancestors], [v for _, v in self.ancestors], groups)

    def get_seq_length(self) -> int:
        """The absolute prefix length P (the query offset), also in a sliding layer that serves fewer keys."""
        return self.prefix_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys `update` returns: absolute positions [P - kept, P + query_length).
        Equal to transformers' `DynamicSlidingWindowLayer.get_mask_sizes` after P tokens (and to `DynamicLayer`'s
        (P + query_length, 0) in a full layer)."""
        return self.kept + query_length, self.prefix_length - self.kept

    def node_state(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the node at positions a ... b - 1 of the forward's rows, one after the other (the
        node's own row of a batch)."""
        keys, values = self.new_keys, self.new_values
        if keys.shape[0] > 1:
            row, length = a // keys.shape[2], keys.shape[2]
            keys, values, a, b = keys[row : row + 1], values[row : row + 1], a - row * length, b - row * length
        if self.window is not None:  # descendants start at the node's end E: they see at most its last window - 1,
            # in a chunked layer its positions in E's chunk (the pack's nodes start at P: E = P + b - a)
            a = max(a, b - kept_positions(self.prefix_length + b - a, self.window))
        return keys[:, :, a:b], values[:, :, a:b]


def _check_layout(keys: torch.Tensor, values: torch.Tensor, ancestors: list[tuple[torch.Tensor, torch.Tensor]]):
    """Refuses keys / values that are not [batch, kv_heads, tokens, head_dim] tensors agreeing with each other and
    with the ancestors' heads and head_dim (the layout every transformers Cache layer takes; older Bloom and Falcon
    fused [batch * heads, head_dim, tokens] keys)."""
    ancestor = ancestors[0][0] if ancestors else keys
    if keys.dim() == 4 and values.dim() == 4 and keys.shape[:3] == values.shape[:3] \
            and (keys.shape[1], keys.shape[-1]) == (ancestor.shape[1], ancestor.shape[-1]):
        return
    raise UnsupportedModelError(
        f"an attention layer handed the cache keys {tuple(keys.shape)} and values {tuple(values.shape)}, not "
        "[batch, kv_heads, tokens, head_dim] tensors (a fused or transposed cache layout): the engine cannot hand "
        "each node its prefix's keys and values, so this model is refused")


def _last_positions(states: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (k, v) pieces holding the last `n` positions of the ancestors' states, root first (whole tensors where a
    whole state is needed, slices otherwise). Each state ends where its node ends, so the last n positions of the
    prefix are a suffix of the last states' positions.
    Raises ValueError if the states hold fewer than n positions."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for k, v in reversed(states):
        if n == 0:
            break
        take = min(n, k.shape[-2])
        out.append((k, v) if take == k.shape[-2] else (k[:, :, -take:], v[:, :, -take:]))
        n -= take
    if n > 0:
        raise ValueError(f"the ancestors' states hold {n} positions fewer than the prefix needs")
    return out[::-1]


_observers: list[Callable[[list[NodeState]], None]] = []


@contextlib.contextmanager
def observe_states(callback: Callable[[list[NodeState]], None]) -> Iterator[None]:
    """While inside, `callback(ancestors)` is called with the ancestors' `NodeState`s (root first) each time the engine
    builds a `PrefixCache`: what a pack holds of its prefix (the benchmark of held state bytes reads it). Removed
    on exit; the engine runs unchanged."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


class PrefixCache(Cache):
    """The transformers Cache the engine passes to the model: the ancestors' states in, each node's state out.

    Args:
        ancestors: the `NodeState` of each ancestor, root first (tensors that require grad when training, so that
            gradients flow back to the ancestors through them).
        num_layers: number of decoder layers.
        kinds: per layer "attention", "recurrent", "hybrid" or "stateless" (`recurrent.layer_kinds`); default all
            attention.
        windows: per layer the sliding window in tokens or None (`layer_windows`); default all full attention.
        prefix_length: the absolute position P at which the query sequence starts; needed when a sliding layer
            holds fewer positions than P (default: the positions the ancestors' states hold).
        split: attention layers hand the prefix pieces to split attention instead of concatenating them
            (`_PrefixLayer.update`); only for full-attention layers under `attention.PrefixSplit`.
        groups: with `split`, a pack whose nodes hang below different parents: (a, b, ancestors) per run of nodes
            with the same ancestors, a ... b - 1 their positions in the pack's rows one after the other (`ancestors`
            is then unused). Raises ValueError without `split`.
    After the forward, `node_state(a, b)` is the `NodeState` of the node at query positions [a, b) (rows one after
    the other).
    """

    def __init__(self, ancestors: list[NodeState], num_layers: int, kinds: list[str] | None = None,
                 windows: list[int | None] | None = None, prefix_length: int | None = None, split: bool = False,
                 groups: list[tuple[int, int, list[NodeState]]] | None = None):
        kinds = kinds or ["attention"] * num_layers
        windows = windows or [None] * num_layers
        if groups is not None and (not split or set(kinds) != {"attention"} or any(w is not None for w in windows)):
            raise ValueError("a pack below several parents runs only under split prefix attention, on full "
                             "attention layers")
        indices = None
        if groups is not None:  # the distinct ancestors, once each, and each group's indices into them
            distinct = {id(state): state for _, _, states in groups for state in states}
            ancestors, order = list(distinct.values()), {key: j for j, key in enumerate(distinct)}
            indices = tuple((a, b, tuple(order[id(state)] for state in states)) for a, b, states in groups)
        for observe in _observers:
            observe(ancestors)
        super().__init__(layers=[_layer(kind, [state[i] for state in ancestors], window, prefix_length, split,
                                        indices)
                                 for i, (kind, window) in enumerate(zip(kinds, windows, strict=True))])

    def node_state(self, a: int, b: int) -> NodeState:
        return [layer.node_state(a, b) for layer in self.layers]


class _StatelessLayer(DummyLayer):
    """A layer with no token mixer (NemotronH's MLP and MoE layers): nothing in from the prefix, nothing out."""

    def node_state(self, a: int, b: int) -> tuple[torch.Tensor, ...]:
        return ()


def _layer(kind: str, states: list[tuple[torch.Tensor, ...]], window: int | None = None,
           prefix_length: int | None = None, split: bool = False, groups=None):
    """One layer's cache from that layer's `NodeState` of each ancestor (root first): attention reads them all (a
    sliding one their last window - 1 positions), a recurrent layer only the parent's (the last), a hybrid
    (FalconH1) both: (k, v) parts and the parent's state; a stateless layer none."""
    if kind == "stateless":
        return _StatelessLayer()
    if kind == "recurrent":
        return RecurrentLayer(states[-1] if states else None)
    if kind == "hybrid":
        return HybridLayer(_PrefixLayer([s[:2] for s in states], window, prefix_length),
                           states[-1][2:] if states else None)
    return _PrefixLayer(states, window, prefix_length, split, groups)
