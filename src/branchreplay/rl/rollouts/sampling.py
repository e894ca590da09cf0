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

import contextlib
import copy
import math
import warnings
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ...engine.attention import PrefixSplit
from ...engine.families import FAMILIES, layer_windows
from ...engine.recurrent import layer_kinds
from ...models import max_positions
from ..config.sampling import SamplingConfig
from .llama_rows import LlamaRows, llama_rows_apply
from .packed_linears import packed_linears
from .static_rows import StaticRows, graphs_apply, static_applies


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


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then nucleus filtering of [n, V] float32 logits: dropped entries become -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # mass strictly before it already reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


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
    preallocated cache, one fixed-shape step replayed as a CUDA graph on CUDA (`static_rows.StaticRows`; one prompt
    too; SDPA attention only); "dynamic" grows transformers' DynamicCache and drops finished streams' rows; "auto"
    (the default) is static on CUDA and, on the CPU, the plain Llama decoding step (`llama_rows.LlamaRows`, one
    prompt too) where it applies, else dynamic. On the CPU in float32 the linear layers run from MKL-packed
    weights during the call (`packed_linears`, packed for the call's prompts x G rows, unless config.pack_weights
    is false). Arguments, result (one list of Samples per
    prompt) and errors as `sample_group`'s, and a ValueError when `generators` and `prompts` differ in number."""
    if len(generators) != len(prompts):
        raise ValueError(f"sample_groups got {len(prompts)} prompts and {len(generators)} generators: pass one "
                         "generator (or None) per prompt")
    schedules = [branching_schedule(model, p, num_generations, config) for p in prompts]
    if not stackable(model.config) or (len(prompts) < 2 and not (_static(model, config) or _plain(model, config))):
        _static(model, config, warn=True)
        with packed_linears(model, config.pack_weights, rows=num_generations):  # packed once for all the prompts
            return [sample_group(model, p, num_generations, config, eos_token_ids, g)
                    for p, g in zip(prompts, generators)]
    was_training = model.training
    model.eval()
    try:
        with packed_linears(model, config.pack_weights, rows=len(prompts) * num_generations):
            filled = prefill_branches(model, DynamicCache(config=model.config), 0, prompts)
            return decode_prefilled(model, filled, [len(p) for p in prompts], schedules[0], config, eos_token_ids,
                                    generators)
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
    static, plain = _static(model, config, warn=True), _plain(model, config)
    if not stackable(model.config) or (len(filled) < 2 and not (static or plain)):
        return [sample_from(model, fork(cache), logits, n, schedule, config, eos_token_ids, g)
                for (cache, logits), n, g in zip(filled, lengths, generators)]
    logits = torch.cat([lg for _, lg in filled])  # [groups, V]
    start = torch.tensor(lengths, device=logits.device)  # each row's first generated position
    if plain:
        most = len(filled) * math.prod(schedule.values())
        rows = LlamaRows(model, start, [c for c, _ in filled], config.max_new_tokens, most, config.pack_weights)
        return _decode_groups(rows, logits, schedule, config, eos_token_ids, generators)
    split = PrefixSplit(model, layer_windows(model.config), layer_kinds(model.config)) if static else None
    with split or contextlib.nullcontext():  # split prefix attention switched on once, if it applies
        graphs = not config.enforce_eager and graphs_apply(model)
        if split is not None and split.applies:  # each prompt held once, seen by its group's rows
            rows = StaticRows(model, start, config.max_new_tokens, graphs, prompts=[c for c, _ in filled])
        else:
            cache, visible = _stacked([c for c, _ in filled], lengths, model.config)
            rows = (StaticRows(model, start, config.max_new_tokens, graphs, stacked=cache, visible=visible)
                    if static else _DynamicRows(model, cache, visible, start))
        return _decode_groups(rows, logits, schedule, config, eos_token_ids, generators)


def _static(model, config: SamplingConfig, warn: bool = False) -> bool:
    """Whether the streams decode in `static_rows.StaticRows` (config.cache_implementation, the model's attention
    and layers, its device). warn: say so when "static" was asked for on a model that cannot take it."""
    stacks = stackable(model.config)
    static = static_applies(model) and stacks and (config.cache_implementation == "static" or (
        config.cache_implementation == "auto" and model.device.type == "cuda"))
    if warn and config.cache_implementation == "static" and not static:
        layers = "" if stacks else ", sliding-window or recurrent layers"
        warnings.warn("sampling.cache_implementation=static needs SDPA attention and full-attention layers only "
                      f"(this model: {getattr(model.config, '_attn_implementation', None)} attention{layers}); it "
                      "decodes with the dynamic cache", RuntimeWarning, stacklevel=3)
    return static


def _plain(model, config: SamplingConfig) -> bool:
    """Whether the streams decode in `llama_rows.LlamaRows`: cache_implementation "auto" on a model it applies to
    (a Llama-architecture model on the CPU)."""
    return config.cache_implementation == "auto" and llama_rows_apply(model)


def stackable(config) -> bool:
    """Whether every decoder layer is full attention, whose caches `sample_groups` stacks left-aligned."""
    return all(k == "attention" for k in layer_kinds(config)) and all(w is None for w in layer_windows(config))


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
        tokens, logprobs = _draw(logits, config, generator)
        keep = streams.drop_finished(streams.append(tokens, logprobs, eos))
        if keep is not None:
            cache.reorder_cache(keep)
            tokens = tokens[keep]
        if streams.live and depth < config.max_new_tokens - 1:
            logits = _decode_one(model, tokens, cache, torch.full_like(tokens, position + depth))
    return streams.samples


