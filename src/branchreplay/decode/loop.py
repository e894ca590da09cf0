"""Rollout generation for one group: one prompt, G samples, the prompt prefilled once (for a step's groups, a start
their prompts share once: `sample_groups`).

The prompt is run once with batch size 1; its KV cache is then copied to the live streams (one cache row per
stream) and every stream decodes token by token against it with explicit position ids. A branching schedule
forks streams at given generated depths, so samples share response prefixes as well as the prompt. Finished
streams (EOS sampled) are dropped from the cache at once, so every row of the cache always has the same length
(prompt + generated depth): no padding and no attention mask are ever needed, and a pad id equal to the EOS id
(SmolLM2) cannot confuse anything. Cache rows are copied, forked and dropped with `Cache.reorder_cache(index)`
(an `index_select` along the batch dimension), the beam-search path that every transformers cache layer
implements, linear-attention/SSM layers included (`batch_select_indices` exists only on KV layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..models import max_positions
from .config import SamplingConfig
from .draw import draw
from .forward import decode_one, fork, prefill, prefill_branches
from .packed_linears import packed_linears
from .rows import choose, open_rows


@dataclass
class Sample:
    """One sampled completion.

    completion_ids: sampled token ids, at most max_new_tokens, ending with the first EOS if one was sampled.
    logprobs: float32 logprob (nats) of each id under log_softmax(logits / temperature) over the FULL vocabulary,
        i.e. before top-k/top-p filtering, which is what training recomputes. Same length as completion_ids.
    truncated: True when no EOS was sampled within max_new_tokens.
    parent: for branching, the index of the earlier sample this one forked from (they share exactly the tokens
        generated before the fork, the longest prefix it shares with any earlier sample); None when it shares no
        generated token with an earlier sample.
    """

    completion_ids: list[int]
    logprobs: list[float]
    truncated: bool
    parent: int | None = None


@torch.no_grad()
def sample_group(
    model,
    prompt_ids: list[int],
    num_generations: int,
    config: SamplingConfig,
    eos_token_ids: set[int] | list[int],
    generator: torch.Generator | None = None,
) -> list[Sample]:
    """Sample `num_generations` completions of one prompt, prefilling the prompt once.

    model: a decoder-only Hugging Face causal LM (Llama, Qwen2/3, Mistral, GPT-2, ...). It is run in eval mode
        (no dropout) and its previous train/eval mode is restored afterwards.
    prompt_ids: the prompt's token ids, at least one.
    eos_token_ids: ids that end a completion (the EOS is kept in it). Ids only decide where a completion ends;
        nothing is ever compared with a pad id.
    generator: a torch.Generator on the model's device; a fixed seed makes the result deterministic.

    Returns num_generations Samples. With branching, the children of a fork are consecutive: for ((0, 2), (4, 2))
    samples 0 and 1 share their first 4 generated tokens, and so do samples 2 and 3. A stream that ended before a
    fork is copied as it is, so its children are identical.

    Raises ValueError when prompt_ids is empty, num_generations < 1, the product of the branching factors
    differs from num_generations, or the prompt plus max_new_tokens exceeds the model's maximum positions
    (`models.max_positions`), before any token is sampled.
    """
    schedule = branching_schedule(model, prompt_ids, num_generations, config)
    was_training = model.training
    model.eval()
    try:
        with packed_linears(model, config.pack_weights, rows=num_generations):
            cache, logits = prefill(model, prompt_ids)
            return sample_from(model, cache, logits, len(prompt_ids), schedule, config, eos_token_ids, generator)
    finally:
        model.train(was_training)


@torch.no_grad()
def sample_groups(model, prompts: list[list[int]], num_generations: int, config: SamplingConfig,
                  eos_token_ids: set[int] | list[int], generators: list[torch.Generator | None]) -> list[list[Sample]]:
    """`sample_group` for every prompt of a step in ONE decoding loop: the prompts are prefilled once, as a radix
    trie (`prefill_branches`: a start they share, a system prompt, a tool schema, few-shot turns, runs once for the
    step); then every live stream of every group decodes its next token in one batched forward per generated
    position.

    The prompts' caches are stacked left-aligned to the longest prompt: a shorter prompt's cache row starts with
    empty (zero) key/value slots that an attention mask hides from every query, and each stream keeps its own
    position ids, so a stream sees exactly the keys it would see alone (the masked slots get weight 0). Group k
    draws its tokens from its own `generators[k]`, as `sample_group` does, so its samples do not depend on the
    other groups; they equal `sample_group`'s up to the floating-point order of the batched matmuls (a draw can
    flip only where that moves a cumulative probability across the uniform number drawn; in the tests, never).

    A model with recurrent (SSM / conv) or sliding-window layers, whose caches cannot be left-aligned this way, runs
    `sample_group` per prompt instead. With config.cache_implementation="static" the streams decode in a
    preallocated cache, one fixed-shape step replayed as a CUDA graph on CUDA (`rows.static.StaticRows`; one prompt
    too; SDPA attention only); "dynamic" grows transformers' DynamicCache and drops finished streams' rows; "auto"
    (the default) is static on CUDA and, on the CPU, the plain Llama decoding step (`rows.llama.LlamaRows`, one
    prompt too) where it applies, else dynamic. On the CPU in float32 the linear layers run from MKL-packed
    weights during the call (`packed_linears`, packed for the call's prompts x G rows, unless config.pack_weights
    is false). Arguments, result (one list of Samples per
    prompt) and errors as `sample_group`'s, and a ValueError when `generators` and `prompts` differ in number."""
    if len(generators) != len(prompts):
        raise ValueError(f"sample_groups got {len(prompts)} prompts and {len(generators)} generators: pass one "
                         "generator (or None) per prompt")
    schedules = [branching_schedule(model, p, num_generations, config) for p in prompts]
    rows = choose(model, config, len(prompts), warn=True)
    if rows == "alone":
        with packed_linears(model, config.pack_weights, rows=num_generations):  # packed once for all the prompts
            return [sample_group(model, p, num_generations, config, eos_token_ids, g)
                    for p, g in zip(prompts, generators, strict=True)]
    was_training = model.training
    model.eval()
    try:
        with packed_linears(model, config.pack_weights, rows=len(prompts) * num_generations):
            filled = prefill_branches(model, DynamicCache(config=model.config), 0, prompts)
            return _decode_rows(model, rows, filled, [len(p) for p in prompts], schedules[0], config,
                                eos_token_ids, generators)
    finally:
        model.train(was_training)


