"""The transformers `Cache` the engine passes to the model: ancestors' state in, each new node's state out."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

NodeState = list[tuple[torch.Tensor, ...]]
"""What a node hands its descendants, per decoder layer. Attention layers: (keys, values) of the node's own
positions, each [1, H_kv, L, D] (post-RoPE, as transformers caches them)."""


class _PrefixLayer(DynamicLayer):
    """One attention layer's cache: the ancestors' K/V, concatenated once with the K/V of this forward."""

    def __init__(self, ancestors: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        self.ancestors = ancestors
        self.prefix_length = sum(k.shape[-2] for k, _ in ancestors)
        self.new_keys = self.new_values = None

    def update(self, key_states, value_states, *args, **kwargs):
        self.new_keys, self.new_values = key_states, value_states
        if not self.ancestors:
            return key_states, value_states
        keys = torch.cat([k for k, _ in self.ancestors] + [key_states], dim=-2)
        values = torch.cat([v for _, v in self.ancestors] + [value_states], dim=-2)
        return keys, values

    def get_seq_length(self) -> int:
        return self.prefix_length

    def node_state(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.new_keys[:, :, a:b], self.new_values[:, :, a:b]


class PrefixCache(Cache):
    """The transformers Cache the engine passes to the model: the ancestors' states in, each node's state out.

    Args:
        ancestors: the `NodeState` of each ancestor, root first (tensors that require grad when training, so that
            gradients flow back to the ancestors through them).
        num_layers: number of decoder layers.
    After the forward, `node_state(a, b)` is the `NodeState` of the node at query positions [a, b).
    """

    def __init__(self, ancestors: list[NodeState], num_layers: int):
        super().__init__(layers=[_PrefixLayer([state[i] for state in ancestors]) for i in range(num_layers)])

    def node_state(self, a: int, b: int) -> NodeState:
        return [layer.node_state(a, b) for layer in self.layers]
