"""Tiny random models of real Hugging Face architectures, for tests, `verify --arch` and the benchmarks: each
family's own config class with transformers' defaults, only the sizes shrunk (`tiny_config`), and the two
vision-language models the image tests run (Gemma3, Qwen2-VL)."""

import torch
import transformers
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

TINY_ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "gemma2", "gemma3", "qwen2-sliding",
                               "qwen3_moe", "mixtral", "phi3")
RECURRENT_ARCHS: tuple[str, ...] = ("mamba", "mamba2", "bamba", "falcon_h1", "jamba", "nemotron_h", "lfm2",
                                    "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "lfm2_moe", "lfm3",
                                    "granitemoehybrid", "zamba2", "kimi_linear", "olmo_hybrid")
"""SSM / linear-attention / hybrid tiny configs (engine/recurrent.py); kept apart from TINY_ARCHS, whose tests assume
attention-only models with float64-exact kernels."""
MLA_ARCHS: tuple[str, ...] = ("deepseek_v3", "glm4_moe_lite")
"""Multi-head latent attention families (engine/latent.py), with DeepSeek-style MoE (sigmoid router with a score
correction bias, shared experts, a dense first layer); kept apart from TINY_ARCHS: their routers compute in float32."""

SINK_ARCHS: tuple[str, ...] = ("gpt_oss",)
"""Families with attention sinks (gpt-oss: eager attention only in transformers, YaRN, MoE); kept apart from
TINY_ARCHS, whose shared tests assume 4096 positions (gpt-oss's YaRN factor ties them to its original context) and
SDPA-capable classes; their own tests: tests/test_engine_families_gpt_oss.py."""

_TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=4096, tie_word_embeddings=False, attention_dropout=0.0,
             initializer_range=0.2,  # std 0.2: logits far from uniform, so gradients are not vanishingly small
             bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary (gpt2's default 50256 is not)
_ARCH_EXTRA = {
    "llama": {},
    "qwen2": dict(use_sliding_window=False),
    "qwen3": dict(use_sliding_window=False),
    "mistral": dict(sliding_window=16),  # shorter than test sequences, so the window is exercised
    "phi3": dict(sliding_window=None, pad_token_id=0),  # full attention; rotary types: test_engine_positions
    # Gemma2: alternating sliding / full layers, attention and final logit softcapping (caps small enough to bend
    # the tiny model's logits), query scaling 1 / sqrt(head_dim)
    "gemma2": dict(sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                   final_logit_softcapping=10.0),
    # Gemma3 (text only): sliding and global layers (pattern 2: sliding, full, sliding, ...), each with its RoPE
    "gemma3": dict(sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=16),
    # Qwen2 with its sliding layers on: layers >= max_window_layers slide
    "qwen2-sliding": dict(use_sliding_window=True, sliding_window=12, max_window_layers=1),
    # mixture of experts: 4 experts, top 2, no router aux loss; Mixtral with a sliding window on every layer
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, use_sliding_window=False,
                      output_router_logits=False, experts_implementation="eager"),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16, output_router_logits=False,
                    router_jitter_noise=0.0, experts_implementation="eager"),
    # gpt-oss: attention sinks, alternating sliding (window 8) / full layers, YaRN as gpt-oss ships it with its
    # original context shrunk to 16 positions, 4 experts top 2 (eager experts: grouped_mm refuses float64)
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=8,
                    max_position_embeddings=512,  # 32 x 16, as gpt-oss: 131072 = 32 x 4096
                    output_router_logits=False, experts_implementation="eager",
                    rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=16, rope_theta=150000.0)),
    # Recurrent and hybrid families: small states, conv kernels and SSM chunks (8 tokens, so test nodes cross chunk
    # boundaries), both layer types present where the family has two.
    "mamba": dict(state_size=8, conv_kernel=4, time_step_rank=8),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=2, state_size=8, conv_kernel=4, chunk_size=8),
    "bamba": dict(num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
                  mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8),
    "falcon_h1": dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
                      mamba_d_conv=4, mamba_chunk_size=8,  # every layer: attention and Mamba2 side by side
                      lm_head_multiplier=0.5, ssm_in_multiplier=1.5),  # muP multipliers != 1, as in the checkpoints
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_dt_rank=8,
                  output_router_logits=False, experts_implementation="eager"),  # grouped_mm refuses float64
    # one layer of each kind: Mamba2, attention, MoE (4 routed experts, top 2, a shared expert), MLP
    "nemotron_h": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "full_attention", "moe", "mlp"],
                       mamba_num_heads=8,
                       mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8,
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       moe_shared_expert_intermediate_size=64, experts_implementation="eager"),
    "lfm2": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3),
    # gated delta-net + attention, MoE MLPs; the delta rule's chunk is 64 tokens (fixed in transformers)
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       output_router_logits=False, experts_implementation="eager"),
    # Qwen3.5 (text): gated delta-net + output-gated attention with partial rotary (a quarter of head_dim), the MoE
    # variant with a shared expert; the delta rule's chunk is 64 tokens (fixed in transformers)
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_conv_kernel_dim=4),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                             shared_expert_intermediate_size=64, output_router_logits=False,
                             experts_implementation="eager"),
    # LFM2-MoE: short conv + attention, a dense first layer then MoE layers (expert bias in the routing)
    "lfm2_moe": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
                     num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                     output_router_logits=False, experts_implementation="eager"),
    # LFM3: short conv, sliding and full attention layers (proportional partial rotary on the full ones), sandwich
    # norms and an attention output gate
    "lfm3": dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "sliding_attention"],
                 conv_L_cache=3, sliding_window=8, pad_token_id=0),
    # Granite 4.0 (hybrid): Mamba2 + attention layers (NoPE, transformers' default), MoE with a shared MLP in every
    # layer, muP multipliers != 1 as in the checkpoints
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], mamba_n_heads=8, mamba_d_head=16,
                             mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8,
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                             embedding_multiplier=2.0, logits_scaling=2.0, residual_multiplier=0.5,
                             attention_multiplier=0.125, output_router_logits=False, experts_implementation="eager"),
    # Zamba2: Mamba2 layers, two of them behind one shared transformer block (per-use LoRA adapters, RoPE; transformers
    # ties the shared blocks only with tie_word_embeddings, as Zamba2 ships); its attention width is 2 * hidden
    # (head_dim 2 * hidden / heads, as Zamba2Config sets it) and its adapters need as many K/V heads as heads
    "zamba2": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"], head_dim=32,
                   tie_word_embeddings=True, num_key_value_heads=4, n_mamba_heads=8, mamba_ngroups=2, mamba_d_state=8,
                   mamba_d_conv=4, chunk_size=8, use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True),
    # Kimi Linear: Kimi delta attention (per-channel decay) + MLA (no rotary: it caches the compressed latent and
    # the shared key part), a dense first layer then MoE with a shared expert; MLA expands K/V to every head
    "kimi_linear": dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                        num_key_value_heads=4, linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
                        kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=64, output_router_logits=False,
                        experts_implementation="eager", pad_token_id=0),
    # OLMo Hybrid: gated delta-net (negative eigenvalues allowed) + attention with QK norm
    "olmo_hybrid": dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_conv_kernel_dim=4, pad_token_id=0),
}
# Multi-head latent attention: q / kv low-rank projections, rotary, no-rotary and value head dims all different
# (K and V of other widths), 4 routed experts top 2 plus a shared expert, one dense layer then one MoE layer; the
# score correction bias is drawn at random by `tiny_model` (transformers starts it at zero: it would route nothing)
_MLA = dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
            head_dim=8,  # the rotary's width: the config sets it to qk_rope_head_dim, unless given
            n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, output_router_logits=False,
            experts_implementation="eager")