@torch.no_grad()
def decode_prefilled(model, filled: list[tuple[DynamicCache, torch.Tensor]], lengths: list[int],
                     schedule: dict[int, int], config: SamplingConfig, eos_token_ids,
                     generators: list[torch.Generator | None]) -> list[list[Sample]]:
    """The decoding loop of `sample_groups` from prefixes already prefilled: filled[k] = (a batch-1 cache of
    lengths[k] tokens, never written here; the [1, V] float32 logits of its next token), each group forked by
    `schedule` ({generated depth: factor}) and drawing from `generators[k]` (the same generator may serve several
    groups: they draw from it in group order). Every live stream of every group decodes in one batched forward
    per position, in the rows `sample_groups` describes (the plain Llama step, static or dynamic), the groups
    drawing in turn at each generated position; a model with recurrent or sliding-window layers decodes each group
    alone (`sample_from`), one group's whole samples after another's. The model must be in eval mode. Returns one
    list of Samples per group."""
    rows = choose(model, config, len(filled), warn=True)
    if rows == "alone":
        return [sample_from(model, fork(cache), logits, n, schedule, config, eos_token_ids, g)
                for (cache, logits), n, g in zip(filled, lengths, generators, strict=True)]
    return _decode_rows(model, rows, filled, lengths, schedule, config, eos_token_ids, generators)


def _decode_rows(model, rows, filled, lengths, schedule, config, eos_token_ids, generators) -> list[list[Sample]]:
    """`decode_prefilled` in the `rows` that `rows.choose` picked: every live stream of every group at once."""
    logits = torch.cat([lg for _, lg in filled])  # [groups, V]
    most = len(filled) * math.prod(schedule.values())
    with open_rows(model, rows, filled, lengths, most, config) as held:
        return _decode_groups(held, logits, schedule, config, eos_token_ids, generators)


def branching_schedule(model, prompt_ids: list[int], num_generations: int, config: SamplingConfig) -> dict[int, int]:
    """{generated depth: fan-out} of `config.branching`, after `sample_group`'s checks (its ValueErrors)."""
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    schedule = dict(config.branching or ((0, num_generations),))
    if math.prod(schedule.values()) != num_generations:
        raise ValueError(
            f"branching={config.branching} makes {math.prod(schedule.values())} samples but num_generations="
            f"{num_generations}: make the product of the branching factors equal num_generations"
        )
    limit = max_positions(model.config)
    if limit is not None and len(prompt_ids) + config.max_new_tokens > limit:
        raise ValueError(
            f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({config.max_new_tokens}) is more than the "
            f"model's max_position_embeddings ({limit}): lower SamplingConfig.max_new_tokens "
            f"(--sampling.max_new_tokens) to at most {max(limit - len(prompt_ids), 0)} or shorten the prompt"
        )
    return schedule


