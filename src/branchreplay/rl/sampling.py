"""Rollout generation for one group: one prompt, G samples, the prompt prefilled once.

The prompt is run once with batch size 1; its KV cache is then copied to the live streams (one cache row per
stream) and every stream decodes token by token against it with explicit position ids. A branching schedule
forks streams at given generated depths, so samples share response prefixes as well as the prompt.

Finished streams (EOS sampled) are dropped from the cache at once, so every row of the cache always has the same
length (prompt + generated depth): no padding and no attention mask are ever needed, and a pad id equal to the EOS
id (SmolLM2) cannot confuse anything.

Cache rows are copied, forked and dropped with `Cache.reorder_cache(index)` (an `index_select` along the batch
dimension), the beam-search path that every transformers cache layer implements, linear-attention/SSM layers
included; `batch_select_indices` / `batch_repeat_interleave` exist only on KV layers.
"""

import math
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..models import max_positions
from .sampling_config import SamplingConfig


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
    was_training = model.training
    model.eval()
    try:
        cache, logits = prefill(model, prompt_ids)
        return sample_from(model, cache, logits, len(prompt_ids), schedule, config, eos_token_ids, generator)
    finally:
        model.train(was_training)


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
            logits = streams.fork(schedule[depth], depth, cache, logits)
        if not streams.live:  # every stream has ended; only forks remain
            continue
        tokens, logprobs = _draw(logits, config, generator)
        tokens = streams.drop_finished(streams.append(tokens, logprobs, eos), cache, tokens)
        if streams.live and depth < config.max_new_tokens - 1:
            logits = _decode_one(model, tokens, cache, position + depth)
    return streams.samples


@dataclass
class _Streams:
    """The group's samples in final order, and which of them the cache rows hold: live[row] = the index in `samples`
    of the stream in cache row `row`."""

    samples: list[Sample] = field(default_factory=lambda: [Sample([], [], truncated=True)])
    live: list[int] = field(default_factory=lambda: [0])

    def fork(self, f: int, depth: int, cache, logits: torch.Tensor) -> torch.Tensor:
        """Stream i becomes streams i*f .. i*f+f-1 (its lineage goes on in i*f); the cache rows and the [rows, V]
        logits are repeated to match. Returns the new logits."""
        self.samples = [
            Sample(list(s.completion_ids), list(s.logprobs), s.truncated,
                   (None if s.parent is None else s.parent * f) if k == 0 else (i * f if depth > 0 else None))
            for i, s in enumerate(self.samples)
            for k in range(f)
        ]
        self.live = [i * f + k for i in self.live for k in range(f)]
        rows = torch.arange(len(self.live) // f, device=logits.device).repeat_interleave(f)
        cache.reorder_cache(rows)
        return logits[rows]

    def append(self, tokens: torch.Tensor, logprobs: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
        """Add each live stream's drawn token ([rows, 1]) and logprob ([rows]); returns [rows] bool, ended on EOS."""
        ended = torch.isin(tokens[:, 0], eos)
        for i, token, logprob, end in zip(self.live, tokens[:, 0].tolist(), logprobs.tolist(), ended.tolist()):
            self.samples[i].completion_ids.append(token)
            self.samples[i].logprobs.append(logprob)
            self.samples[i].truncated = not end
        return ended

    def drop_finished(self, ended: torch.Tensor, cache, tokens: torch.Tensor) -> torch.Tensor:
        """Remove the streams that `ended` from the cache and from `live`; returns the tokens of the others."""
        if not ended.any():
            return tokens
        keep = (~ended).nonzero()[:, 0]
        cache.reorder_cache(keep)
        self.live = [self.live[row] for row in keep.tolist()]
        return tokens[keep]


def prefill(model, ids: list[int], cache=None, position: int = 0) -> tuple[DynamicCache, torch.Tensor]:
    """`ids` once, batch size 1, at positions `position` ... after what `cache` holds (a new cache when None): the
    cache and the [1, V] float32 logits of the next token."""
    device = model.device
    cache = DynamicCache(config=model.config) if cache is None else cache
    out = model(input_ids=torch.tensor([ids], device=device),
                position_ids=torch.arange(position, position + len(ids), device=device)[None], cache=cache,
                use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1].float()


def _draw(logits: torch.Tensor, config: SamplingConfig, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of [rows, V] logits: sampled from the top-k / top-p filtered softmax(logits / T), [rows, 1];
    and its logprob under the unfiltered log_softmax(logits / T), [rows] (what training recomputes)."""
    scaled = logits / config.temperature
    probs = _filter_logits(scaled, config.top_k, config.top_p).softmax(dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator)  # [rows, 1]
    return tokens, scaled.log_softmax(dim=-1).gather(-1, tokens)[:, 0]


def _decode_one(model, tokens: torch.Tensor, cache, position: int) -> torch.Tensor:
    """Each live stream's last token ([rows, 1]) at `position` against the cache: the [rows, V] next logits."""
    out = model(input_ids=tokens, position_ids=torch.full_like(tokens, position), cache=cache, use_cache=True)
    return out.logits[:, -1].float()


def eos_token_ids(model, tokenizer) -> set[int]:
    """The tokenizer's EOS id plus the model's generation_config EOS ids (an int or a list)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(gen) if isinstance(gen, (list, tuple)) else ({gen} if gen is not None else set())
    if not ids:
        raise ValueError("neither the tokenizer nor the model's generation_config defines an EOS token id")
    return ids