_ARCH_EXTRA["deepseek_v3"] = dict(_MLA, qk_nope_head_dim=12, v_head_dim=10, n_group=2, topk_group=1,
                                  first_k_dense_replace=1)  # v narrower than q / k
_ARCH_EXTRA["glm4_moe_lite"] = dict(_MLA, qk_nope_head_dim=6, v_head_dim=16, n_group=1, topk_group=1,
                                    mlp_layer_types=["dense", "sparse"])  # v wider than q / k
MIXED_LAYER_ARCHS: tuple[str, ...] = ("gemma4", "llama4")
"""Gemma 4 and Llama 4 text models (Gemma4ForCausalLM, Llama4ForCausalLM), 4 layers of different shapes or kinds;
kept apart from TINY_ARCHS, whose tests assume 2 uniform layers."""
# Gemma 4: sliding (window 8, head_dim 16, 2 K/V heads) and full layers (head_dim 32, 1 K/V head, keys as values),
# the last two layers reusing the first two's K/V (double-wide MLPs there), per-layer token inputs, MoE blocks
# beside the MLP, final logit softcapping
_ARCH_EXTRA["gemma4"] = dict(
    num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8, head_dim=16,
    global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
    use_double_wide_mlp=True, vocab_size_per_layer_input=256, hidden_size_per_layer_input=8, enable_moe_block=True,
    num_experts=4, top_k_experts=2, moe_intermediate_size=32, experts_implementation="eager",
    final_logit_softcapping=10.0, pad_token_id=0)
# Llama 4: chunked attention (chunks of 8) on the RoPE layers 0 and 2, NoPE layers 1 and 3 with temperature tuning
# (floor_scale 8: shrunk like the lengths, so that it acts), QK norm, MoE (4 experts, top 1, a shared expert) on the
# NoPE layers
_ARCH_EXTRA["llama4"] = dict(
    num_hidden_layers=4, intermediate_size=64, intermediate_size_mlp=128, num_local_experts=4,
    interleave_moe_layer_step=2, attention_chunk_size=8, no_rope_layers=[1, 0, 1, 0], floor_scale=8,
    output_router_logits=False, router_jitter_noise=0.0, experts_implementation="eager")
MORE_ATTENTION_ARCHS: tuple[str, ...] = ("ministral3", "olmo3", "smollm3", "seed_oss", "exaone4", "glm4_moe",
                                         "minimax_m2", "ernie4_5_moe", "hunyuan_v1_moe", "granite_swa",
                                         "granitemoe_swa", "beam")
"""Attention families registered after the family census (scripts/family_census.py): their own tests
(tests/test_engine_families_more.py) run fewer trees than TINY_ARCHS' shared ones. The MoE ones route with
4 experts, top 2, eager experts, a shared expert and a dense first layer where the family has them."""
_ARCH_EXTRA.update(
    # YaRN, and Llama 4's query scaling by position (1 + beta log(1 + floor(position / original))): an original
    # context of 16 positions, so that test trees cross its steps
    ministral3=dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=256.0,
                                         original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                                         mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)),
    olmo3=dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    smollm3=dict(no_rope_layers=[1, 0], pad_token_id=0),  # layer 1 is a NoPE layer: branches cross it
    seed_oss={},
    exaone4=dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    glm4_moe=dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
                  first_k_dense_replace=1, output_router_logits=False, experts_implementation="eager"),
    minimax_m2=dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=False, router_jitter_noise=0.0,
                    experts_implementation="eager"),
    ernie4_5_moe=dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=64, moe_num_shared_experts=1,
                      moe_layer_start_index=1, output_router_logits=False, experts_implementation="eager"),
    hunyuan_v1_moe=dict(num_experts=4, moe_topk=2, output_router_logits=False, experts_implementation="eager"),
    granite_swa=dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8),
    granitemoe_swa=dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8, num_local_experts=4,
                        num_experts_per_tok=2, output_router_logits=False, experts_implementation="eager"),
    beam=dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8,
              mlp_layer_types=["dense", "sparse"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
              n_group=2, topk_group=1, output_router_logits=False, experts_implementation="eager"),
)
ALL_TINY_ARCHS = TINY_ARCHS + RECURRENT_ARCHS + MLA_ARCHS + MIXED_LAYER_ARCHS + SINK_ARCHS + MORE_ATTENTION_ARCHS
"""Every tiny config (`tiny_config`, `verify --arch`)."""
_NO_ATTENTION = ("mamba", "mamba2")  # transformers refuses an attn_implementation for these
_MODEL_TYPE = {"gemma3": "gemma3_text", "qwen2-sliding": "qwen2",  # tiny arch -> HF model_type, where they differ
               "gemma4": "gemma4_text", "llama4": "llama4_text"}
