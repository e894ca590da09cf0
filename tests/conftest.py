"""Shared test fixtures: tiny random models under float64 numerics, torch on one thread, a tiny model folder.
Helpers that tests import are in helpers.py.

Every exactness test compares the engine with the naive reference (`branchreplay.reference.naive`) on the same
model; float64 models run under `keep_float64` (HF's RMSNorm and a few softmaxes cast to float32 otherwise, on both
sides alike), held for the test and restored after it.
"""

import contextlib

import pytest
import torch

from branchreplay.reference.float64 import keep_float64
from branchreplay.tiny_models import tiny_model


@pytest.fixture
def keep64():
    """keep64(model) -> model: `keep_float64` on `model` until the test ends, then restored."""
    with contextlib.ExitStack() as stack:

        def keep(model):
            stack.enter_context(keep_float64(model))
            return model

        yield keep


@pytest.fixture
def tiny64(keep64):
    """tiny64(arch, dtype=torch.float64, **config) -> `tiny_model(arch, dtype, **config)` under `keep64`."""
    return lambda arch, dtype=torch.float64, **config: keep64(tiny_model(arch, dtype=dtype, **config))


@pytest.fixture
def one_thread():
    """torch on one thread for the test (restored after): tiny matrices run fastest so, and much faster when other
    processes keep the cores busy. Modules use it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory):
    """A tiny random Llama saved with a whitespace word-level tokenizer and a one-line chat template, so that
    `train`, `eval` and `export` load it as model.spec."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-llama-lora")
    tiny_model("llama").save_pretrained(folder)
    vocab = {str(i): i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="0", eos_token="2")
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}7 {% endif %}")
    fast.save_pretrained(folder)
    return folder
