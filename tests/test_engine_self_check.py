"""First use of an unregistered family (`engine/self_check.py`): the engine against the naive reference on the
user's own model, refused above the dtype's bound, cached by verdict key; recurrent unknowns always refused."""

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, MambaConfig, MambaForCausalLM

import branchreplay.engine.self_check as self_check
from branchreplay.engine import UnsupportedModelError
from branchreplay.reference.shapes import make_rollouts, shared_prompt
from branchreplay.tiny_models import tiny_model

SELF_CHECK = "self-check"


def _neox(dtype=torch.float32, seed=0):
    cfg = GPTNeoXConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(cfg).eval().to(dtype)


@pytest.mark.slow
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


@pytest.mark.slow
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


def _tree():
    from branchreplay.tree import RolloutTree

    g = torch.Generator().manual_seed(0)
    return RolloutTree(make_rollouts(shared_prompt(8, 2, 4, 256, g), g))


@pytest.mark.slow
def test_force_true_checks_each_model_once_per_process_and_the_engine_trusts_it(monkeypatch):
    """A call of the package's `replay_logprobs` with force=True runs the trainer's self-check before the engine
    (once per model class, config and dtype in the process); the engine's own trusted=True is the explicit opt-out."""
    from branchreplay import replay_logprobs
    from branchreplay.engine import replay_logprobs as trusted

    monkeypatch.setattr(self_check, "PROCESS_VERDICTS", {})
    calls = []
    original = self_check.self_check
    monkeypatch.setattr(self_check, "self_check", lambda m: calls.append(m) or original(m))
    tree = _tree()
    model = _neox()
    trusted(model, tree, trusted=True)
    assert calls == []
    replay_logprobs(model, tree, force=True)
    replay_logprobs(_neox(seed=1), tree, force=True)  # same class, config and dtype: the verdict is reused
    assert len(calls) == 1
    replay_logprobs(_neox(torch.float64), tree, force=True)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="force='unchecked': pass True .* or False"):  # the old three-valued
        replay_logprobs(model, tree, force="unchecked")  # force's strings are refused by name
    with pytest.raises(ValueError, match="trusted='unchecked': pass True .* or False"):
        trusted(model, tree, trusted="unchecked")


@pytest.mark.slow
def test_force_true_refuses_a_model_whose_self_check_fails(monkeypatch):
    """The engine of `test_a_wrong_guess_is_refused_with_the_measured_error` (its head scaled by 1.5): with
    force=True the library call is refused with the measured error, as the trainer would refuse it; unchecked, it
    runs (and is wrong: what the check is for)."""
    from branchreplay import replay_backward
    from branchreplay.engine import replay_backward as trusted
    from branchreplay.engine import stack
    from branchreplay.losses import GRPOLoss

    monkeypatch.setattr(self_check, "PROCESS_VERDICTS", {})
    wrong = stack.decoder_and_head
    monkeypatch.setattr(stack, "decoder_and_head",
                        lambda m: (*wrong(m)[:2], type(wrong(m)[2])(multiplier=1.5)))
    monkeypatch.setattr(stack, "check_head", lambda m: None)
    model = _neox(torch.float64)
    tree = _tree()
    with pytest.raises(UnsupportedModelError, match="failed its self-check"):
        replay_backward(model, tree, GRPOLoss(), force=True)
    trusted(model, tree, GRPOLoss(), trusted=True)


def test_force_true_under_data_parallelism_names_the_fix(monkeypatch):
    """One rank of several holds a shard of the model (FSDP2) or a replica whose backward reduces (DDP): the check
    cannot run there, and says what to do; a registered family is not checked, so force=True stays harmless."""
    from branchreplay import replay_logprobs

    monkeypatch.setattr(self_check, "PROCESS_VERDICTS", {})
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match="ensure_supported.*before sharding.*trusted=True"):
        replay_logprobs(_neox(), _tree(), force=True)
    replay_logprobs(tiny_model("llama"), _tree(), force=True)


def test_a_cache_of_another_layout_is_refused_by_name():
    """Keys and values must reach the cache as [batch, kv_heads, tokens, head_dim] (older Bloom / Falcon fused
    [batch * heads, head_dim, tokens] keys): another layout is refused, not sliced wrongly."""
    from branchreplay.engine.cache import PrefixCache

    layer = PrefixCache([], 1).layers[0]
    with pytest.raises(UnsupportedModelError, match=r"keys \(4, 8, 5\).*not \[batch, kv_heads, tokens, head_dim\]"):
        layer.update(torch.zeros(4, 8, 5), torch.zeros(4, 5, 8), 0)
    ancestors = [[(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))]]
    with pytest.raises(UnsupportedModelError, match="fused or transposed"):  # heads and tokens swapped
        PrefixCache(ancestors, 1).layers[0].update(torch.zeros(1, 5, 2, 8), torch.zeros(1, 5, 2, 8), 0)
    keys, values = PrefixCache(ancestors, 1).layers[0].update(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), 0)
    assert keys.shape == values.shape == (1, 2, 8, 8)


@pytest.mark.slow
def test_the_check_of_force_true_leaves_the_callers_model_and_context_alone(monkeypatch):
    """force=True from inside autocast, inference_mode or no_grad, on a frozen model with gradients already
    accumulated: the check compares every parameter in the model's dtype (an exact model passes), and each
    parameter's grad and requires_grad are as they were. A critic is refused with the fix."""
    from branchreplay import replay_logprobs
    from branchreplay.value import ValueModel

    monkeypatch.setattr(self_check, "PROCESS_VERDICTS", {})
    model = _neox()
    grads = [torch.full_like(p, 3.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g
    model.requires_grad_(False)
    for context in (lambda: torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode, torch.no_grad):
        self_check.PROCESS_VERDICTS.clear()
        with context():
            replay_logprobs(model, _tree(), force=True)
        (verdict,) = self_check.PROCESS_VERDICTS.values()
        assert verdict["passed"] and 0 < verdict["max_rel_grad_err"] < 1e-5, verdict  # float32, every parameter
    assert all(p.grad is g and not p.requires_grad for p, g in zip(model.parameters(), grads, strict=True))
    with pytest.raises(ValueError, match="for a critic, check its policy"):
        replay_logprobs(ValueModel.from_policy(_neox()), _tree(), force=True)


def test_a_nan_gradient_is_never_within_a_bound():
    from branchreplay.reference.naive import max_rel_grad_err

    ones = [torch.ones(2), torch.ones(2)]
    assert max_rel_grad_err([torch.ones(2), torch.tensor([1.0, float("nan")])], ones) == float("inf")
