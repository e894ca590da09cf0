"""What a branch needs from its prefix, per model family and layer type.

The execution stack hands each child the cached state of its ancestors: for an attention layer the post-RoPE K/V of
every ancestor position (a sliding-window layer: only the last window - 1; multi-head latent attention: the compressed
latent and rotary key it caches instead, `latent.py`), for a recurrent layer its state after the node (`recurrent.py`).
This module is the one place that knows, per family, which layers are which and how the model's forward takes a
custom mask. A family outside the registry is refused by name (`UnsupportedModelError`), or,
with `train.unknown_family="self-check"` or the package's `force=True`, first checked against the naive reference on
the user's own model (`self_check.py`; once per model class, config and dtype in a process); the engine's own
`trusted=True` runs it unchecked. An unknown family with recurrent or hybrid layers is always refused, and so is one
whose attention the engine cannot carry: ALiBi biases (MPT, Bloom, Falcon with `alibi=True`), the families of
`REFUSED` (DiffLlama's differential attention, Dory's looped layers), or K/V handed to the cache as other than
[batch, kv_heads, tokens, head_dim] tensors agreeing with the prefix's (`cache._check_layout`).
Design notes and measurements: docs/notes/execution-stack.md.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..models import EXPERTS_WITHOUT_FLOAT64, head_dim, kv_heads
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

    Mixture of experts (Mixtral, Qwen3-MoE, gpt-oss): routing is per position (router logits, top-k and expert weights
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
    # Gemma4ForCausalLM: per-layer head_dim / K/V heads (`models.head_dim`), sliding and full layers, K/V shared
    # across the last layers (those hold no state: `recurrent.layer_kinds`), per-layer token inputs, MoE blocks
    "gemma4_text": Family("gemma4_text", mask_mapping=True),
    # Llama4ForCausalLM: chunked attention on its RoPE layers (`Chunk`), NoPE layers with attention temperature
    # tuning (`temperature.py`), MoE with a shared expert
    "llama4_text": Family("llama4_text", mask_mapping=True),
    # Qwen2-VL's language model: a Qwen2 decoder whose rotary positions follow the image grid (engine/vision.py)
    "qwen2_vl_text": Family("qwen2_vl_text", mask_mapping=True),
    # mixture of experts: see the Family docstring (router aux loss: router.py)
    "qwen3_moe": Family("qwen3_moe", mask_mapping=False, uniform_window=True),
    "mixtral": Family("mixtral", mask_mapping=False, uniform_window=True),
    # registered after the family census (scripts/family_census.py); tiny configs: tiny_models.MORE_ATTENTION_ARCHS.
    # Ministral 3: YaRN and a query scale by position; OLMo 3 and EXAONE 4: sliding and full layers; SmolLM3: NoPE
    # layers; the MoE ones route per position, like Qwen3-MoE (GLM-4.5 and ERNIE 4.5 with shared experts and a
    # dense first layer)
    "ministral3": Family("ministral3", mask_mapping=False, uniform_window=True),
    "olmo3": Family("olmo3", mask_mapping=True),
    "smollm3": Family("smollm3", mask_mapping=True),
    "seed_oss": Family("seed_oss", mask_mapping=False, uniform_window=True),
    "exaone4": Family("exaone4", mask_mapping=True),
    "glm4_moe": Family("glm4_moe", mask_mapping=False, uniform_window=True),
    "minimax_m2": Family("minimax_m2", mask_mapping=False, uniform_window=True),
    "ernie4_5_moe": Family("ernie4_5_moe", mask_mapping=False, uniform_window=True),
    "hunyuan_v1_moe": Family("hunyuan_v1_moe", mask_mapping=False, uniform_window=True),
    # multi-head latent attention (engine/latent.py: a node holds its compressed latent and rotary key), DeepSeek
    # MoE (grouped sigmoid routing with a score correction bias, shared experts, dense first layers) and no router
    # loss (`NO_ROUTER_LOSS`); DeepSeek-V3's config is also Kimi K2's and Kimi K2.5's text model's
    "deepseek_v3": Family("deepseek_v3", mask_mapping=False),
    "glm4_moe_lite": Family("glm4_moe_lite", mask_mapping=False),
    # gpt-oss: alternating sliding / full layers, YaRN rotary (not length-dependent), MoE (router.py), and attention
    # sinks, which transformers runs eager only; split prefix attention carries them (attention.EAGER_SPLIT)
    "gpt_oss": Family("gpt_oss", mask_mapping=True),
    # Granite-SWA, GraniteMoE-SWA (attention sinks applied as a sigmoid scale of the output, which the engine's
    # masked path runs as transformers does) and Beam (DeepSeek-style grouped sigmoid routing, a query scale by
    # position): sliding and full layers, and transformers computes their softmax, sink scale, rotary, MLP or router
    # in float32 whatever the model dtype
    "granite_swa": Family("granite_swa", mask_mapping=True, float32_kernels=True),
    "granitemoe_swa": Family("granitemoe_swa", mask_mapping=True, float32_kernels=True),
    "beam": Family("beam", mask_mapping=True, float32_kernels=True),
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
    "qwen3_5_text": Family("qwen3_5_text", mask_mapping=False, recurrent=True, float32_kernels=True),
    "qwen3_5_moe_text": Family("qwen3_5_moe_text", mask_mapping=False, recurrent=True, float32_kernels=True),
    "lfm2_moe": Family("lfm2_moe", mask_mapping=False, recurrent=True),
    "lfm3": Family("lfm3", mask_mapping=False, recurrent=True),
    # Granite 4.0 hybrid (Mamba2 + attention, MoE), Zamba2 (Mamba2; shared attention blocks in "hybrid" layers),
    # Kimi Linear (Kimi delta attention + MLA, MoE), OLMo Hybrid (gated delta-net + attention)
    "granitemoehybrid": Family("granitemoehybrid", mask_mapping=True, recurrent=True, float32_kernels=True),
    "zamba2": Family("zamba2", mask_mapping=True, recurrent=True, float32_kernels=True),
    "kimi_linear": Family("kimi_linear", mask_mapping=True, recurrent=True, float32_kernels=True),
    "olmo_hybrid": Family("olmo_hybrid", mask_mapping=True, recurrent=True, float32_kernels=True),
}

SUPPORTED_ATTENTION = ("sdpa", "eager")

NO_ROUTER_LOSS = ("deepseek_v3", "glm4_moe_lite", "beam", "glm4_moe", "kimi_linear", "nemotron_h", "lfm2_moe",
                  "hunyuan_v1_moe")
"""MoE families whose transformers model computes no router load-balancing loss (auxiliary-loss-free balancing by
the router's `e_score_correction_bias`, adjusted outside the gradient, or none at all): their `ForCausalLM.forward`
never calls `load_balancing_loss_func`, so `output_router_logits` only records the logits, `family_of` does not refuse
it, and `router.RouterLoss` refuses these models (there is no loss to compute)."""


class Chunk(int):
    """A `layer_windows` entry for a chunked-attention layer (Llama 4's `attention_chunk_size` C): a query at position
    q sees the keys k with k // C == q // C and k <= q, a block-aligned window. An int (C), so that code asking only
    whether a layer is full (`w is None`) treats it as windowed; the prefix a pack keeps (`cache.kept_positions`),
    a node's kept state and the tree mask (`masks.tree_mask`) test `isinstance(w, Chunk)`. Unequal to a sliding
    window of the same length, so that the two keep apart as keys."""

    def __repr__(self) -> str:
        return f"Chunk({int(self)})"

    def __str__(self) -> str:  # formatted as the number of tokens
        return str(int(self))

    def __eq__(self, other) -> bool:
        return isinstance(other, Chunk) and int(self) == int(other)

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(("chunk", int(self)))


PER_LAYER_READ = ("head_dim", "num_key_value_heads")
"""The attributes a heterogeneous config (transformers' `per_layer_config`) may set per layer for the engine: it reads
them per layer (`models.head_dim`, `models.kv_heads`); any other per-layer attribute is refused (`family_of`)."""

def family_of(model, trusted: bool = False, router_loss: bool = False) -> Family:
    """The registry entry for `model`; with `trusted`, a family not in the registry gets `generic_family(model)`
    instead of a refusal, trusted: the caller checked it (the package's `replay_backward(force=True)` runs
    `self_check.check_once` first; the trainer its `train.unknown_family` check).
    `router_loss`: the caller computes the MoE router load-balancing loss (`router.RouterLoss`), so a config with
    `output_router_logits` is not refused.

    Raises:
        UnsupportedModelError: the family is not registered (and not `trusted`), the attention implementation cannot
            take a tree mask, the config asks for something the engine does not compute (the MoE router
            auxiliary loss, non-causal attention), an unregistered family's attention the engine cannot carry
            (ALiBi).
        ValueError: `trusted` is a string (e.g. the old "unchecked"), not True or False.
    """
    check_trusted(trusted)
    config = model.config
    model_type = config.model_type
    if model_type not in FAMILIES and not trusted:
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
    if getattr(config, "output_router_logits", False) and not router_loss and model_type not in NO_ROUTER_LOSS:
        raise UnsupportedModelError(
            f"{model_type}: config.output_router_logits is True, but this run does not compute the router "
            "load-balancing loss (branchreplay.trl's trainers do, engine.router.RouterLoss); set "
            "model.config.output_router_logits = False"
        )
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        raise UnsupportedModelError(f"{model_type}: bidirectional attention; the engine runs causal LMs only")
    if "is_decoder" in config.to_dict() and not config.is_decoder \
            and any(getattr(m, "is_causal", True) is False for m in model.modules()):
        raise UnsupportedModelError(
            f"{model_type}: config.is_decoder is False, so its attention is bidirectional (an encoder); the engine "
            "runs causal LMs only. Load it with is_decoder=True to run it as a decoder")
    if getattr(config, "_experts_implementation", None) in EXPERTS_WITHOUT_FLOAT64 \
            and next(model.parameters()).dtype == torch.float64:
        raise UnsupportedModelError(
            f"{model_type}: a float64 model whose experts run transformers' {config._experts_implementation} kernel, "
            "which refuses float64; call model.set_experts_implementation('eager') or load it with "
            "experts_implementation='eager' (branchreplay.models.load_model does)")
    per_layer = sorted(set(getattr(config, "per_layer_attributes", None) or ()) - set(PER_LAYER_READ))
    if per_layer:
        raise UnsupportedModelError(
            f"{model_type}: the config sets {', '.join(per_layer)} per layer (per_layer_config), which the engine "
            f"reads once for the model; only {', '.join(PER_LAYER_READ)} may vary per layer. Set them globally to run")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    return generic_family(model)


def check_trusted(value, name: str = "trusted") -> None:
    """Refuse a string `value` of the flag `name` (the engine's `trusted`, the package's `force`); a bool-like value
    is taken as its truth.

    Raises:
        ValueError: `value` is a string.
    """
    if isinstance(value, str):
        raise ValueError(f"{name}={value!r}: pass True (run a family outside the registry) or False")


def generic_family(model) -> Family:
    """A `Family` guessed for an unregistered model, used only under `trusted`: a decoder whose forward mentions a
    mask mapping takes one (as Qwen2 / Gemma do), else one 4D mask; `config.sliding_window` applies to every layer
    unless `config.layer_types` says which layers slide. A wrong guess shows up as an error in `branchreplay verify`
    (and in the self-check that runs before).

    Raises:
        UnsupportedModelError: the family is in `REFUSED`, the model has recurrent or hybrid layers
            (`refuse_recurrent`), or the decoder adds ALiBi biases (`_uses_alibi`).
    """
    config = model.config
    if config.model_type in REFUSED:
        raise UnsupportedModelError(
            f"{config.model_type}: {REFUSED[config.model_type]} (refused whatever `trusted` says)")
    refuse_recurrent(model)
    decoder, _, _ = decoder_and_head(model)
    source = _forward_source(decoder)
    if _uses_alibi(config, source):
        raise UnsupportedModelError(
            f"{config.model_type}: its attention adds ALiBi biases, which transformers builds from the 2D padding "
            "mask of the whole sequence (`build_alibi_tensor`); the engine hands each node a 4D tree mask and a "
            "prefix cache instead, so it cannot run this model exactly (refused whatever `trusted` says). Models "
            "with rotary or learned positions run; ALiBi families are not supported")
    mask_mapping = "mask_mapping" in source if source else getattr(config, "layer_types", None) is not None
    return Family(config.model_type, mask_mapping=mask_mapping,
                  uniform_window=getattr(config, "layer_types", None) is None)


REFUSED: dict[str, str] = {
    "diffllama": "its differential attention splits the values into two halves inside the layer, after the cache, "
                 "and attends twice; the engine hands a pack its prefix's cached values whole, so the prefix part of "
                 "each attention would be wrong. Registering it needs the split in engine/attention.py",
    "dory": "it loops its middle layers (config.n_recurrent_loops), each loop with its own K/V cache and a reader of "
            "the previous loop's; the engine's prefix cache holds one K/V per layer, so a branch would see the "
            "wrong loop's keys. Registering it needs a cache per loop",
}
"""Unregistered families whose attention the generic path cannot carry, refused by name with the reason
(`generic_family`); found by the family census (scripts/family_census.py)."""

RECURRENT_CONFIG_KEYS = ("state_size", "ssm_state_size", "mamba_d_state", "conv_kernel", "conv_L_cache",
                         "linear_num_value_heads", "d_state", "time_step_rank",
                         "attention_hidden_size",  # RWKV's time mixing
                         "return_last_states")  # xLSTM's mLSTM state
"""Config fields of recurrent layers (SSM state, short convolutions, linear attention) in transformers' configs."""


def refuse_recurrent(model) -> None:
    """Refuse by name an unregistered model with recurrent or hybrid layers: `config.layer_types` entries other than
    "full_attention" / "sliding_attention", a field of `RECURRENT_CONFIG_KEYS`, or torch Conv1d modules. Their state
    cannot be guessed (a guessed `Family` would hand the decoder a mask mapping without "linear_attention" and run
    siblings in one scan), so such a model is refused whatever `trusted` or the self-check say.

    Raises:
        UnsupportedModelError: naming the family and what marks it recurrent.
    """
    config = model.config
    layer_types = set(getattr(config, "layer_types", None) or ())
    unknown_layers = layer_types - {"full_attention", "sliding_attention", "chunked_attention"}
    recurrent_keys = [k for k in RECURRENT_CONFIG_KEYS if getattr(config, k, None) is not None]
    convs = any(isinstance(m, torch.nn.Conv1d) for m in model.modules())
    if unknown_layers or recurrent_keys or convs:
        what = sorted(unknown_layers) or recurrent_keys or ["Conv1d modules"]
        raise UnsupportedModelError(
            f"{config.model_type}: not in the engine's registry and has recurrent or hybrid layers ({', '.join(what)}):"
            " an unknown family's recurrent state cannot be guessed, so it is refused even with "
            "train.unknown_family='self-check' or the package's force=True; registering it needs its state in "
            "engine/recurrent.py")


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
    in transformers' `sliding_window_overlay`), a `Chunk` for chunked attention, or None for full attention. From
    `config.layer_types` when the config has it ("sliding_attention" layers slide, "chunked_attention" layers see
    their `config.attention_chunk_size` block), else `config.sliding_window` for every layer in a `uniform_window`
    family (an unregistered family counts as one)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        chunk = getattr(config, "attention_chunk_size", None)
        chunk = Chunk(chunk) if chunk else None
        return [window if t == "sliding_attention" else chunk if t == "chunked_attention" else None
                for t in layer_types[:n]]
    family = FAMILIES.get(config.model_type)
    if family is None or family.uniform_window:
        return [window] * n
    return [None] * n


def state_bytes_per_token(config, dtype) -> tuple[int, int]:
    """The attention state a branch holds for its prefix: (bytes per prefix token over the full-attention layers,
    the most bytes the sliding-window layers ever hold together, whatever the prefix length).

    Per attention layer and kept position: keys and values, 2 * num_key_value_heads * head_dim elements of `dtype`
    (a torch.dtype); multi-head latent attention: kv_lora_rank + qk_rope_head_dim (`latent_state_width`). A full
    layer keeps every prefix position; a sliding layer at most window - 1 of them
    (`cache.kept_positions`), a chunked one at most chunk - 1; with each layer's K/V heads and head_dim
    (`models.kv_heads`, `models.head_dim`). Recurrent layers (`recurrent.py`) and layers that reuse an earlier
    layer's K/V (stateless) are not counted here."""
    n = config.num_hidden_layers
    attention = attention_layers(config)
    if not any(attention):  # Mamba, Mamba2: no attention fields in the config
        return 0, 0
    size = torch.empty((), dtype=dtype).element_size()
    per_position = [2 * kv_heads(config, i) * head_dim(config, i) * size if a else 0 for i, a in enumerate(attention)]
    if latent_state_width(config) is not None:  # MLA: the compressed latent and the rotary key, not K and V
        per_position = [latent_state_width(config) * size if a else 0 for a in attention]
    windows = layer_windows(config)
    full = sum(b for w, b in zip(windows[:n], per_position, strict=True) if w is None)
    sliding = sum(b * (w - 1) for w, b in zip(windows[:n], per_position, strict=True) if w is not None)
    return full, sliding


def latent_state_width(config) -> int | None:
    """Elements per position and attention layer of a multi-head latent attention model's cached state (`latent.py`),
    kv_lora_rank + qk_rope_head_dim; None for a config without latent attention (no `kv_lora_rank`)."""
    rank = getattr(config, "kv_lora_rank", None)
    if rank is None:
        return None
    return rank + config.qk_rope_head_dim


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
