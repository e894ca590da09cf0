"""The draw of one token per stream: top-k / top-p filtering, then the inverse-transform draw from the filtered
softmax, with the logprob under the unfiltered one (what training recomputes)."""

from __future__ import annotations

import torch

from .config import SamplingConfig


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
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


DRAW_BLOCK = 1024
"""Vocabulary ids per block of `draw`'s two-level cumulative sum."""


def draw(logits: torch.Tensor, config: SamplingConfig, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of [rows, V] logits: sampled from the top-k / top-p filtered softmax(logits / T), [rows, 1];
    and its logprob under the unfiltered log_softmax(logits / T), [rows] (what training recomputes).

    The draw is the inverse transform: one uniform u per row from `generator` (float64), and the first token whose
    cumulative probability (summed in float64) exceeds u times the row's total, so a filtered token (probability 0)
    is never drawn; a row whose probabilities are not finite (NaN or inf logits) raises RuntimeError, as
    `torch.multinomial` did. That drew V exponentials per row instead (the Gumbel-max form), a large share of a
    decoding step on the CPU. The cumulative sum is taken in two levels, over blocks of DRAW_BLOCK ids and then
    inside the block u falls in, so no [rows, V] float64 tensor is made (on the CPU, that cumsum and its copy cost
    a decoding loop their fresh buffers' page faults); where the rounding of the two levels differs at the block's
    end, the block's last id of positive probability is drawn. Figures: docs/notes/sampler.md."""
    scaled = logits / config.temperature
    probs = filter_logits(scaled, config.top_k, config.top_p).softmax(dim=-1)
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
