"""Tests for the sampler's static rows (branchreplay.decode.rows.static `StaticRows`, cache_implementation
static): forks, drops and halvings against the dynamic cache, SDPA only, a step that cannot be captured, and the
CUDA graph (GPU only). The reference is each group sampled alone (test_decode_loop.py's helpers). Split out of
test_decode_loop.py."""

import contextlib

import pytest
import torch

from branchreplay.decode.config import SamplingConfig
from branchreplay.decode.loop import sample_group
from test_decode_loop import PROMPT, PROMPTS, make_model, reference_logprobs


@pytest.mark.parametrize("prompt", ["once", "in every row"])
def test_static_rows_forks_drops_and_halvings(prompt):
    """StaticRows: a fork gathers its parent's row (keys, values, mask, start) into the copies' rows of the next
    power of two, a drop only forgets rows, and at half the rows or fewer the live ones are gathered into fewer. Every
    row decodes the logits of its sequence alone, the prompt held once (split prefix attention) or in every row."""
    from branchreplay.decode.forward import prefill
    from branchreplay.decode.rows.static import StaticRows
    from branchreplay.engine.attention import PrefixSplit
    from branchreplay.engine.families import layer_windows
    from branchreplay.engine.recurrent import layer_kinds

    model = make_model("llama").double().eval()

    def alone(ids):
        return model(input_ids=torch.tensor([PROMPT + ids])).logits[0, -1].float()

    split = PrefixSplit(model, layer_windows(model.config), layer_kinds(model.config))
    assert split.applies
    with torch.no_grad(), split if prompt == "once" else contextlib.nullcontext():
        cache, _ = prefill(model, PROMPT)
        start = torch.tensor([len(PROMPT)])
        if prompt == "once":
            rows = StaticRows(model, start, 4, graphs=False, prompts=[cache])
        else:
            rows = StaticRows(model, start, 4, graphs=False, stacked=cache,
                              visible=torch.ones(1, len(PROMPT), dtype=torch.long))
        rows.select(torch.tensor([0, 0, 0, 0]))  # a fork into 4: gathered into 4 rows
        assert (rows.capacity, rows.slots) == (4, [0, 1, 2, 3])
        first = [[9], [7], [9], [8]]
        logits = rows.decode(torch.tensor(first), 0)
        for row, ids in zip(logits, first, strict=True):
            torch.testing.assert_close(row, alone(ids), rtol=0, atol=1e-6)
        rows.select(torch.tensor([0, 2, 3]))  # stream 1 ended: a drop, 3 of 4 rows still read
        assert (rows.capacity, rows.slots) == (4, [0, 2, 3])
        rows.select(torch.tensor([1, 1, 2]))  # stream 0 ended, stream 1 (row 2) forks: gathered into 4 rows
        assert (rows.capacity, rows.slots) == (4, [0, 1, 2])
        second = [[9, 4], [9, 5], [8, 4]]
        logits = rows.decode(torch.tensor([[4], [5], [4]]), 1)
        rows.select(torch.tensor([1]))  # one of 4 rows: gathered into 1
        assert (rows.capacity, rows.slots) == (1, [0])
        last = rows.decode(torch.tensor([[6]]), 2)
    for row, ids in zip(logits, second, strict=True):
        torch.testing.assert_close(row, alone(ids), rtol=0, atol=1e-6)
    torch.testing.assert_close(last[0], alone([9, 5, 6]), rtol=0, atol=1e-6)


def test_static_cache_halves_its_rows_as_streams_end_and_samples_as_each_group_alone(monkeypatch):
    """Most streams end early (a quarter of the vocabulary is EOS): the static rows halve several times inside
    sample_groups, and every group's samples equal sample_group's alone (float64)."""
    import branchreplay.decode.rows.static as static_rows

    capacities = []
    gather = static_rows.StaticRows._gather
    monkeypatch.setattr(static_rows.StaticRows, "_gather",
                        lambda self, rows: capacities.append(len(rows)) or gather(self, rows))
    assert_samples_as_each_group_alone(SamplingConfig(temperature=0.9, max_new_tokens=12,
                                                      cache_implementation="static"))
    assert capacities[:2] == [4, 32] and len(capacities) >= 4  # the prompts, the fork, then halvings


def assert_samples_as_each_group_alone(config: SamplingConfig) -> None:
    """`sample_groups` on the tiny float64 Llama, PROMPTS x 8, a quarter of the vocabulary EOS: every group's samples
    equal `sample_group`'s for that group alone (ids, ends, logprobs to 1e-12)."""
    import branchreplay.decode.loop as sampling

    model = make_model("llama").double()
    eos = set(range(2, 66))
    alone = [sample_group(model, p, 8, config, eos, torch.Generator().manual_seed(k)) for k, p in enumerate(PROMPTS)]
    together = sampling.sample_groups(model, PROMPTS, 8, config, eos,
                                      [torch.Generator().manual_seed(k) for k in range(len(PROMPTS))])
    for a_group, b_group in zip(alone, together, strict=True):
        assert [(s.completion_ids, s.truncated) for s in b_group] == [(s.completion_ids, s.truncated) for s in a_group]
        for a, b in zip(a_group, b_group, strict=True):
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-12)


