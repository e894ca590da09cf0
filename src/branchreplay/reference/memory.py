"""Estimated peak memory of the padded batch and of prompt sharing, so that a benchmark skips a run that would not
fit (`branchreplay bench`'s `max_gib`). Design notes and measurements: docs/notes/execution-stack.md."""

from __future__ import annotations

import torch

from ..models import head_dim, kv_heads
from ..tree import Rollout
from .padded import padded_shape
from .prompt_sharing import prompt_groups

PEAK_OVER_SAVED = 1.5
"""Peak over saved activations: the backward's transient buffers, the logits and the mask come on top of the bytes
autograd saves; 1.5 covers the bench model's ratio (float32, CPU; docs/notes/execution-stack.md)."""


def activation_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes autograd saves per token position for a Llama-style decoder trained with SDPA: per layer about
    12 x hidden + 2 x kv_dim + 4 x intermediate values (norm in/out, q/k/v, rotated q/k, attention out, residuals,
    gate/up/act/product of the MLP). Checked against the bench model's saved-tensor bytes (figure:
    docs/notes/execution-stack.md)."""
    H, mlp = config.hidden_size, config.intermediate_size
    kv = kv_heads(config) * head_dim(config)
    return (12 * H + 2 * kv + 4 * mlp) * config.num_hidden_layers * torch.finfo(dtype).bits // 8


def padded_peak_bytes(rollouts: list[Rollout], config, dtype: torch.dtype) -> int:
    """Estimated peak of `padded_backward`: PEAK_OVER_SAVED x (activations of B x T_max positions + the boolean
    [B, 1, T_max, T_max] mask transformers builds + float32 logits, log-softmax and probabilities of
    B x (C_max + 1) rows)."""
    B, P_max, C_max = padded_shape(rollouts)
    T = P_max + C_max
    saved = B * T * activation_bytes_per_token(config, dtype) + B * T * T + 3 * 4 * B * (C_max + 1) * config.vocab_size
    return int(PEAK_OVER_SAVED * saved)


def prompt_sharing_peak_bytes(rollouts: list[Rollout], config, dtype: torch.dtype) -> int:
    """Estimated peak of `prompt_sharing_backward` (the largest group): PEAK_OVER_SAVED x (activations of the
    prompt and of G x S_max suffix positions + per layer the G copies of K/V over P + S_max keys, once as cached
    (kv_dim) and once repeated to the query heads for SDPA (d_attn) + the [G, 1, S_max, P + S_max] mask + logits)."""
    per_token = activation_bytes_per_token(config, dtype)
    width = torch.finfo(dtype).bits // 8
    kv_dim, d_attn = kv_heads(config) * head_dim(config), config.num_attention_heads * head_dim(config)
    worst = 0
    for P, members in prompt_groups(rollouts):
        G, S = len(members), max(len(rollouts[i]) - P for i in members)
        kv = config.num_hidden_layers * 2 * G * (P + S) * (kv_dim + d_attn) * width
        saved = (P + G * S) * per_token + kv + G * S * (P + S) + 3 * 4 * G * S * config.vocab_size
        worst = max(worst, saved)
    return int(PEAK_OVER_SAVED * worst)
