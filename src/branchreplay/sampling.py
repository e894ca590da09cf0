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
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .positions import max_positions


@dataclass
class SamplingConfig:
    """How to sample one group.

    temperature: > 0; logits are divided by it before both sampling and the recorded logprob.
    top_p: in (0, 1]; nucleus filtering for sampling only (1.0 = off).
    top_k: >= 0; keep the k most likely tokens for sampling only (0 = off).
    max_new_tokens: >= 1; completion length limit in tokens.
    branching: ((depth, factor), ...) with depths strictly increasing in [0, max_new_tokens) and factors >= 1:
        each live stream forks into `factor` streams before generating the token at `depth` (depth 0 = the first
        generated token). ((0, 2), (32, 4)) gives 2 streams from the start, each forking into 4 at depth 32: 8 samples.
        The product of the factors must equal num_generations (checked by `sample_group`). Empty (the default) means
        num_generations independent samples, i.e. ((0, num_generations),).

    Raises ValueError naming the field and its accepted range when a field is out of range.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    branching: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.branching = tuple((int(d), int(f)) for d, f in self.branching)
        depths = [d for d, _ in self.branching]
        if any(b <= a for a, b in zip(depths, depths[1:])):
            raise ValueError(f"branching depths must be strictly increasing, got {self.branching}")
        if depths and not (0 <= depths[0] and depths[-1] < self.max_new_tokens):
            raise ValueError(
                f"branching depths must be in [0, max_new_tokens={self.max_new_tokens}), got {self.branching}"
            )
        if any(f < 1 for _, f in self.branching):
            raise ValueError(f"branching factors must be >= 1, got {self.branching}")


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
    (`positions.max_positions`), before any token is sampled.
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
    device = model.device
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=device)
    prompt_len = len(prompt_ids)

    was_training = model.training
    model.eval()
    try:
        cache = DynamicCache(config=model.config)
        out = model(
            input_ids=torch.tensor([prompt_ids], device=device),
            position_ids=torch.arange(prompt_len, device=device)[None],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1].float()  # [rows, V]: next-token logits of each live stream
        samples = [Sample([], [], truncated=True)]  # one per stream, in final order
        live = [0]  # live[row] = index in `samples` of the stream held in cache row `row`
        for depth in range(config.max_new_tokens):
            if depth in schedule:  # fork: stream i becomes streams i*f .. i*f+f-1; its lineage goes on in i*f
                f = schedule[depth]
                samples = [
                    Sample(
                        list(s.completion_ids),
                        list(s.logprobs),
                        s.truncated,
                        (None if s.parent is None else s.parent * f) if k == 0 else (i * f if depth > 0 else None),
                    )
                    for i, s in enumerate(samples)
                    for k in range(f)
                ]
                live = [i * f + k for i in live for k in range(f)]
                rows = torch.arange(len(live) // f, device=device).repeat_interleave(f)
                cache.reorder_cache(rows)
                logits = logits[rows]
            if not live:  # every stream has ended; only forks remain
                continue

            scaled = logits / config.temperature
            probs = _filter_logits(scaled, config.top_k, config.top_p).softmax(dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator)  # [rows, 1]
            logprobs = scaled.log_softmax(dim=-1).gather(-1, tokens)[:, 0]
            ended = torch.isin(tokens[:, 0], eos)
            for i, token, logprob, end in zip(live, tokens[:, 0].tolist(), logprobs.tolist(), ended.tolist()):
                samples[i].completion_ids.append(token)
                samples[i].logprobs.append(logprob)
                samples[i].truncated = not end
            if ended.any():  # drop finished streams from the cache
                keep = (~ended).nonzero()[:, 0]
                cache.reorder_cache(keep)
                tokens = tokens[keep]
                live = [live[row] for row in keep.tolist()]
            if live and depth < config.max_new_tokens - 1:
                out = model(
                    input_ids=tokens,
                    position_ids=torch.full_like(tokens, prompt_len + depth),
                    cache=cache,
                    use_cache=True,
                )
                logits = out.logits[:, -1].float()
    finally:
        model.train(was_training)
    return samples