@pytest.mark.parametrize("prompt", ["once", "in every row"])
def test_static_rows_hold_at_most_twice_the_slots_written_whatever_max_new_tokens(prompt, monkeypatch):
    """max_new_tokens 400 (near the tiny model's 512 positions) with replies that end within a few tokens (a quarter
    of the vocabulary is EOS): the rows start with FIRST_SLOTS (here 4) generated slots and double them only when
    the streams reach the last, so a step never holds more than twice the slots written (it used to hold all 400
    from the start); the samples equal each group's alone (float64)."""
    import branchreplay.decode.rows as rows
    import branchreplay.decode.rows.static as static_rows
    from test_decode_loop import prefix_split_off

    if prompt == "in every row":
        monkeypatch.setattr(rows, "PrefixSplit", prefix_split_off)
    held = []  # (depth, generated slots held) at each decoding step
    decode = static_rows.StaticRows.decode
    monkeypatch.setattr(static_rows.StaticRows, "decode",
                        lambda self, t, d: (decode(self, t, d), held.append((d, self.slots_held)))[0])
    monkeypatch.setattr(static_rows, "FIRST_SLOTS", 4)
    assert_samples_as_each_group_alone(SamplingConfig(temperature=0.9, max_new_tokens=400,
                                                      cache_implementation="static"))
    deepest = max(d for d, _ in held)
    assert 4 <= deepest < 100 and {n for _, n in held} >= {4, 8}  # it outgrew the first slots, far from 400
    assert all(d < n <= max(4, 2 * (d + 1)) for d, n in held)

def test_static_cache_keeps_to_sdpa_attention():
    """A model with eager attention (which would add the boolean mask to its scores) decodes in the dynamic cache
    even when the static one is asked for, and says so: the same samples as each group alone."""
    import branchreplay.decode.loop as sampling

    model = make_model("llama").double()
    model.set_attn_implementation("eager")
    config = SamplingConfig(temperature=0.9, max_new_tokens=6, cache_implementation="static")
    alone = [sample_group(model, p, 2, config, {2, 40}, torch.Generator().manual_seed(k))
             for k, p in enumerate(PROMPTS)]
    with pytest.warns(RuntimeWarning, match="eager attention.*dynamic cache"):
        together = sampling.sample_groups(model, PROMPTS, 2, config, {2, 40},
                                          [torch.Generator().manual_seed(k) for k in range(len(PROMPTS))])
    assert [[s.completion_ids for s in g] for g in together] == [[s.completion_ids for s in g] for g in alone]


def test_a_step_that_cannot_be_captured_warns_and_decodes_op_by_op(monkeypatch):
    """A failed CUDA graph capture (here: asked for on the CPU, which has none) warns once, rewinds the warm-up's
    writes and decodes op by op: the samples equal the dynamic cache's."""
    import branchreplay.decode.loop as sampling
    import branchreplay.decode.rows as rows

    model = make_model("llama").double()
    out = {}
    for cache in ("dynamic", "static"):
        config = SamplingConfig(temperature=0.9, max_new_tokens=6, cache_implementation=cache)
        monkeypatch.setattr(rows, "graphs_apply", lambda model: True)
        with pytest.warns(RuntimeWarning, match="enforce_eager") if cache == "static" else contextlib.nullcontext():
            out[cache] = sampling.sample_groups(model, PROMPTS, 2, config, {2},
                                                [torch.Generator().manual_seed(k) for k in range(len(PROMPTS))])
    assert [[(s.completion_ids, s.logprobs) for s in g] for g in out["static"]] == \
        [[(s.completion_ids, s.logprobs) for s in g] for g in out["dynamic"]]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")
@pytest.mark.filterwarnings("error::RuntimeWarning")  # a failed capture warns: here it fails the test
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_static_cache_cuda_graph_samples_as_the_dynamic_cache(dtype, monkeypatch):
    """On CUDA the static cache's step is captured as a CUDA graph and replayed. float64 (each row holds its prompt:
    split attention is float32 on CUDA): the samples equal the dynamic cache's (ids, parents, logprobs to 1e-10).
    float32 (each prompt held once, `grouped_prefix_attention` through the memory-efficient kernel): every logprob
    within 1e-4 of the same model's uncached forward. The capture warns of no failure. The generated slots start at
    2, so the step is captured again after each doubling (2, 4, 8) too."""
    import branchreplay.decode.loop as sampling
    import branchreplay.decode.rows.static as static_rows
    import branchreplay.engine.attention as attention

    graphs, grouped_calls = [], []
    capture, grouped = static_rows.StaticRows._capture, attention.grouped_prefix_attention
    monkeypatch.setattr(static_rows.StaticRows, "_capture", lambda self: graphs.append(1) or capture(self))
    monkeypatch.setattr(attention, "grouped_prefix_attention", lambda *a: grouped_calls.append(1) or grouped(*a))
    monkeypatch.setattr(static_rows, "FIRST_SLOTS", 2)
    model = make_model("llama").to(dtype).cuda()
    out = {}
    for cache in ("dynamic", "static"):
        config = SamplingConfig(temperature=0.9, max_new_tokens=8, branching=((0, 2), (3, 2)),
                                cache_implementation=cache)
        out[cache] = sampling.sample_groups(model, PROMPTS, 4, config, {2, 40, 41, 42, 43},
                                            [torch.Generator("cuda").manual_seed(k) for k in range(len(PROMPTS))])
    assert graphs and bool(grouped_calls) == (dtype == torch.float32)
    if dtype == torch.float64:
        for a_group, b_group in zip(out["dynamic"], out["static"], strict=True):
            assert [(s.completion_ids, s.parent) for s in b_group] == [(s.completion_ids, s.parent) for s in a_group]
            for a, b in zip(a_group, b_group, strict=True):
                assert b.logprobs == pytest.approx(a.logprobs, abs=1e-10)
    else:
        for group, prompt in zip(out["static"], PROMPTS, strict=True):
            for s in group:
                ref = reference_logprobs(model, prompt, s.completion_ids, 0.9)
                assert s.logprobs == pytest.approx(ref.tolist(), abs=1e-4)
