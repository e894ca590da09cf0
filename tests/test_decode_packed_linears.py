"""MKL-packed linear weights while the in-process sampler runs (`decode/packed_linears.py`)."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from branchreplay.decode import packed_linears as packing
from branchreplay.decode.config import SamplingConfig
from branchreplay.decode.loop import sample_groups
from branchreplay.decode.packed_linears import packed_linears
from test_decode_loop import PROMPTS, make_model, reference_logprobs

pytestmark = pytest.mark.skipif(not packing.available(), reason="this torch build has no MKL packed sgemm")


def packed(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def mkl_calls(fn, op: str = "mkl::_mkl_linear") -> int:
    """How many times fn() ran MKL's packed sgemm, or another op (torch.profiler's op names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == op)


@pytest.mark.parametrize("rows", [1, 7, 17, 20, 32, 121, 1100])
def test_a_packed_linear_equals_nn_linear_and_is_undone(rows):
    """Inside the block (packed for 32 rows) x @ W.T + b equals nn.Linear's within float32 rounding for 2-D inputs
    contiguous or strided and a 3-D one, from MKL's packed sgemm where the input has 17-32 rows (padded to 32: MKL
    uses the packed copy for its own row count only) and through F.linear otherwise; with grad enabled, or an input
    of the wrong width, nn.Linear's own (its gradient, its error). A nested block packs nothing; leaving restores the
    module; enabled=False packs nothing."""
    torch.manual_seed(0)
    lin = nn.Linear(576, 1536)
    inputs = [torch.randn(rows, 576), torch.randn(rows, 1152)[:, ::2], torch.randn(2, rows, 576)]
    expected = [lin(x).detach() for x in inputs]
    with packed_linears(lin, rows=32):
        assert packed(lin) == [""] and packing.block(lin).rows == 32
        with torch.no_grad():
            for x, y in zip(inputs, expected, strict=True):
                n = x.numel() // 576
                close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)
                assert mkl_calls(lambda x=x, y=y, close=close: close(lin(x), y)) == (16 < n <= 32)
            with packed_linears(lin, rows=8):
                assert packed(lin) == [""] and packing.block(lin).rows == 32
            with pytest.raises(RuntimeError):
                lin(torch.randn(rows, 500))
        assert mkl_calls(lambda: lin(inputs[0]).sum().backward()) == 0
        assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    assert packed(lin) == [] and packing.block(lin) is None
    with packed_linears(lin, enabled=False):
        assert packed(lin) == [] and packing.block(lin) is None


def test_a_padded_product_uses_the_packed_copy_and_an_unpadded_one_would_not():
    """MKL computes from the packed copy only at the row count it was packed for; at any other it reads the original
    weight. Control: a zeroed stand-in for the original weight changes an unpadded 20-row product (so MKL read it)
    and leaves the padded one (`packed_linears.linear`) equal to x @ W.T."""
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64), torch.randn(20, 64)
    copy = packing.pack(weight, 32)
    stand_in = torch.zeros_like(weight)
    torch.testing.assert_close(packing.linear(x, copy, stand_in, None, 32), x @ weight.T, rtol=1e-5, atol=1e-5)
    assert torch.ops.mkl._mkl_linear(x, copy, stand_in, None, 32).abs().max() == 0


def test_a_weight_changed_or_replaced_inside_the_block_is_used_as_it_is_now():
    """The packed copy is of the weight at entry: after an in-place change (an optimizer step) or a new Parameter
    the forward computes from the module's weight as it is now, through nn.Linear."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(5, 64)
    with packed_linears(lin), torch.no_grad():
        lin.weight.mul_(2)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
        lin.weight = nn.Parameter(torch.randn(32, 64))
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    assert packed(lin) == []


def test_the_plain_step_samples_from_weights_changed_inside_the_block(monkeypatch):
    """The plain Llama step (`llama_rows`, cache_implementation auto) takes the block's packed copies only while
    each weight is the tensor packed at the same version: after an in-place change inside the block it samples as
    the changed model does outside any block (it used to decode from the copies of the weights at entry: logprobs
    0.2 apart)."""
    monkeypatch.setattr(packing, "MAX_PACKED_RATIO", float("inf"))
    model, config = make_model("llama"), SamplingConfig(temperature=1.0, max_new_tokens=6)

    def logprobs():
        generators = [torch.Generator().manual_seed(k) for k in range(len(PROMPTS))]
        return [s.logprobs for g in sample_groups(model, PROMPTS, 4, config, {2}, generators) for s in g]

    with packed_linears(model, rows=len(PROMPTS) * 4):
        before = logprobs()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        inside = logprobs()
    outside = logprobs()
    torch.testing.assert_close(torch.tensor(sum(inside, [])), torch.tensor(sum(outside, [])), atol=1e-5, rtol=0)
    assert max(abs(a - b) for a, b in zip(sum(before, []), sum(inside, []), strict=True)) > 1e-3  # the change matters


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


@pytest.mark.parametrize("cache", ["auto", "dynamic"])
def test_the_sampler_decodes_with_packed_weights_at_ratio_one(cache, monkeypatch):
    """float32, temperature 0.7, every matrix packed: each sampled logprob against the same model's uncached,
    unpacked forward over prompt + completion; the first iteration's ratio is 1 within 1e-5. The decoding forwards
    did run packed: the plain Llama step ("auto" on the CPU) and transformers' forward ("dynamic"), 7 matrices a
    layer and the head at each of the 11 decoding steps."""
    monkeypatch.setattr(packing, "MAX_PACKED_RATIO", float("inf"))
    model = make_model("llama")
    config = SamplingConfig(temperature=0.7, max_new_tokens=12, cache_implementation=cache)
    generators = [torch.Generator().manual_seed(k) for k in range(len(PROMPTS))]
    groups = []
    calls = mkl_calls(lambda: groups.extend(sample_groups(model, PROMPTS, 4, config, {2}, generators)))
    assert calls >= 11 * (2 * 7 + 1) and packed(model) == []
    worst = max((torch.exp(reference_logprobs(model, prompt, s.completion_ids, 0.7) - torch.tensor(s.logprobs)) - 1)
                .abs().max().item() for group, prompt in zip(groups, PROMPTS, strict=True) for s in group)
    assert worst < 1e-5



def test_sampling_pack_weights_false_leaves_the_layers_alone(monkeypatch):
    monkeypatch.setattr(packing, "MAX_PACKED_RATIO", float("inf"))
    model, config = make_model("llama"), SamplingConfig(max_new_tokens=4, pack_weights=False)
    assert mkl_calls(lambda: sample_groups(model, PROMPTS, 2, config, {2}, [None] * len(PROMPTS))) == 0


def test_a_model_sampled_prompt_by_prompt_is_packed_once_per_call(monkeypatch):
    """sample_groups on a sliding-window model (each prompt sampled alone) packs each matrix once for the call,
    not once per prompt."""
    monkeypatch.setattr(packing, "MAX_PACKED_RATIO", float("inf"))
    model = make_model("mistral")
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())

    def call():
        return sample_groups(model, PROMPTS, 2, SamplingConfig(max_new_tokens=3), {2}, [None] * len(PROMPTS))

    call()  # the packed sizes of the model's shapes, measured once per process (`_packed_elements`)
    assert mkl_calls(call, op="mkl::_mkl_reorder_linear_weight") == linears
