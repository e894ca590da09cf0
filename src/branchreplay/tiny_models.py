"""Tiny random models of real Hugging Face architectures, for tests, `verify --arch` and the benchmarks: each
family's own config class with transformers' defaults, only the sizes shrunk (`tiny_config`), and the two
vision-language models the image tests run (Gemma3, Qwen2-VL)."""

import torch
import transformers
from transformers import (MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig,
                          PreTrainedModel)


TINY_ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "gemma2", "gemma3", "qwen2-sliding",
                               "qwen3_moe", "mixtral", "phi3")
RECURRENT_ARCHS: tuple[str, ...] = ("mamba", "mamba2", "bamba", "falcon_h1", "jamba", "nemotron_h", "lfm2",
                                    "qwen3_next")
"""SSM / linear-attention / hybrid tiny configs (engine/recurrent.py); kept apart from TINY_ARCHS, whose tests assume
attention-only models with float64-exact kernels."""

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
}
_NO_ATTENTION = ("mamba", "mamba2")  # transformers refuses an attn_implementation for these
_MODEL_TYPE = {"gemma3": "gemma3_text", "qwen2-sliding": "qwen2"}  # tiny arch -> HF model_type, where they differ
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
    RECURRENT_ARCHS take the same defaults plus the small SSM / conv sizes of `_ARCH_EXTRA`. Of the shared
    defaults only the fields the family's own config class has are set (Mamba's and Mamba2's have no attention
    fields), so the config is the family's, with transformers' defaults, only shrunk.
    Raises ValueError for an unknown arch, or num_key_value_heads != num_attention_heads for gpt2.
    """
    if arch not in TINY_ARCHS + RECURRENT_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {TINY_ARCHS + RECURRENT_ARCHS}")
    default = AutoConfig.for_model(_MODEL_TYPE.get(arch, arch)) if arch != "gpt2" else None
    shared = _TINY if default is None else {k: v for k, v in _TINY.items() if hasattr(default, k)}
    kw = {**shared, **_ARCH_EXTRA.get(arch, {}), **overrides}
    if arch == "gpt2":
        if overrides.get("num_key_value_heads", kw["num_attention_heads"]) != kw["num_attention_heads"]:
            raise ValueError("gpt2 has no grouped-query attention: num_key_value_heads must equal num_attention_heads")
        kw = {_GPT2_NAMES.get(k, k): v for k, v in kw.items() if k not in ("num_key_value_heads", "attention_dropout")}
        no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
        kw = {**no_dropout, **kw}
        return transformers.GPT2Config(**kw)
    if "num_attention_heads" in kw and hasattr(default, "head_dim"):
        kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    return AutoConfig.for_model(_MODEL_TYPE.get(arch, arch), **kw)


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
    Raises ValueError for an unknown arch.
    """
    config = tiny_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        impl = None if arch in _NO_ATTENTION else attention_for(config, attn_implementation)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32)
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


def tiny_qwen2_vl_model(dtype: torch.dtype = torch.float32, seed: int = 0, vocab_size: int = 256,
                        image_token_id: int = 250, vision_start_token_id: int = 251, video_token_id: int = 253,
                        **text_overrides) -> PreTrainedModel:
    """Randomly initialised tiny Qwen2VLForConditionalGeneration (vision-language, rotary positions on the image
    grid), in eval mode, parameters in `dtype`, drawn as `tiny_model`'s. Its text model has `tiny_config("qwen2")`'s
    sizes (head_dim 16: multimodal rotary sections [4, 2, 2] over temporal, height, width) with `text_overrides`;
    its vision tower 2 blocks of width 16 on patches of 2 x 2 pixels x 2 frames, merged 2 x 2: an image of grid
    (1, h, w) patches gives h * w / 4 placeholder tokens (pixel_values [h * w, 24] per image). The placeholder,
    vision-start and video ids are inside the vocabulary."""
    text = {k: v for k, v in tiny_config("qwen2", vocab_size=vocab_size, **text_overrides).to_dict().items()
            if k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", *text_overrides)}
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
                bos_token_id=1, eos_token_id=2)
    vision = dict(depth=2, embed_dim=16, hidden_size=text["hidden_size"], num_heads=2, mlp_ratio=2, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=image_token_id,
                                        vision_start_token_id=vision_start_token_id, video_token_id=video_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2VLForConditionalGeneration._from_config(config, attn_implementation="sdpa",
                                                                          dtype=torch.float32)
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
