"""What a branch needs from its prefix, per model family and layer type.

The execution stack hands each child the cached state of its ancestors: for an attention layer the post-RoPE K/V of
every ancestor position (a sliding-window layer: only the last window - 1), for a recurrent layer its state after the
node (`recurrent.py`). This module is the one place that knows, per family, which layers are which and how the
model's forward takes a custom mask. A family outside the registry is refused by name (`UnsupportedModelError`), or,
with `train.unknown_family="self-check"` or the package's `force=True`, first checked against the naive reference on
the user's own model (`self_check.py`; once per model class, config and dtype in a process); the engine's own
`force=True` runs it trusted. An unknown family with recurrent or hybrid layers is always refused, and so is one
whose attention the engine cannot carry: ALiBi biases (MPT, Bloom, Falcon with `alibi=True`), or K/V handed to the
cache as other than [batch, kv_heads, tokens, head_dim] tensors agreeing with the prefix's (`cache._check_layout`).
Design notes and measurements: docs/notes/engine-docstrings.md.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..models import head_dim
from .head import decoder_and_head
from .recurrent import attention_layers


class UnsupportedModelError(ValueError):
    """The model's family is not in the registry, or it is configured in a way the engine cannot run exactly."""


@dataclass(frozen=True)
class Family:
    """How the engine runs one model family.

    mask_mapping: the decoder's forward takes {"full_attention": mask, "sliding_attention": mask} (families with
        `config.layer_types`); otherwise it takes one 4D mask used by every layer.
    recurrent: some layers carry a recurrent state (SSM, linear attention, short conv; see `recurrent.py`): every
        node runs as a pack of one (a sibling's scan cannot share the query sequence), so no tree mask is built.
    float32_kernels: transformers computes part of the forward in float32 whatever the model dtype (SSM scans,
        gated delta rule, float32 logits or residual): the engine equals the naive reference to float32 precision
        only (with those casts made float64 the tests measure ~1e-14; `tests/test_engine_families_recurrent.py`).
    uniform_window: the config has no `layer_types` and `config.sliding_window`, when set, applies to every layer
        (Mistral, Mixtral, Qwen3-MoE with use_sliding_window).
    continues_cache: transformers' forward continues a KV / recurrent cache with several new tokens at once. False
        for Mamba and Jamba, whose mixers restart the scan there (logits off by 0.07-0.8 in float64), so the
        sampler's `prefill` feeds them one token at a time after a cache.

    Mixture of experts (Mixtral, Qwen3-MoE): routing is per position (router logits, top-k and expert weights
    depend only on that position's hidden state), so a shared position's routing is shared like its logprob and
    the engine runs the experts' own forward unchanged. The router load-balancing auxiliary loss couples all the
    tokens of a batch (product of mean routing fractions and mean router probabilities), so it is not a sum over
    nodes; transformers adds it only in `ForCausalLM.forward` when `output_router_logits` is True, and `family_of`
    refuses such a config so that no one trains believing it is on, unless the caller computes it over the tree in
    two passes (`router.py`; the TRL drop-ins). Router jitter noise (Mixtral,
    training mode only) is random, like dropout, and refused by the engine.
    """

    name: str
    mask_mapping: bool
    recurrent: bool = False
    uniform_window: bool = False
    float32_kernels: bool = False
    continues_cache: bool = True


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", mask_mapping=False),
    "mistral": Family("mistral", mask_mapping=False, uniform_window=True),
    "qwen2": Family("qwen2", mask_mapping=True),
    "qwen3": Family("qwen3", mask_mapping=True),
    "gpt2": Family("gpt2", mask_mapping=False),
    # fused qkv / gate-up projections; longrope rotary (length-dependent: positions.py); config.sliding_window,
    # when set, slides every layer
    "phi3": Family("phi3", mask_mapping=False, uniform_window=True),
    # attention logit softcapping (eager attention only in transformers) and final logit softcapping (applied by
    # the engine's LM head, engine/head.py); Gemma3: Gemma3ForCausalLM (text only)
    "gemma2": Family("gemma2", mask_mapping=True),
    "gemma3_text": Family("gemma3_text", mask_mapping=True),
    # Qwen2-VL's language model: a Qwen2 decoder whose rotary positions follow the image grid (engine/vision.py)
    "qwen2_vl_text": Family("qwen2_vl_text", mask_mapping=True),
    # mixture of experts: see the Family docstring (router aux loss: router.py)
    "qwen3_moe": Family("qwen3_moe", mask_mapping=False, uniform_window=True),
    "mixtral": Family("mixtral", mask_mapping=False, uniform_window=True),
    # recurrent and hybrid families (engine/recurrent.py); their packs hold one node, so mask_mapping is unused
    "mamba": Family("mamba", mask_mapping=False, recurrent=True, float32_kernels=True, continues_cache=False),
    "mamba2": Family("mamba2", mask_mapping=False, recurrent=True, float32_kernels=True),
    "bamba": Family("bamba", mask_mapping=False, recurrent=True, float32_kernels=True),
    "falcon_h1": Family("falcon_h1", mask_mapping=False, recurrent=True, float32_kernels=True),
    "jamba": Family("jamba", mask_mapping=False, recurrent=True, float32_kernels=True, continues_cache=False),
    # Mamba2, attention, MLP and MoE layers, one kind per layer (its MLP / MoE layers hold no state)
    "nemotron_h": Family("nemotron_h", mask_mapping=True, recurrent=True, float32_kernels=True),
    "lfm2": Family("lfm2", mask_mapping=False, recurrent=True),  # float64-exact
    "qwen3_next": Family("qwen3_next", mask_mapping=False, recurrent=True, float32_kernels=True),
}

