"""Where the live streams of a step's groups decode, and the one rule that chooses it (`choose`):

    alone    each group by itself (`loop.sample_from`): a model with recurrent or sliding-window layers, whose caches
             cannot be stacked left-aligned, or a single group where neither plain nor static applies
    plain    `llama.LlamaRows`, the plain Llama decoding step: cache_implementation "auto" where it applies (a
             Llama-architecture model on the CPU)
    static   `static.StaticRows`, a preallocated cache (replayed as a CUDA graph on CUDA): cache_implementation
             "static", or "auto" on CUDA, on a model with SDPA attention and full-attention layers only
    dynamic  `dynamic.DynamicRows`, transformers' DynamicCache grown a slot a step: any other case

Rows hold the streams of several groups consecutively, in group order: `select(index)` makes live stream j the old
live stream index[j]; `decode(tokens, depth)` gives the next [streams, V] float32 logits.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Literal

import torch

from ...engine.attention import PrefixSplit
from ...engine.families import layer_windows
from ...engine.recurrent import layer_kinds
from ..config import SamplingConfig
from .dynamic import DynamicRows, stacked
from .llama import LlamaRows, llama_rows_apply
from .static import StaticRows, graphs_apply, static_applies

Rows = Literal["alone", "plain", "static", "dynamic"]


def choose(model, config: SamplingConfig, groups: int, warn: bool = False) -> Rows:
    """The rows that `groups` groups of `model` decode in, by the rule above. warn: as `uses_static`'s."""
    static = uses_static(model, config, warn)
    plain = uses_plain(model, config)
    if not stackable(model.config) or (groups < 2 and not (static or plain)):
        return "alone"
    return "plain" if plain else "static" if static else "dynamic"


def uses_static(model, config: SamplingConfig, warn: bool = False) -> bool:
    """Whether the streams may decode in `static.StaticRows` (config.cache_implementation, the model's attention and
    layers, its device). warn: say so (RuntimeWarning) when "static" was asked for on a model that cannot take it."""
    stacks = stackable(model.config)
    static = static_applies(model) and stacks and (config.cache_implementation == "static" or (
        config.cache_implementation == "auto" and model.device.type == "cuda"))
    if warn and config.cache_implementation == "static" and not static:
        layers = "" if stacks else ", sliding-window or recurrent layers"
        warnings.warn("sampling.cache_implementation=static needs SDPA attention and full-attention layers only "
                      f"(this model: {getattr(model.config, '_attn_implementation', None)} attention{layers}); it "
                      "decodes with the dynamic cache", RuntimeWarning, stacklevel=4)
    return static


def uses_plain(model, config: SamplingConfig) -> bool:
    """Whether the streams may decode in `llama.LlamaRows`: cache_implementation "auto" on a model it applies to (a
    Llama-architecture model on the CPU)."""
    return config.cache_implementation == "auto" and llama_rows_apply(model)


def stackable(config) -> bool:
    """Whether every decoder layer is full attention, whose caches the rows stack left-aligned."""
    return all(k == "attention" for k in layer_kinds(config)) and all(w is None for w in layer_windows(config))


@contextlib.contextmanager
def open_rows(model, rows: Rows, filled: list, lengths: list[int], most: int, config: SamplingConfig):
    """The `rows` ("plain", "static" or "dynamic") of the groups prefilled in `filled` ([(batch-1 cache of lengths[k]
    tokens, its logits)]), for at most `most` live streams; under "static", split prefix attention is switched on
    for the `with` block where it applies (each prompt then held once, seen by its group's rows)."""
    start = torch.tensor(lengths, device=filled[0][1].device)  # each row's first generated position
    caches = [c for c, _ in filled]
    if rows == "plain":
        yield LlamaRows(model, start, caches, config.max_new_tokens, most, config.pack_weights)
        return
    split = PrefixSplit(model, layer_windows(model.config), layer_kinds(model.config)) if rows == "static" else None
    with split or contextlib.nullcontext():
        graphs = not config.enforce_eager and graphs_apply(model)
        if split is not None and split.applies:
            yield StaticRows(model, start, config.max_new_tokens, graphs, prompts=caches)
        else:
            cache, visible = stacked(caches, lengths, model.config)
            yield (StaticRows(model, start, config.max_new_tokens, graphs, stacked=cache, visible=visible)
                   if rows == "static" else DynamicRows(model, cache, visible, start))
