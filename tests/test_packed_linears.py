"""MKL-packed linear weights while the in-process sampler runs (`rl/rollouts/packed_linears.py`)."""

import pytest
import torch
from torch import nn

from branchreplay.rl.rollouts import packed_linears as packing
from branchreplay.rl.rollouts.packed_linears import packed_linears
from branchreplay.rl.rollouts.sampling import SamplingConfig, sample_groups
from test_sampling import PROMPTS, make_model, reference_logprobs

pytestmark = pytest.mark.skipif(not packing.available(), reason="this torch build has no MKL packed sgemm")


def packed(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (32, 576), (3, 40, 576)])
def test_a_packed_linear_equals_nn_linear_and_is_undone(shape):
    """Inside the block: x @ W.T + b within float32 rounding of nn.Linear's, for one row, a few, a batch and a 3-D
    input, contiguous or not; with grad enabled nn.Linear's own forward (the weight gets its gradient). Nested
    blocks leave the module to the outer one; leaving restores it."""
    torch.manual_seed(0)
    lin = nn.Linear(576, 1536)
    x = torch.randn(*shape)
    expected = lin(x).detach()
    with packed_linears(lin):
        assert packed(lin) == [""]
        with torch.no_grad():
            torch.testing.assert_close(lin(x), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lin(x.transpose(0, -2)), expected.transpose(0, -2), rtol=1e-5, atol=1e-5)
            with packed_linears(lin):
                pass
            assert packed(lin) == [""]
        lin(x).sum().backward()
        assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    assert packed(lin) == []


def test_only_float32_cpu_linears_within_the_ratio_are_packed(monkeypatch):
    """A tiny Llama's matrices are far smaller than MKL's blocking (packed: hundreds of times their bytes), so none
    is packed; with the ratio lifted every nn.Linear is (attention, MLP, LM head), in float64 none, under CPU
    autocast none."""
    model = make_model("llama")
    with packed_linears(model):
        assert packed(model) == []
    monkeypatch.setattr(packing, "MAX_PACKED_RATIO", float("inf"))
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    with packed_linears(model):
        assert packed(model) == linears and "lm_head" in linears and len(linears) == 2 * 7 + 1
    with packed_linears(model.double()):
        assert packed(model) == []
    with torch.autocast("cpu", dtype=torch.bfloat16), packed_linears(model.float()):
        assert packed(model) == []
    assert packed(model) == []


def test_the_sampler_decodes_with_packed_weights_at_ratio_one(monkeypatch):
    """float32, temperature 0.7, every matrix packed: each sampled logprob against the same model's uncached,
    unpacked forward over prompt + completion; the first iteration's ratio is 1 within 1e-5. The decoding forwards
    did run packed."""
    monkeypatch.setattr(packing, "MAX_PACKED_RATIO", float("inf"))
    model = make_model("llama")
    calls = []
    model.lm_head.register_forward_hook(lambda m, args, out: calls.append("forward" in m.__dict__))
    config = SamplingConfig(temperature=0.7, max_new_tokens=12)
    generators = [torch.Generator().manual_seed(k) for k in range(len(PROMPTS))]
    groups = sample_groups(model, PROMPTS, 4, config, {2}, generators)
    assert len(calls) > 5 and all(calls) and packed(model) == []
    worst = max((torch.exp(reference_logprobs(model, prompt, s.completion_ids, 0.7) - torch.tensor(s.logprobs)) - 1)
                .abs().max().item() for group, prompt in zip(groups, PROMPTS) for s in group)
    assert worst < 1e-5

