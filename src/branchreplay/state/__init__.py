"""What a branch needs from its prefix, per model family and layer type.

The execution stack hands each child the cached state of its ancestors. For the attention layers of the families
below that state is the post-RoPE K/V of every ancestor position; a sliding-window layer additionally masks keys
more than `window` positions back. This module is the one place that knows, per family, which layers are
which and how the model's forward takes a custom mask. A family not listed here is refused by name
(`UnsupportedModelError`): running it through the engine could be silently wrong.

`cache.PrefixCache` is the transformers `Cache` the engine passes to the model: it serves the ancestors' state
(tensors that require grad, so gradients flow back to the ancestors) and hands out each new node's state.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedModelError(ValueError):
    """The model's family is not in the registry, or it is configured in a way the engine cannot run exactly."""


@dataclass(frozen=True)
class Family:
    """How the engine runs one model family.

    mask_mapping: the decoder's forward takes {"full_attention": mask, "sliding_attention": mask} (families with
        `config.layer_types`); otherwise it takes one 4D mask used by every layer.
    """

    name: str
    mask_mapping: bool


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", mask_mapping=False),
    "mistral": Family("mistral", mask_mapping=False),
    "qwen2": Family("qwen2", mask_mapping=True),
    "qwen3": Family("qwen3", mask_mapping=True),
    "gpt2": Family("gpt2", mask_mapping=False),
}

SUPPORTED_ATTENTION = ("sdpa", "eager")


def family_of(model) -> Family:
    """The registry entry for `model`.

    Raises:
        UnsupportedModelError: the family is not registered, or the attention implementation cannot take a tree mask.
    """
    model_type = model.config.model_type
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model family '{model_type}' is not supported by the branchreplay engine (supported: "
            f"{', '.join(sorted(FAMILIES))}). Run `branchreplay verify --model PATH` to check it against the "
            "naive reference."
        )
    impl = model.config._attn_implementation
    if impl not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"attention implementation '{impl}' cannot take the tree mask; load the model with "
            f"attn_implementation='sdpa' (or 'eager')"
        )
    return FAMILIES[model_type]


def layer_windows(config) -> list[int | None]:
    """Per decoder layer: the sliding window in tokens (a query at position q sees keys k with q - k < window, as
    in transformers' `sliding_window_overlay`), or None for full attention."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types[:n]]
    if config.model_type == "mistral":
        return [window] * n
    return [None] * n


def decoder_and_head(model):
    """(decoder, lm_head): the base model returning final-normed hidden states [B, S, H], and the output
    projection H -> V."""
    return getattr(model, model.base_model_prefix), model.get_output_embeddings()


from .cache import NodeState, PrefixCache  # noqa: E402, F401  (re-exported: the engine's one import point)
