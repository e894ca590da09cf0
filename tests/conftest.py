"""Shared test fixtures and helpers: the gradients of a model, and tiny random models under float64 numerics.

Every exactness test compares the engine with the naive reference (`branchreplay.reference.naive`) on the same
model; float64 models run under `keep_float64` (HF's RMSNorm and a few softmaxes cast to float32 otherwise, on both
sides alike), held for the test and restored after it.
"""

import contextlib
import weakref

import pytest
import torch

from branchreplay.reference.float64 import keep_float64
from branchreplay.tiny_models import tiny_model


def compare(model, rollouts, **engine_kw) -> tuple[float, float, float]:
    """The engine against the naive reference (each rollout alone, unpadded) on the same model, GRPO loss with
    entropy 0.01 at temperature 0.7, every shared node kept plus `engine_kw` (EngineConfig fields): (max relative
    gradient error, max |logprob error| in nats, the naive gradient's L1 norm, 0 when the test would pass trivially).
    Imported: `from conftest import compare`."""
    from branchreplay.engine import EngineConfig, replay_backward
    from branchreplay.engine.config import EVERY_SHARED_NODE
    from branchreplay.losses import GRPOLoss
    from branchreplay.reference.naive import max_rel_grad_err, naive_backward
    from branchreplay.tree import RolloutTree

    loss = GRPOLoss(entropy_coef=0.01)
    model.zero_grad(set_to_none=True)
    naive = naive_backward(model, rollouts, loss, temperature=0.7)
    g_naive = grads(model)
    model.zero_grad(set_to_none=True)
    replay = replay_backward(model, RolloutTree(rollouts), loss, temperature=0.7,
                             engine=EngineConfig(**{**EVERY_SHARED_NODE, **engine_kw}))
    g_replay = grads(model)
    model.zero_grad(set_to_none=True)
    lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive.logprobs, strict=True))
    return max_rel_grad_err(g_replay, g_naive), lp_err, sum(g.abs().sum().item() for g in g_naive)


def grads(model) -> list[torch.Tensor]:
    """A copy of every parameter's gradient, zeros where it has none (imported by the tests: `from conftest import
    grads`)."""
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


FLOAT32_REL = 1024 * torch.finfo(torch.float32).eps  # 1.2e-4, about the float32 gradient comparisons' 1e-4
"""How far two float32 computations of one value that sum in different orders may be apart, relative to the value or
to the scale of the terms it sums, whichever is larger (`float32_close`). A loss sums per-token terms that partly
cancel (a group's advantages sum to 0), so its rounding relative to its own value is float32's epsilon times that
cancellation: 160 epsilons on test_trl_grpo's grpo-kl-off-policy batch under AVX2 kernels (issue 50)."""


def float32_close(ours: float, theirs: float, scale: float = 0.0, rel: float = FLOAT32_REL) -> bool:
    """|ours - theirs| <= rel * max(|theirs|, scale): `scale` the magnitude of the terms summed into the value (a
    value that is 0 in exact arithmetic is all rounding of them). Imported: `from conftest import float32_close`."""
    return abs(ours - theirs) <= rel * max(abs(theirs), scale)


def held_float64(model):
    """`keep_float64` on `model` (a test's own model) for as long as it lives: float64 throughout, so that two runs
    whose sums differ only in their order (one process and two ranks, one forest and per-group trees) agree to
    float64 rounding, where HF's float32 RMSNorm would show float32's (imported: `from conftest import
    held_float64`)."""
    _HELD[model] = keep_float64(model)  # referenced while the model lives (not on it: deepcopy cannot copy it)
    _HELD[model].__enter__()
    return model


_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
