"""The LM head as the families' ForCausalLM forwards apply it: logits = transform(lm_head(hidden)).

The engine runs the decoder (the base model) itself and applies the output projection only at positions that carry
a loss, so every transform that a ForCausalLM forward applies to `lm_head(hidden)` has to be applied here too. They
are read from the config in this one place (transformers 5.24, every `*ForCausalLM.forward` that touches its
logits):
    multiplier: Cohere / Cohere2 `logits * config.logit_scale`; FalconH1 `logits * config.lm_head_multiplier`;
    divisor: Granite, GraniteMoe, GraniteMoeShared, GraniteMoeHybrid `logits / config.logits_scaling`;
    softcap: Gemma2 / Gemma3 and others `softcap * tanh(logits / softcap)`, `config.final_logit_softcapping`;
in that order. Any other transform is caught by `check_head`, which compares this head with the model's own
ForCausalLM logits on a few tokens once per model and refuses a mismatch by name.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


class HeadMismatchError(ValueError):
    """The model's ForCausalLM computes its logits in a way that `LogitTransform` does not reproduce."""


@dataclass(frozen=True)
class LogitTransform:
    """logits -> softcap(logits * multiplier / divisor), each step skipped at its neutral value (1, 1, None)."""

    multiplier: float = 1.0
    divisor: float = 1.0
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[*, V] logits of `lm_head` -> [*, V] logits of the ForCausalLM forward, in the same dtype."""
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def logit_transform(config) -> LogitTransform:
    """The transform a ForCausalLM of this config applies to `lm_head(hidden)` (module docstring)."""
    multiplier = 1.0
    for name in ("logit_scale", "lm_head_multiplier"):
        value = getattr(config, name, None)
        if value is not None:
            multiplier *= float(value)
    divisor = getattr(config, "logits_scaling", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform(multiplier, 1.0 if divisor is None else float(divisor),
                          None if not softcap else float(softcap))


def decoder_and_head(model):
    """(decoder, lm_head, transform): the base model returning final-normed hidden states [B, S, H], the output
    projection H -> V (its `weight` gives the head's dtype, device and vocabulary size), and the `LogitTransform`
    that the model's ForCausalLM applies after it."""
    return getattr(model, model.base_model_prefix), model.get_output_embeddings(), logit_transform(model.config)


_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the transforms verified on it


@torch.no_grad()
def check_head(model, tokens: int = 4) -> None:
    """Compare `transform(lm_head(decoder(ids)))` with `model(ids).logits` on `tokens` fixed ids, once per model and
    transform (a weak cache: nothing is kept on the model).

    Raises:
        HeadMismatchError: they differ (beyond 1e-5 relative in float32/64, 1e-2 in half precision): the family
            transforms its logits in a way this module does not know.
    """
    decoder, head, transform = decoder_and_head(model)
    if transform in _checked.get(model, ()):
        return
    ids = torch.arange(1, tokens + 1, device=head.weight.device)[None] % head.weight.shape[0]
    was_training = model.training
    model.eval()
    try:
        theirs = model(input_ids=ids, use_cache=False).logits.float()
        ours = transform(head(decoder(input_ids=ids, use_cache=False).last_hidden_state)).float()
    finally:
        model.train(was_training)
    rtol = 1e-2 if head.weight.dtype in (torch.float16, torch.bfloat16) else 1e-5
    err = ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()
    if not err <= rtol:
        raise HeadMismatchError(
            f"{model.config.model_type}: {type(model).__name__} computes its logits differently from the engine's LM "
            f"head ({transform}): relative difference {err:.2e} on {tokens} tokens. Its forward applies a logit "
            "transform that branchreplay.state.head does not read; add it there (and a test) before training"
        )
    _checked.setdefault(model, set()).add(transform)