class _DynamicRows:
    """The streams of `_decode_groups` in transformers' DynamicCache, stacked left-aligned (`_stacked`): cache row r
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
        return _decode_one(self.model, tokens, self.cache, (self.start + depth)[:, None], mask)


def _decode_groups(rows, logits, schedule, config, eos_token_ids, generators):
    """`sample_from` over the streams of several groups (`sample_groups`), held by `rows` (`_DynamicRows`,
    `static_rows.StaticRows` or `llama_rows.LlamaRows`: `select(index)` makes live stream j the old live stream
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
        for group, n, generator in zip(groups, counts, generators):
            if n:
                tokens, logprobs = _draw(logits[offset : offset + n], config, generator)
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
    return torch.cat([rows.cpu() + o for rows, o in zip(local, offsets)]).to(device)


def _stacked(caches: list[DynamicCache], lengths: list[int], config) -> tuple[DynamicCache, torch.Tensor]:
    """One cache of the prompts' batch-1 caches, left-aligned to the longest (zero key/value slots before a shorter
    prompt), and visible [prompts, P_max] long (1: a real slot)."""
    width = max(lengths)
    stacked = DynamicCache(config=config)
    for layer in range(len(caches[0].layers)):
        keys = [torch.nn.functional.pad(c.layers[layer].keys, (0, 0, width - n, 0)) for c, n in zip(caches, lengths)]
        values = [torch.nn.functional.pad(c.layers[layer].values, (0, 0, width - n, 0))
                  for c, n in zip(caches, lengths)]
        stacked.update(torch.cat(keys), torch.cat(values), layer)
    device = caches[0].layers[0].keys.device
    visible = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], dtype=torch.long, device=device)
    return stacked, visible


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
        for i, token, logprob, end in zip(self.live, tokens[:, 0].tolist(), logprobs.tolist(), ended.tolist()):
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


DRAW_BLOCK = 1024
"""Vocabulary ids per block of `_draw`'s two-level cumulative sum."""


def _draw(logits: torch.Tensor, config: SamplingConfig, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of [rows, V] logits: sampled from the top-k / top-p filtered softmax(logits / T), [rows, 1];
    and its logprob under the unfiltered log_softmax(logits / T), [rows] (what training recomputes).

    The draw is the inverse transform: one uniform u per row from `generator` (float64), and the first token whose
    cumulative probability (summed in float64) exceeds u times the row's total, so a filtered token (probability 0)
    is never drawn; a row whose probabilities are not finite (NaN or inf logits) raises RuntimeError, as
    `torch.multinomial` did. That drew V exponentials per row instead (the Gumbel-max form), a large share of a
    decoding step on the CPU. The cumulative sum is taken in two levels, over blocks of DRAW_BLOCK ids and then
    inside the block u falls in, so no [rows, V] float64 tensor is made (on the CPU, that cumsum and its copy cost
    a decoding loop their fresh buffers' page faults); where the rounding of the two levels differs at the block's
    end, the block's last id of positive probability is drawn. Figures: docs/notes/rl-docstrings.md."""
    scaled = logits / config.temperature
    probs = _filter_logits(scaled, config.top_k, config.top_p).softmax(dim=-1)
    rows, vocab = probs.shape
    whole = vocab - vocab % DRAW_BLOCK  # ids in whole blocks; the rest make a shorter last block (no padded copy)
    sums = [probs[:, :whole].view(rows, whole // DRAW_BLOCK, DRAW_BLOCK).sum(dim=-1, dtype=torch.float64)]
    if whole < vocab:
        sums.append(probs[:, whole:].sum(dim=-1, keepdim=True, dtype=torch.float64))
    block_cdf = torch.cat(sums, dim=-1).cumsum(dim=-1) if len(sums) > 1 else sums[0].cumsum(dim=-1)  # [rows, blocks]
    total = block_cdf[:, -1:]
    torch._assert_async(((total > 0) & total.isfinite()).all(),  # no host sync; on CUDA a device-side assert
                        "sampling: a row of logits gave no finite probabilities (NaN or inf logits: a diverged policy, "
                        "or an overflow in the model's dtype)")
    u = torch.rand(total.shape, dtype=torch.float64, generator=generator, device=probs.device)
    below = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # u * total < total, always
    # [rows, 1]; the clamp only matters for NaN totals (on CUDA, where the assert above reports asynchronously)
    block = torch.searchsorted(block_cdf, below, right=True).clamp_max(block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp_min(0)), 0.0)
    ids = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=probs.device)  # [rows, DRAW_BLOCK]
    inside = torch.where(ids < vocab, probs.gather(1, ids.clamp_max(vocab - 1)), 0.0)  # past the vocabulary: 0
    at = torch.searchsorted(inside.to(torch.float64).cumsum(dim=-1), below - before, right=True)
    last = DRAW_BLOCK - 1 - (inside > 0).flip(-1).to(torch.uint8).argmax(dim=-1, keepdim=True)
    tokens = block * DRAW_BLOCK + torch.where(at < DRAW_BLOCK, at, last)
    return tokens, scaled.log_softmax(dim=-1).gather(-1, tokens)[:, 0]


def _decode_one(model, tokens: torch.Tensor, cache, positions: torch.Tensor, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Each live stream's last token ([rows, 1]) at its position ([rows, 1]) against the cache (`mask` [rows, keys]:
    which key slots each row sees, None: all): the [rows, V] next logits."""
    out = model(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True)
    return out.logits[:, -1].float()


def eos_token_ids(model, tokenizer) -> set[int]:
    """The tokenizer's EOS id plus the model's generation_config EOS ids (an int or a list)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(gen) if isinstance(gen, (list, tuple)) else ({gen} if gen is not None else set())
    if not ids:
        raise ValueError("neither the tokenizer nor the model's generation_config defines an EOS token id")
    return ids