SUPPORTED_ATTENTION = ("sdpa", "eager")

def family_of(model, force: bool = False, router_loss: bool = False) -> Family:
    """The registry entry for `model`; with `force`, a family not in the registry gets `generic_family(model)`
    instead of a refusal, trusted: the caller checked it (the package's `replay_backward(force=True)` runs
    `self_check.check_once` first; the trainer its `train.unknown_family` check).
    `router_loss`: the caller computes the MoE router load-balancing loss (`router.RouterLoss`), so a config with
    `output_router_logits` is not refused.

    Raises:
        UnsupportedModelError: the family is not registered (and not `force`), the attention implementation cannot
            take a tree mask, the config asks for something the engine does not compute (the MoE router
            auxiliary loss, non-causal attention), an unregistered family's attention the engine cannot carry
            (ALiBi).
        ValueError: `force` is a string (e.g. the old "unchecked"), not True or False.
    """
    check_force(force)
    config = model.config
    model_type = config.model_type
    if model_type not in FAMILIES and not force:
        raise UnsupportedModelError(
            f"model family '{model_type}' is not supported by the branchreplay engine (supported: "
            f"{', '.join(sorted(FAMILIES))}). Run `branchreplay verify --model PATH --force` to check it against "
            "the naive reference."
        )
    impl = config._attn_implementation
    if impl not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"attention implementation '{impl}' cannot take the tree mask; load the model with "
            f"attn_implementation='sdpa' (or 'eager')"
        )
    if getattr(config, "output_router_logits", False) and not router_loss:
        raise UnsupportedModelError(
            f"{model_type}: config.output_router_logits is True, but this run does not compute the router "
            "load-balancing loss (branchreplay.trl's trainers do, engine.router.RouterLoss); set "
            "model.config.output_router_logits = False"
        )
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        raise UnsupportedModelError(f"{model_type}: bidirectional attention; the engine runs causal LMs only")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    return generic_family(model)


def check_force(force) -> None:
    """Refuse a string `force` by name (a bool-like value is taken as its truth).

    Raises:
        ValueError: `force` is a string.
    """
    if isinstance(force, str):
        raise ValueError(f"force={force!r}: pass True (run a family outside the registry) or False")