_GPT2_NAMES = dict(hidden_size="n_embd", num_hidden_layers="n_layer", num_attention_heads="n_head",
                   max_position_embeddings="n_positions", intermediate_size="n_inner")


def tiny_config(arch: str, **overrides) -> PretrainedConfig:
    """Tiny config of a real HF causal-LM architecture (arch in TINY_ARCHS).

    Defaults: vocab 256, hidden 64, 2 layers, 4 heads (2 KV heads except gpt2, which has no GQA), MLP 128,
    4096 positions, untied embeddings, no dropout, initializer_range 0.2; mistral has sliding_window=16;
    gemma2, gemma3 (Gemma3ForCausalLM), qwen2-sliding (a Qwen2 with sliding layers), qwen3_moe and mixtral (4
    experts, top 2, mixtral with sliding_window=16) are set up in `_ARCH_EXTRA`.
    `overrides` are config fields (e.g. hidden_size=256, num_hidden_layers=4); for gpt2 the Llama-style names
    hidden_size, num_hidden_layers, num_attention_heads, max_position_embeddings, intermediate_size are mapped
    to n_embd, n_layer, n_head, n_positions, n_inner. head_dim follows hidden_size // num_attention_heads where
    the family's config has the field.
    RECURRENT_ARCHS and SINK_ARCHS (gpt-oss) take the same defaults plus their sizes in `_ARCH_EXTRA`. Of the shared
    defaults only the fields the family's own config class has are set (Mamba's and Mamba2's have no attention
    fields), so the config is the family's, with transformers' defaults, only shrunk.
    Raises ValueError for an unknown arch, or num_key_value_heads != num_attention_heads for gpt2.
    """
    if arch not in ALL_TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ALL_TINY_ARCHS}")
    default = AutoConfig.for_model(_MODEL_TYPE.get(arch, arch)) if arch != "gpt2" else None
    shared = _TINY if default is None else {k: v for k, v in _TINY.items() if _has_field(default, k)}
    kw = {**shared, **_ARCH_EXTRA.get(arch, {}), **overrides}
    if arch == "gpt2":
        if overrides.get("num_key_value_heads", kw["num_attention_heads"]) != kw["num_attention_heads"]:
            raise ValueError("gpt2 has no grouped-query attention: num_key_value_heads must equal num_attention_heads")
        kw = {_GPT2_NAMES.get(k, k): v for k, v in kw.items() if k not in ("num_key_value_heads", "attention_dropout")}
        no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
        kw = {**no_dropout, **kw}
        return transformers.GPT2Config(**kw)
    if "num_attention_heads" in kw and _has_field(default, "head_dim"):
        kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    return AutoConfig.for_model(_MODEL_TYPE.get(arch, arch), **kw)


def _has_field(config: PretrainedConfig, name: str) -> bool:
    """Whether the config has field `name`, globally or per layer (Gemma 4's head_dim: reading it raises)."""
    return name in (getattr(config, "per_layer_attributes", None) or ()) or hasattr(config, name)


def attention_for(config: PretrainedConfig, requested: str | None) -> str | None:
    """`requested`, or "eager" where the model class cannot run SDPA (Gemma2: attention logit softcapping)."""
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if requested == "sdpa" and cls is not None and not cls._supports_sdpa:
        return "eager"
    return requested


