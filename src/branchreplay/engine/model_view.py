"""What the engine reads of a model: `ModelView`, resolved once per engine call (`stack.model_view`).

The execution stack, its memory planner and the context-parallel rounds take the model's family, decoder, LM head,
logit transform, per-layer windows and kinds, vocabulary, dtype and device from this one view instead of deriving
them from the model again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .families import Family
from .head import LogitTransform


@dataclass(frozen=True)
class ModelView:
    """The engine's view of a causal LM or a critic (`value.is_value_model`), as one engine call runs it.

    model: the language model (a LoRA model's base, a vision-language model's LM: `vision.language_model`).
    family: its `families.Family` (the registry's, or guessed under `trusted`).
    decoder: the base model, returning final-normed hidden states [B, S, H].
    head: the output projection H -> V (a critic's scalar `score`, H -> 1); transform: the `head.LogitTransform`
        that the model's ForCausalLM applies after it (the identity for a critic).
    windows: per decoder layer the sliding window in tokens, or None (`families.layer_windows`).
    kinds: per decoder layer "attention", "recurrent", "hybrid" or "stateless" (`recurrent.layer_kinds`).
    critic: a value model: values at the trained positions instead of logprobs (value.py).
    vocab_size: token ids run lie in [0, vocab_size): the head's rows, a critic's `config.vocab_size`.
    dtype, device: the head weight's, those of the hidden states and of the per-rollout results.
    rotaries: the rotary modules whose frequencies depend on the forward's length (longrope, dynamic NTK), held at
        each rollout's length (positions.py).
    """

    model: torch.nn.Module
    family: Family
    decoder: torch.nn.Module
    head: torch.nn.Module
    transform: LogitTransform
    windows: list[int | None]
    kinds: list[str]
    critic: bool
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    rotaries: list[torch.nn.Module]

    @property
    def num_layers(self) -> int:
        """The decoder's layers (`config.num_hidden_layers`)."""
        return self.model.config.num_hidden_layers
