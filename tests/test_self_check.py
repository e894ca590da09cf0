"""First use of an unregistered family (`check/self_check.py`): the engine against the naive reference on the
user's own model, refused above the dtype's bound, cached by verdict key; recurrent unknowns always refused."""

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, MambaConfig, MambaForCausalLM

import branchreplay.check.self_check as self_check
from branchreplay.engine import UnsupportedModelError
from branchreplay.models import tiny_model

SELF_CHECK = "self-check"


def _neox(dtype=torch.float32, seed=0):
    cfg = GPTNeoXConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(cfg).eval().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_an_unregistered_attention_family_passes_well_inside_its_bound(dtype):
    """GPT-NeoX is not in the registry but the generic path is exact for it: the measured error sits far below the
    bound (float64 ~1e-14, float32 ~1e-6; bfloat16 is checked on a float32 copy), and the model's grads stay None."""
    model = _neox(dtype)
    error = self_check.self_check(model)
    assert 0 < error <= self_check.BOUNDS[self_check.CHECKED_IN.get(dtype, dtype)] / 100, error
    assert next(model.parameters()).dtype == dtype
    assert all(p.grad is None for p in model.parameters())
    verdicts = {}
    assert self_check.ensure_supported(model, SELF_CHECK, verdicts, log=lambda text: None) is True
    (verdict,) = verdicts.values()
    assert verdict["passed"] and verdict["model_class"] == "GPTNeoXForCausalLM"


def test_a_wrong_guess_is_refused_with_the_measured_error(monkeypatch):
    """The check can fail: an engine that computes the logits wrongly (its head scaled by 1.5, as a logit transform
    it did not know would be) makes an error of order 1, and the model is refused with the figure and the bound."""
    from branchreplay.engine import stack

    model = _neox(torch.float64)
    wrong = stack.decoder_and_head

    def scaled_head(m):
        decoder, head, transform = wrong(m)
        return decoder, head, type(transform)(multiplier=1.5)

    monkeypatch.setattr(stack, "decoder_and_head", scaled_head)
    monkeypatch.setattr(stack, "check_head", lambda m: None)
    verdicts = {}
    with pytest.raises(UnsupportedModelError, match=r"failed its self-check: max relative gradient error .*1e-06"):
        self_check.ensure_supported(model, SELF_CHECK, verdicts)
    (verdict,) = verdicts.values()
    assert not verdict["passed"] and verdict["max_rel_grad_err"] > 1e-2


def test_a_cached_verdict_is_used_and_a_registered_family_is_not_checked(monkeypatch):
    model = _neox()
    verdicts = {self_check.verdict_key(model): {"model_class": "GPTNeoXForCausalLM", "dtype": "float32",
                                                "max_rel_grad_err": 1e-7, "bound": 1e-3, "passed": True}}
    monkeypatch.setattr(self_check, "self_check", lambda m: pytest.fail("the cached verdict was not used"))
    assert self_check.ensure_supported(model, SELF_CHECK, verdicts, log=lambda text: None) is True
    assert self_check.ensure_supported(tiny_model("llama"), SELF_CHECK, {}) is False
    other = _neox(seed=1)  # same class and config: same key (weights do not change what the engine computes)
    assert self_check.verdict_key(other) == self_check.verdict_key(model)
    assert self_check.verdict_key(_neox(torch.float64)) != self_check.verdict_key(model)


def test_refuse_and_unknown_recurrent_families():
    with pytest.raises(UnsupportedModelError, match="'gpt_neox'.*branchreplay verify"):
        self_check.ensure_supported(_neox(), "refuse", {})
    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4))
    mamba.config.model_type = "my_mamba"  # a recurrent family the registry does not know
    with pytest.raises(UnsupportedModelError, match="recurrent or hybrid layers.*refused even with train.unknown_fam"):
        self_check.ensure_supported(mamba, SELF_CHECK, {})