def generic_family(model) -> Family:
    """A `Family` guessed for an unregistered model, used only under `force`: a decoder whose forward mentions a
    mask mapping takes one (as Qwen2 / Gemma do), else one 4D mask; `config.sliding_window` applies to every layer
    unless `config.layer_types` says which layers slide. A wrong guess shows up as an error in `branchreplay verify`
    (and in the self-check that runs before).

    Raises:
        UnsupportedModelError: the decoder adds ALiBi biases (`_uses_alibi`).
    """
    config = model.config
    decoder, _, _ = decoder_and_head(model)
    source = _forward_source(decoder)
    if _uses_alibi(config, source):
        raise UnsupportedModelError(
            f"{config.model_type}: its attention adds ALiBi biases, which transformers builds from the 2D padding "
            "mask of the whole sequence (`build_alibi_tensor`); the engine hands each node a 4D tree mask and a "
            "prefix cache instead, so it cannot run this model exactly (refused whatever `force` says). Models "
            "with rotary or learned positions run; ALiBi families are not supported")
    mask_mapping = "mask_mapping" in source if source else getattr(config, "layer_types", None) is not None
    return Family(config.model_type, mask_mapping=mask_mapping,
                  uniform_window=getattr(config, "layer_types", None) is None)


def _forward_source(decoder) -> str:
    """The source of the decoder's forward, or "" where Python cannot show it."""
    try:
        return inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return ""


def _uses_alibi(config, source: str) -> bool:
    """Whether the decoder adds ALiBi biases: `config.alibi` where the config has the switch (Falcon), else whether
    its forward builds them (MPT, Bloom: always, "alibi" in the forward's source)."""
    switch = getattr(config, "alibi", None)
    return bool(switch) if switch is not None else "alibi" in source


def layer_windows(config) -> list[int | None]:
    """Per decoder layer: the sliding window in tokens (a query at position q sees keys k with q - k < window, as
    in transformers' `sliding_window_overlay`), or None for full attention. From `config.layer_types` when the
    config has it ("sliding_attention" layers slide), else `config.sliding_window` for every layer in a
    `uniform_window` family (an unregistered family counts as one)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types[:n]]
    family = FAMILIES.get(config.model_type)
    if family is None or family.uniform_window:
        return [window] * n
    return [None] * n


def state_bytes_per_token(config, dtype) -> tuple[int, int]:
    """The attention state a branch holds for its prefix: (bytes per prefix token over the full-attention layers,
    the most bytes the sliding-window layers ever hold together, whatever the prefix length).

    Per attention layer and kept position: keys and values, 2 * num_key_value_heads * head_dim elements of `dtype`
    (a torch.dtype). A full layer keeps every prefix position; a sliding layer at most window - 1 of them
    (`cache.kept_positions`). Recurrent layers (`recurrent.py`) are not counted here."""
    n = config.num_hidden_layers
    attention = attention_layers(config)
    if not any(attention):  # Mamba, Mamba2: no attention fields in the config
        return 0, 0
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_position = 2 * heads * head_dim(config) * torch.empty((), dtype=dtype).element_size()
    windows = layer_windows(config)
    full = sum(per_position for w, a in zip(windows[:n], attention) if a and w is None)
    sliding = sum(per_position * (w - 1) for w, a in zip(windows[:n], attention) if a and w is not None)
    return full, sliding


def check_no_dropout(model) -> None:
    """Active dropout draws a different mask in the tree and in each rollout: the gradients would not be equal.
    Raises ValueError naming the first dropout modules (or the config's attention_dropout / router_jitter_noise)
    of a model in training mode."""
    if not model.training:
        return
    active = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training]
    p_attn = getattr(model.config, "attention_dropout", 0.0) or 0.0
    jitter = getattr(model.config, "router_jitter_noise", 0.0) or 0.0  # Mixtral: random router input scaling
    if active or p_attn > 0 or jitter > 0:
        where = ", ".join(active[:3]) or (
            f"attention_dropout={p_attn}" if p_attn > 0 else f"router_jitter_noise={jitter}"
        )
        raise ValueError(
            f"the model has active dropout ({where}); call model.eval() or set the dropout probabilities to 0: "
            "dropout breaks the equivalence with the per-rollout computation"
        )
