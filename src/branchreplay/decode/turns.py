"""The in-process sampler of multi-turn rollouts: each turn's replies of every conversation of a step in ONE decoding
loop, as the vLLM server batches them (`trajectories.sample_trajectories_turnwise` drives it turn by turn).

A conversation's KV cache is kept from one turn to the next: at turn t, each request's ids after its parent's (the
parent's reply and the environment's answer) are prefilled from the parent's cache, the children of one parent (or of
parents equal so far) as a radix trie (`forward.prefill_branches`: a reply start forked inside the turn once), and
at the first turn every item's opening as one trie (the start a step's items share, a system prompt, tool schemas,
the identical opening of every guess-number item, once per step). Then every reply of every request decodes together
(`loop.decode_prefilled`: dynamic or static cache, `sampling.cache_implementation`; with the static cache where
split prefix attention applies each conversation's history is held once and read by its rows, never copied per
row). Only the last turn's caches are kept: a request's children need its cache, nothing needs its parent's once
they are prefilled.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import DynamicCache

from .config import SamplingConfig
from .loop import Sample, decode_prefilled, prefill_branches
from .packed_linears import packed_linears

Key = tuple[int, tuple[int, ...]]
"""A request's (item index, branch path): the path of reply indices from the item's opening to the conversation."""


class InProcessTurns:
    """`sample_turn` for `trajectories.sample_trajectories_turnwise`, sampling with `model` in this process.

    generator(item, path): the torch.Generator (or None) a request's replies draw from; requests that share one
    draw from it in the order of the requests (one token each per generated position, or each request's whole
    replies in turn for models that decode each request alone: `loop.decode_prefilled`), so an item's samples
    depend on its own requests only. A call takes [(conversation ids, {generated depth: fan-out}), ...] and their keys
    ((item, path); a path's parent is path[:-1], whose request came in the previous call) and returns each request's
    Samples. Raises KeyError when a request's parent was not in the previous call."""

    def __init__(self, model, config: SamplingConfig, eos_token_ids,
                 generator: Callable[[int, tuple[int, ...]], torch.Generator | None]):
        self.model, self.config, self.eos_token_ids, self.generator = model, config, eos_token_ids, generator
        self.prefixes: dict[Key, tuple[DynamicCache, torch.Tensor, int]] = {}  # the last call's (cache, logits, length)

    @torch.no_grad()
    def __call__(self, requests: list[tuple[list[int], dict[int, int]]], keys: list[Key]) -> list[list[Sample]]:
        was_training = self.model.training
        self.model.eval()
        try:
            rows = sum(math.prod(schedule.values()) for _, schedule in requests)  # the replies of the turn
            with packed_linears(self.model, self.config.pack_weights, rows=rows):
                return self._sample(requests, keys)
        finally:
            self.model.train(was_training)

    def _sample(self, requests: list[tuple[list[int], dict[int, int]]], keys: list[Key]) -> list[list[Sample]]:
        prefixes = self._prefill([ids for ids, _ in requests], keys)
        self.prefixes = prefixes  # the parents' caches are freed: their children are prefilled
        out: list = [None] * len(requests)
        by_schedule: dict[tuple, list[int]] = {}
        for i, (_, schedule) in enumerate(requests):
            by_schedule.setdefault(tuple(sorted(schedule.items())), []).append(i)
        for schedule, members in by_schedule.items():
            drawn = decode_prefilled(self.model, [prefixes[keys[i]][:2] for i in members],
                                     [prefixes[keys[i]][2] for i in members], dict(schedule), self.config,
                                     self.eos_token_ids, [self.generator(*keys[i]) for i in members])
            for i, samples in zip(members, drawn, strict=True):
                out[i] = samples
        return out

    def _prefill(self, ids: list[list[int]], keys: list[Key]) -> dict[Key, tuple[DynamicCache, torch.Tensor, int]]:
        """Each request's (cache, [1, V] float32 next logits, length): its ids after its parent's prefilled from the
        parent's cache, the openings (empty paths) from an empty one. The children of parents whose conversations
        are equal so far (items that open alike, and every opening) form one trie, from one of those parents'
        caches, so no token is prefilled twice."""
        children: dict[tuple[int, ...], list[int]] = {}  # a parent conversation's ids: its children's requests
        parents: dict[tuple[int, ...], Key | None] = {}
        for i, (item, path) in enumerate(keys):
            parent = (item, path[:-1]) if path else None
            shared = tuple(ids[i][: self.prefixes[parent][2]]) if parent is not None else ()
            children.setdefault(shared, []).append(i)
            parents.setdefault(shared, parent)
        out = {}
        for shared, members in children.items():
            parent = parents[shared]
            cache, _, length = self.prefixes[parent] if parent is not None else (
                DynamicCache(config=self.model.config), None, 0)
            filled = prefill_branches(self.model, cache, length, [ids[i][length:] for i in members])
            for i, (child_cache, logits) in zip(members, filled, strict=True):
                out[keys[i]] = (child_cache, logits, len(ids[i]))
        return out
