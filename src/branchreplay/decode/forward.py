"""The model's forwards while decoding: a prompt prefilled once (or a trie of branches, their shared starts once),
one decoding step of every live stream, and a cache forked for a branch without copying its keys and values."""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..engine.families import FAMILIES

SHARED_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)
"""transformers' cache layers that never write into their tensors (`update` concatenates, `reorder_cache`
index-selects: both make new tensors), so a fork may share them by reference."""


def fork(cache: DynamicCache) -> DynamicCache:
    """A cache for a branch of `cache`'s sequence: the keys and values of its attention layers shared by reference
    (`SHARED_LAYERS`: neither side's later updates, forks or drops can change the other's), any other layer (a
    recurrent state written in place: linear attention, SSM conv) copied, at its constant size."""
    child = copy.copy(cache)
    child.layers = [copy.copy(layer) if type(layer) in SHARED_LAYERS else copy.deepcopy(layer)
                    for layer in cache.layers]
    return child


def prefill(model, ids: list[int], cache=None, position: int = 0) -> tuple[DynamicCache, torch.Tensor]:
    """`ids` once, batch size 1, at positions `position` ... after what `cache` holds (a new cache when None): the
    cache and the [1, V] float32 logits of the next token. After a cache, a family that cannot continue it with
    several tokens at once (`engine.families.Family.continues_cache`: Mamba, Jamba) takes them one at a time."""
    family = FAMILIES.get(model.config.model_type)
    if position > 0 and len(ids) > 1 and family is not None and not family.continues_cache:
        for k, token in enumerate(ids):
            cache, logits = prefill(model, [token], cache, position + k)
        return cache, logits
    device = model.device
    cache = DynamicCache(config=model.config) if cache is None else cache
    out = model(input_ids=torch.tensor([ids], device=device),
                position_ids=torch.arange(position, position + len(ids), device=device)[None], cache=cache,
                use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1].float()


def prefill_branches(model, cache, position: int, branches: list[list[int]]
                     ) -> list[tuple[DynamicCache, torch.Tensor]]:
    """Each branch's ids (at least one; positions `position` ... after what `cache` holds) prefilled from a fork of
    `cache`, the ids several branches start with prefilled once (a radix trie of the branches: replies forked
    inside a turn share their start). Per branch: its cache (never written afterwards: continue from a `fork` of
    it; branches ending at the same point get the same one) and the [1, V] float32 logits after its last id."""
    out: list = [None] * len(branches)
    todo = [(cache, list(range(len(branches))), 0)]  # (cache after depth ids, branches sharing them, depth)
    while todo:
        at, members, depth = todo.pop()
        groups: dict[int, list[int]] = {}
        for i in members:
            groups.setdefault(branches[i][depth], []).append(i)
        for group in groups.values():
            end = min(len(branches[i]) for i in group)
            first = branches[group[0]]
            end = next((d for d in range(depth + 1, end) if any(branches[i][d] != first[d] for i in group)), end)
            node = prefill(model, first[depth:end], fork(at), position=position + depth)
            for i in group:
                if len(branches[i]) == end:
                    out[i] = node
            going = [i for i in group if len(branches[i]) > end]
            if going:
                todo.append((node[0], going, end))
    return out


def decode_one(model, tokens: torch.Tensor, cache, positions: torch.Tensor, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Each live stream's last token ([rows, 1]) at its position ([rows, 1]) against the cache (`mask` [rows, keys]:
    which key slots each row sees, None: all): the [rows, V] next logits."""
    out = model(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True)
    return out.logits[:, -1].float()