@torch.no_grad()
def sample_from(model, cache, logits: torch.Tensor, position: int, schedule: dict[int, int], config: SamplingConfig,
                eos_token_ids, generator: torch.Generator | None = None) -> list[Sample]:
    """The decoding loop of `sample_group` from a prefix already in `cache` (batch 1, `position` tokens) with its
    [1, V] next-token `logits`: forks by `schedule` ({generated depth: factor}), at most config.max_new_tokens
    tokens. The cache is consumed (its rows are forked and dropped). The model must be in eval mode."""
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=logits.device)
    streams = _Streams()
    for depth in range(config.max_new_tokens):
        if depth in schedule:
            rows = streams.fork(schedule[depth], depth).to(logits.device)
            cache.reorder_cache(rows)
            logits = logits[rows]
        if not streams.live:  # every stream has ended; only forks remain
            continue
        tokens, logprobs = draw(logits, config, generator)
        keep = streams.drop_finished(streams.append(tokens, logprobs, eos))
        if keep is not None:
            cache.reorder_cache(keep)
            tokens = tokens[keep]
        if streams.live and depth < config.max_new_tokens - 1:
            logits = decode_one(model, tokens, cache, torch.full_like(tokens, position + depth))
    return streams.samples


def _decode_groups(rows, logits, schedule, config, eos_token_ids, generators):
    """`sample_from` over the streams of several groups (`sample_groups`), held by `rows` (`rows.dynamic.DynamicRows`,
    `rows.static.StaticRows` or `rows.llama.LlamaRows`: `select(index)` makes live stream j the old live stream
    index[j], `decode(tokens, depth)` gives the next logits); the groups' streams are consecutive, in group order."""
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=logits.device)
    groups = [_Streams() for _ in generators]
    for depth in range(config.max_new_tokens):
        if depth in schedule:
            before = [len(g.live) for g in groups]
            index = _rows([g.fork(schedule[depth], depth) for g in groups], before, logits.device)
            rows.select(index)
            logits = logits[index]
        counts = [len(g.live) for g in groups]
        if not sum(counts):
            continue
        drawn, kept, offset = [], [], 0
        for group, n, generator in zip(groups, counts, generators, strict=True):
            if n:
                tokens, logprobs = draw(logits[offset : offset + n], config, generator)
                drawn.append(tokens)
                ended = group.append(tokens, logprobs, eos)
                kept.append(group.drop_finished(ended))
                if kept[-1] is None:
                    kept[-1] = torch.arange(n, device=tokens.device)
            else:
                kept.append(torch.zeros(0, dtype=torch.long, device=logits.device))
            offset += n
        tokens = torch.cat(drawn)
        index = _rows(kept, counts, logits.device)
        if len(index) < len(tokens):
            rows.select(index)
            tokens = tokens[index]
        if len(tokens) and depth < config.max_new_tokens - 1:
            logits = rows.decode(tokens, depth)
    return [g.samples for g in groups]


def _rows(local: list[torch.Tensor], counts: list[int], device) -> torch.Tensor:
    """The stacked cache's row index (on `device`) from each group's index into its own `counts[k]` rows (the
    groups' rows are consecutive, in group order)."""
    offsets = [sum(counts[:k]) for k in range(len(counts))]
    return torch.cat([rows.cpu() + o for rows, o in zip(local, offsets, strict=True)]).to(device)


@dataclass
class _Streams:
    """The group's samples in final order, and which of them the cache rows hold: live[row] = the index in `samples`
    of the stream in cache row `row`."""

    samples: list[Sample] = field(default_factory=lambda: [Sample([], [], truncated=True)])
    live: list[int] = field(default_factory=lambda: [0])

    def fork(self, f: int, depth: int) -> torch.Tensor:
        """Stream i becomes streams i*f .. i*f+f-1 (its lineage goes on in i*f). Returns the index of the new rows
        into the old ones ([rows * f], for the cache rows and the logits)."""
        self.samples = [
            Sample(list(s.completion_ids), list(s.logprobs), s.truncated,
                   (None if s.parent is None else s.parent * f) if k == 0 else (i * f if depth > 0 else None))
            for i, s in enumerate(self.samples)
            for k in range(f)
        ]
        rows = len(self.live)
        self.live = [i * f + k for i in self.live for k in range(f)]
        return torch.arange(rows).repeat_interleave(f)

    def append(self, tokens: torch.Tensor, logprobs: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
        """Add each live stream's drawn token ([rows, 1]) and logprob ([rows]); returns [rows] bool, ended on EOS."""
        ended = torch.isin(tokens[:, 0], eos)
        for i, token, logprob, end in zip(self.live, tokens[:, 0].tolist(), logprobs.tolist(), ended.tolist(),
                                          strict=True):
            self.samples[i].completion_ids.append(token)
            self.samples[i].logprobs.append(logprob)
            self.samples[i].truncated = not end
        return ended

    def drop_finished(self, ended: torch.Tensor) -> torch.Tensor | None:
        """Remove the streams that `ended` from `live`; returns the index of the rows kept (None: all are)."""
        if not ended.any():
            return None
        keep = (~ended).nonzero()[:, 0]
        self.live = [self.live[row] for row in keep.tolist()]
        return keep


def eos_token_ids(model, tokenizer) -> set[int]:
    """The tokenizer's EOS id plus the model's generation_config EOS ids (an int or a list)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(gen) if isinstance(gen, (list, tuple)) else ({gen} if gen is not None else set())
    if not ids:
        raise ValueError("neither the tokenizer nor the model's generation_config defines an EOS token id")
    return ids