def tiny_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, attn_implementation: str = "sdpa",
               **overrides) -> PreTrainedModel:
    """Randomly initialised tiny causal LM (see tiny_config), in eval mode, parameters in `dtype`.

    Weights are drawn in float32 under torch.manual_seed(seed) (the caller's RNG state is restored), then cast,
    so the same seed gives the same weights in every dtype. A family without SDPA (gemma2) gets eager attention.
    MLA_ARCHS: the routers' `e_score_correction_bias` is drawn too, N(0, 0.1^2) (transformers starts it at zero).
    Raises ValueError for an unknown arch.
    """
    config = tiny_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        impl = None if arch in _NO_ATTENTION else attention_for(config, attn_implementation)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32)
        if arch in MLA_ARCHS:  # the routers' score correction bias, as a trained checkpoint ships one
            for name, bias in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    bias.normal_(0.0, 0.1)
    return model.to(dtype).eval()


def tiny_vision_model(dtype: torch.dtype = torch.float32, seed: int = 0, vocab_size: int = 256,
                      image_token_id: int = 250, boi_token_id: int = 251, eoi_token_id: int = 252,
                      **text_overrides) -> PreTrainedModel:
    """Randomly initialised tiny Gemma3ForConditionalGeneration (vision-language), in eval mode, parameters in
    `dtype`, drawn as `tiny_model`'s. Its text model is `tiny_config("gemma3")` (sliding and full layers, sliding
    window 8) with `text_overrides`; its vision tower a 2-layer SigLIP of hidden 16 without the pooling head (as
    Gemma3's) on 56 x 56 images in 14-pixel patches (16 patches), pooled 2 x 2 into 4 image tokens per image
    (`mm_tokens_per_image`), projected by a random matrix. The placeholder, begin- and end-of-image ids are inside
    the vocabulary."""
    text = tiny_config("gemma3", vocab_size=vocab_size, **text_overrides).to_dict()
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=56,
                  patch_size=14, attention_dropout=0.0, vision_use_head=False)  # Gemma3's: no pooling head
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_id=image_token_id, boi_token_id=boi_token_id,
                                       eoi_token_id=eoi_token_id, initializer_range=0.2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Gemma3ForConditionalGeneration._from_config(config, attn_implementation="sdpa",
                                                                         dtype=torch.float32)
        # transformers starts the projector at zero (images then carry no signal, the vision tower no gradient)
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.2)
    return model.to(dtype).eval()


IMAGE_TOKENS = {"image_token": "<img>", "boi_token": "<boi>", "eoi_token": "<eoi>"}
"""Gemma3's image placeholder, begin- and end-of-image tokens, as `save_tiny_vision_model` adds them."""
IMAGE_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'image' %}<boi>{% else %}{{ c.text }}{% endif %} {% endfor %}{% endif %}{% endfor %}")
"""A chat template for messages whose content is a string or a list of text and image items (<boi> per image)."""


