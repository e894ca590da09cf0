"""The live streams of several groups in transformers' DynamicCache, the prompts' caches stacked left-aligned."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..forward import decode_one


class DynamicRows:
    """The streams of `loop._decode_groups` in transformers' DynamicCache, stacked left-aligned (`stacked`): cache row r
    is live stream r; visible [rows, P_max] marks its prompt's real key slots, start [rows] its first generated
    position. The cache grows by one slot a step; `select` index-selects the rows (forks copy, drops free)."""

    def __init__(self, model, cache: DynamicCache, visible: torch.Tensor, start: torch.Tensor):
        self.model, self.cache, self.visible, self.start = model, cache, visible, start

    def select(self, index: torch.Tensor) -> None:
        """Live stream j becomes old live stream index[j]."""
        self.cache.reorder_cache(index)
        self.visible, self.start = self.visible[index], self.start[index]

    def decode(self, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """Each live stream's token ([streams, 1]) at generated depth `depth`: the [streams, V] float32 next logits."""
        mask = torch.cat([self.visible, torch.ones((len(tokens), depth + 1), dtype=self.visible.dtype,
                                                   device=self.visible.device)], dim=1)
        return decode_one(self.model, tokens, self.cache, (self.start + depth)[:, None], mask)


def stacked(caches: list[DynamicCache], lengths: list[int], config) -> tuple[DynamicCache, torch.Tensor]:
    """One cache of the prompts' batch-1 caches, left-aligned to the longest (zero key/value slots before a shorter
    prompt), and visible [prompts, P_max] long (1: a real slot)."""
    width = max(lengths)
    stacked = DynamicCache(config=config)
    for layer in range(len(caches[0].layers)):
        keys = [torch.nn.functional.pad(c.layers[layer].keys, (0, 0, width - n, 0)) for c, n in zip(caches, lengths,
                                                                                                    strict=True)]
        values = [torch.nn.functional.pad(c.layers[layer].values, (0, 0, width - n, 0))
                  for c, n in zip(caches, lengths, strict=True)]
        stacked.update(torch.cat(keys), torch.cat(values), layer)
    device = caches[0].layers[0].keys.device
    visible = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], dtype=torch.long, device=device)
    return stacked, visible