def save_tiny_vision_model(path, tokenizer_folder, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Save under `path` a `tiny_vision_model` and a local Gemma3Processor for it (nothing downloaded, no
    torchvision): the tokenizer of `tokenizer_folder` with `IMAGE_TOKENS` added, padding on the left (TRL pairs the
    processor's token_type_ids with its left-padded prompts), `IMAGE_CHAT_TEMPLATE`; a PIL image processor to
    56 x 56 and 4 image tokens per image. The model's vocabulary and image token ids follow the tokenizer.
    Returns the processor."""
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, extra_special_tokens=IMAGE_TOKENS,
                                              padding_side="left")
    tokenizer.chat_template = IMAGE_CHAT_TEMPLATE
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 56, "width": 56}),
                                tokenizer=tokenizer, image_seq_length=4, chat_template=IMAGE_CHAT_TEMPLATE)
    model = tiny_vision_model(dtype, seed, vocab_size=len(tokenizer), image_token_id=tokenizer.image_token_id,
                              boi_token_id=tokenizer.boi_token_id, eoi_token_id=tokenizer.eoi_token_id,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return processor


# -----------------------------------------------------------------------------
# any causal-LM family of the installed transformers, shrunk (scripts/family_census.py)

_SHRUNK = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               intermediate_size=128, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
               moe_num_experts=4, moe_topk=2, rotary_dim=8, n_shared_experts=1, unpadded_vocab_size=256,
               index_num_heads=1,
               moe_intermediate_size=64, shared_expert_intermediate_size=64, moe_shared_expert_intermediate_size=64,
               max_position_embeddings=4096, initializer_range=0.2, kv_lora_rank=32, q_lora_rank=32,
               qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
               state_size=8, ssm_state_size=8, mamba_d_state=8, d_state=8, conv_kernel=4, mamba_d_conv=4,
               linear_conv_kernel_dim=4, chunk_size=8, mamba_chunk_size=8, time_step_rank=8, mamba_dt_rank=8,
               mamba_n_heads=8, mamba_num_heads=8, mamba_d_head=16, mamba_head_dim=16, mamba_n_groups=2,
               n_groups=2, mamba_d_ssm=128, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=16, output_router_logits=False,
               router_jitter_noise=0.0, experts_implementation="eager", bos_token_id=1, eos_token_id=2)
"""`shrunk_config`'s sizes, each set only where the family's default config has the field."""
_SET_WHEN_NONE = ("bos_token_id", "eos_token_id", "head_dim", "num_key_value_heads", "num_experts", "n_routed_experts",
                  "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts")
"""`_SHRUNK` fields set even where the default is None (derived from others, or unset in the family's default);
any other field None by default stays None (q_lora_rank None: no low-rank query projection)."""
_FEWER_LAYERS = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")
"""Counts of leading layers of one kind (dense MLPs before MoE): at most 1, so that both kinds remain."""


def shrunk_config(model_type: str, max_layers: int = 4, **overrides) -> PretrainedConfig:
    """The config of any causal-LM `model_type` of the installed transformers, its own config class
    (`AutoConfig.for_model`) with transformers' defaults, only shrunk. A family with a tiny config here
    (`_ARCH_EXTRA`, under its model type or its arch of `_MODEL_TYPE`) gets `tiny_config`'s, with `overrides`.
    Any other: each field of `_SHRUNK` the default config has and can set (vocab 256, hidden 64, 4 heads, 2 KV
    heads, head_dim 16, MLP 128, MoE 4 experts top 2 of 64, small SSM / conv / MLA / rotary sizes, 4096 positions,
    initializer_range 0.2, bos 1 / eos 2, no router logits or jitter, eager experts: transformers' grouped_mm
    refuses float64 on the CPU), dropouts 0, token ids past the vocabulary moved inside it, a positive sliding
    window or attention chunk 16 (shorter than test sequences), then `overrides`. A size whose default is already
    smaller keeps it (one K/V head, one expert per token).
    Layers: 2, or one per distinct kind of layer (up to `max_layers`): the per-layer lists of the default config
    (layer_types, mlp_layer_types, no_rope_layers, ...: a list or string as long as num_hidden_layers) are cut to
    the first layer of each distinct combination, then the next layers, so that the layer pattern stays the
    family's; lists of layer indices (moe_layers, full_attn_idxs, ...) are renumbered alike; leading-dense-layer
    counts are at most 1. A per-layer list that `overrides` sets fixes the number of layers to its length.
    Raises what transformers raises for a config it cannot build (a composite config, a field it validates)."""
    arch = next((a for a in (model_type, *_MODEL_TYPE) if a in _ARCH_EXTRA and a != "qwen2-sliding"
                 and _MODEL_TYPE.get(a, a) == model_type), None)
    if arch is not None:
        try:
            return tiny_config(arch, **overrides)
        except ValueError as e:
            if "unknown tiny arch" not in str(e):
                raise
    default = AutoConfig.for_model(model_type)
    kw = {k: v for k, v in _SHRUNK.items() if _settable(default, k) and (
        k in _SET_WHEN_NONE or _default_of(default, k) is not None)}
    for k, v in kw.items():  # only shrunk: a default already smaller stays (one K/V head, one expert per token)
        current = _default_of(default, k)
        if isinstance(v, int) and isinstance(current, int) and not isinstance(current, bool) and current < v \
                and k not in _SET_WHEN_NONE[:2]:
            kw[k] = current
    if _settable(default, "kv_lora_rank"):  # multi-head latent attention: as many K/V heads as query heads
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    fields = default.to_dict()
    for k, v in fields.items():
        if isinstance(v, float) and v > 0 and ("dropout" in k or k.endswith("_pdrop")):
            kw[k] = 0.0
        elif k.endswith("token_id") and isinstance(v, int) and v >= 256 and k not in kw:
            kw[k] = 3
        elif k in ("sliding_window", "sliding_window_size", "attention_chunk_size") and isinstance(v, int) and v > 16:
            kw[k] = 16
        elif k in _FEWER_LAYERS and isinstance(v, int) and v > 1:
            kw[k] = 1
    n = _default_of(default, "num_hidden_layers")
    given = [len(v) for k, v in overrides.items() if isinstance(v, (list, tuple, str)) and k in fields
             and isinstance(fields[k], (list, tuple, str)) and isinstance(n, int) and len(fields[k]) == n]
    layers = overrides.get("num_hidden_layers", given[0] if given else None)
    if isinstance(n, int) and n > 2:
        kw.update(_fewer_layers(fields, n, layers or max_layers, fixed=layers is not None))
    return AutoConfig.for_model(model_type, **{**kw, **overrides})


def _default_of(config: PretrainedConfig, name: str):
    """The config's value of `name`; "per layer" where reading it raises (a per-layer attribute), None if absent."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError and the like
        return "per layer"


def _settable(config: PretrainedConfig, name: str) -> bool:
    """Whether the config has field `name` (`_has_field`) and it is no read-only property (Falcon's head_dim)."""
    attribute = getattr(type(config), name, None)
    return _has_field(config, name) and not (isinstance(attribute, property) and attribute.fset is None)


def _fewer_layers(fields: dict, n: int, layers: int, fixed: bool = False) -> dict:
    """num_hidden_layers and the per-layer fields of `shrunk_config`: the kept layers of the default's n."""
    per_layer = {k: v for k, v in fields.items() if isinstance(v, (list, tuple)) and len(v) == n
                 and not _is_index_list(k, v, n)
                 or isinstance(v, str) and len(v) == n and ("pattern" in k or "layer" in k)}
    index_lists = {k: v for k, v in fields.items() if isinstance(v, (list, tuple)) and _is_index_list(k, v, n)}
    kinds, kept = set(), []
    for i in range(n):
        kind = tuple(str(v[i]) for v in per_layer.values()) + tuple(i in v for v in index_lists.values())
        if kind not in kinds:
            kinds.add(kind)
            kept.append(i)
    kept = sorted(kept[:layers] + [i for i in range(n) if i not in kept][:max(0, (layers if fixed else 2)
                                                                                   - len(kept))])
    out = {"num_hidden_layers": len(kept)}
    for k, v in per_layer.items():
        picked = [v[i] for i in kept]
        out[k] = "".join(picked) if isinstance(v, str) else type(v)(picked)
    for k, v in index_lists.items():
        out[k] = [j for j, i in enumerate(kept) if i in v]
    return out


def _is_index_list(name: str, value, n: int) -> bool:
    """A list of layer indices (moe_layers, full_attn_idxs, attn_layer_indices), not one value per layer."""
    return (("idx" in name or "indices" in name or name == "moe_layers")
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in value))
