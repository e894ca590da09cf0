"""Tests for branchreplay.decode.loop: shared-prefill group sampling with an optional branching schedule.

Every model is a tiny random config built here (nothing downloaded). The reference for logprobs is the same model
run on prompt + completion alone, without a cache and unpadded.
"""

import pytest
import torch
import transformers

from branchreplay.decode.config import SamplingConfig
from branchreplay.decode.loop import sample_group

V = 256
PROMPT = [5, 17, 42, 99, 3, 250, 7]
SMALL = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def make_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **SMALL))
    elif kind == "qwen2":  # biases on the query / key / value projections
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))
    elif kind == "mistral":  # window smaller than prompt + completion: the cache keeps only the last W-1 positions
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=5, **SMALL))
    elif kind == "gpt2":  # learned positions; dropout 0.1 by default, so eval mode matters too
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2))
    else:
        raise ValueError(kind)
    return model.float()


def prefix_split_off(*args):
    """A PrefixSplit that does not apply: the static rows then hold each row's prompt."""
    from branchreplay.engine.attention import PrefixSplit

    split = PrefixSplit(*args)
    split.applies = False
    return split


def reference_logprobs(model, prompt, completion, temperature):
    """log_softmax(logits / T) of each completion token, from one uncached, unpadded forward pass."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion], device=model.device)).logits[0].float().cpu()
    steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)] / temperature
    return steps.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def sample(model, g, config, eos=(), seed=0):
    return sample_group(model, PROMPT, g, config, eos, generator=torch.Generator().manual_seed(seed))


def check_against_reference(model, samples, config, eos):
    for s in samples:
        assert len(s.completion_ids) == len(s.logprobs) <= config.max_new_tokens
        ref = reference_logprobs(model, PROMPT, s.completion_ids, config.temperature)
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=0)
        ends = [i for i, t in enumerate(s.completion_ids) if t in eos]
        if s.truncated:
            assert not ends and len(s.completion_ids) == config.max_new_tokens
        else:
            assert ends == [len(s.completion_ids) - 1]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral", "gpt2"])
@pytest.mark.parametrize("branching", [(), ((0, 2), (3, 2)), ((2, 2), (5, 2))])
def test_logprobs_match_uncached_reference(kind, branching):
    model = make_model(kind).train()  # sample_group must switch to eval and back
    config = SamplingConfig(temperature=0.7, max_new_tokens=10, branching=branching)
    samples = sample(model, 4, config)
    assert model.training
    assert len(samples) == 4 and all(s.truncated for s in samples)
    check_against_reference(model, samples, config, eos=set())


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_top_k_top_p_sampling_keeps_full_vocab_logprobs(kind):
    model = make_model(kind)
    config = SamplingConfig(temperature=0.7, top_k=20, top_p=0.5, max_new_tokens=8)
    check_against_reference(model, sample(model, 3, config), config, eos=set())


@pytest.mark.parametrize("g", [1, 4, 8])
def test_prompt_prefilled_once(g):
    model = make_model("llama")
    lengths = []
    model.register_forward_pre_hook(lambda m, args, kwargs: lengths.append(kwargs["input_ids"].shape), with_kwargs=True)
    sample(model, g, SamplingConfig(max_new_tokens=6))
    assert lengths[0] == (1, len(PROMPT))
    assert [n for _, n in lengths].count(len(PROMPT)) == 1
    assert all(n == 1 for _, n in lengths[1:]) and len(lengths) == 6  # 5 decode steps; the 6th token needs none


def test_eos_stops_completion_and_pad_equal_to_eos_is_harmless():
    model = make_model("llama")  # config pad_token_id == eos_token_id == 2
    eos = set(range(0, V, 2))  # half the vocabulary ends a completion: a mix of ended and truncated samples
    config = SamplingConfig(max_new_tokens=6, branching=((0, 4), (2, 2)))
    samples = sample(model, 8, config, eos)
    assert {s.truncated for s in samples} == {True, False}
    assert any(0 < len(s.completion_ids) < config.max_new_tokens for s in samples)
    check_against_reference(model, samples, config, eos)
    for a, b in zip(samples[::2], samples[1::2],
                    strict=True):  # a stream that ended before the fork at 2 is copied as it is
        if len(a.completion_ids) <= 2 and not a.truncated:
            assert (a.completion_ids, a.logprobs, a.truncated) == (b.completion_ids, b.logprobs, b.truncated)


def test_every_token_eos_gives_one_token_and_no_decode_step():
    model = make_model("gpt2")
    calls = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(1), with_kwargs=True)
    samples = sample(model, 4, SamplingConfig(max_new_tokens=5), eos=list(range(V)))
    assert len(calls) == 1
    assert all(len(s.completion_ids) == 1 and not s.truncated for s in samples)


def test_branching_shares_prefixes_and_parents():
    model = make_model("llama")
    config = SamplingConfig(max_new_tokens=10, branching=((0, 2), (4, 2)))
    s = sample(model, 4, config)
    ids = [x.completion_ids for x in s]
    assert ids[0][:4] == ids[1][:4] and ids[2][:4] == ids[3][:4]
    assert s[0].logprobs[:4] == s[1].logprobs[:4]
    assert ids[0][4:] != ids[1][4:] and ids[0] != ids[2]
    assert [x.parent for x in s] == [None, 0, None, 2]

    s = sample(model, 4, SamplingConfig(max_new_tokens=10, branching=((2, 2), (5, 2))))
    ids = [x.completion_ids for x in s]
    assert len({tuple(x[:2]) for x in ids}) == 1 and ids[0][:5] == ids[1][:5] and ids[2][:5] == ids[3][:5]
    assert [x.parent for x in s] == [None, 0, 0, 2]


def test_branching_product_mismatch_names_field():
    model = make_model("llama")
    with pytest.raises(ValueError, match="branching"):
        sample(model, 8, SamplingConfig(max_new_tokens=10, branching=((0, 2), (4, 2))))


@pytest.mark.parametrize("branching", [((4, 2), (4, 2)), ((4, 2), (2, 2)), ((-1, 2),), ((10, 2),), ((0, 0),)])
def test_bad_branching_schedule_names_field(branching):
    with pytest.raises(ValueError, match="branching"):
        SamplingConfig(max_new_tokens=10, branching=branching)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6)])
def test_single_candidate_filters_are_greedy(kind, filters):
    model = make_model(kind).eval()
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(6):  # greedy continuation recomputed from scratch at every step, no cache
            ids.append(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax().item())
    samples = sample(model, 3, SamplingConfig(temperature=0.7, max_new_tokens=6, **filters))
    assert all(s.completion_ids == ids[len(PROMPT):] for s in samples)



def test_deterministic_for_fixed_seed():
    model = make_model("llama")
    config = SamplingConfig(max_new_tokens=8, branching=((0, 2), (3, 2)))
    assert sample(model, 4, config, seed=3) == sample(model, 4, config, seed=3)
    assert sample(model, 4, config, seed=3) != sample(model, 4, config, seed=4)


@pytest.mark.parametrize("field, kwargs", [
    ("temperature", dict(temperature=0.0)), ("temperature", dict(temperature=-1.0)),
    ("top_p", dict(top_p=0.0)), ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-1)), ("max_new_tokens", dict(max_new_tokens=0)),
    ("cache_implementation", dict(cache_implementation="paged")),
])
def test_config_validation_names_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


def test_empty_prompt_and_bad_group_size_raise():
    model = make_model("llama")
    with pytest.raises(ValueError, match="prompt_ids"):
        sample_group(model, [], 2, SamplingConfig(), [2])
    with pytest.raises(ValueError, match="num_generations"):
        sample_group(model, PROMPT, 0, SamplingConfig(), [2])


# -- every group of a step in one decoding loop (sample_groups) ---------------------------------------------------

PROMPTS = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3, 250, 11], PROMPT, [33]]  # four lengths: the stacked caches differ


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("branching", [(), ((0, 2), (3, 2))])
@pytest.mark.parametrize("cache", ["static", "static-stacked", "dynamic", "auto"])
def test_batched_groups_equal_each_group_alone(kind, branching, cache, monkeypatch):
    """sample_groups draws, per group from its own generator, the tokens sample_group draws for that group alone, with
    its logprobs to 1e-12 in float64 (early EOS drops streams mid-way); the reference logprobs check the stacked
    caches' masked slots. Llama, Qwen2/3 and GPT-2 (learned positions) run stacked, in the static cache (each prompt
    held once, or, "static-stacked", where split prefix attention does not apply, in every row; its generated slots
    doubled from 2 to 4 to 8) or the dynamic one; "auto" runs the plain Llama step (`llama_rows`, its key store
    grown from 2 slots) for Llama and Qwen2/3, each prompt held once, and the dynamic cache for GPT-2; Mistral's
    sliding window runs per group."""
    import branchreplay.decode.loop as sampling
    import branchreplay.decode.rows as rows
    import branchreplay.decode.rows.llama as llama_rows
    import branchreplay.decode.rows.static as static_rows
    import branchreplay.engine.attention as attention

    once = cache in ("static", "auto")
    if cache == "static-stacked":
        monkeypatch.setattr(rows, "PrefixSplit", prefix_split_off)
        cache = "static"
    steps, grouped_calls, plain_steps = [], [], []
    decode, grouped = static_rows.StaticRows.decode, attention.grouped_prefix_attention
    plain = llama_rows.LlamaRows.decode
    monkeypatch.setattr(static_rows.StaticRows, "decode", lambda self, t, d: steps.append(d) or decode(self, t, d))
    monkeypatch.setattr(llama_rows.LlamaRows, "decode", lambda self, t, d: plain_steps.append(d) or plain(self, t, d))
    monkeypatch.setattr(attention, "grouped_prefix_attention", lambda *a: grouped_calls.append(1) or grouped(*a))
    monkeypatch.setattr(llama_rows, "grouped_prefix_attention", lambda *a: grouped_calls.append(1) or grouped(*a))
    monkeypatch.setattr(llama_rows, "FIRST_SLOTS", 2)
    monkeypatch.setattr(static_rows, "FIRST_SLOTS", 2)
    model = make_model(kind).double()
    config = SamplingConfig(temperature=0.9, max_new_tokens=8, branching=branching, cache_implementation=cache)
    eos = set(range(2, V, 16))  # 16 of 256 ids: frequent enough that some streams end early
    alone = [sample_group(model, p, 4, config, eos, torch.Generator().manual_seed(k)) for k, p in enumerate(PROMPTS)]
    together = sampling.sample_groups(model, PROMPTS, 4, config, eos,
                                      [torch.Generator().manual_seed(k) for k in range(len(PROMPTS))])
    assert rows.stackable(model.config) == (kind != "mistral")
    assert bool(steps) == (cache == "static" and kind != "mistral")  # the static rows decoded, where they apply
    assert bool(plain_steps) == (cache == "auto" and kind in ("llama", "qwen2", "qwen3"))
    assert bool(grouped_calls) == (once and kind != "mistral" and not (cache == "auto" and kind == "gpt2"))
    lengths = {len(s.completion_ids) for group in alone for s in group}
    assert min(lengths) < 8 and max(lengths) == 8  # some ended early, some ran to the end
    for a_group, b_group, prompt in zip(alone, together, PROMPTS, strict=True):
        assert [(s.completion_ids, s.parent, s.truncated) for s in b_group] == \
            [(s.completion_ids, s.parent, s.truncated) for s in a_group]
        for a, b in zip(a_group, b_group, strict=True):
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-12)
            ref = reference_logprobs(model, prompt, b.completion_ids, 0.9)
            assert b.logprobs == pytest.approx(ref.tolist(), abs=1e-10)


@pytest.mark.parametrize("cache", ["static", "dynamic", "auto"])
def test_first_iteration_ratio_is_one_in_float32(cache):
    """float32, temperature 0.7: every sampled logprob against the same model's uncached forward over prompt +
    completion (what training recomputes as the policy's logprob): the first iteration's ratio exp(new - old) is 1
    within 1e-5."""
    import branchreplay.decode.loop as sampling

    model = make_model("llama")
    config = SamplingConfig(temperature=0.7, max_new_tokens=12, cache_implementation=cache)
    groups = sampling.sample_groups(model, PROMPTS, 4, config, {2},
                                    [torch.Generator().manual_seed(k) for k in range(len(PROMPTS))])
    worst = max((torch.exp(reference_logprobs(model, prompt, s.completion_ids, 0.7) - torch.tensor(s.logprobs)) - 1)
                .abs().max().item() for group, prompt in zip(groups, PROMPTS, strict=True) for s in group)
    assert worst < 1e-5


@pytest.mark.parametrize("cache", ["static", "static-stacked", "dynamic", "auto"])
def test_batched_groups_with_one_wrong_mask_are_seen(cache, monkeypatch):
    """Control: stacked caches whose empty slots are visible, or (the prompts held once: static, and the plain Llama
    step of "auto") rows that see the next group's prompt, give other logprobs than each group alone."""
    import branchreplay.decode.loop as sampling
    import branchreplay.decode.rows as rows
    import branchreplay.decode.rows.llama as llama_rows
    import branchreplay.engine.attention as attention

    model = make_model("llama").double()
    config = SamplingConfig(temperature=1.0, max_new_tokens=4, cache_implementation=cache.split("-")[0])
    if cache in ("static", "auto"):
        grouped = attention.grouped_prefix_attention
        module = attention if cache == "static" else llama_rows
        monkeypatch.setattr(module, "grouped_prefix_attention", lambda q, k, v, bias, scale, spans, pk, pv, sinks=None:
                            grouped(q, k, v, bias, scale, spans, pk[1:] + pk[:1], pv[1:] + pv[:1]))
    else:
        if cache == "static-stacked":
            monkeypatch.setattr(rows, "PrefixSplit", prefix_split_off)
        stacked = rows.stacked
        monkeypatch.setattr(rows, "stacked", lambda *a: (stacked(*a)[0], torch.ones_like(stacked(*a)[1])))
    together = sampling.sample_groups(model, PROMPTS, 2, config, {2}, [None] * len(PROMPTS))
    worst = max(abs(x - y) for group, prompt in zip(together, PROMPTS, strict=True) for s in group
                for x, y in zip(s.logprobs, reference_logprobs(model, prompt, s.completion_ids, 1.0).tolist(),
                                strict=True))
    assert worst > 1e-6



@pytest.mark.parametrize("arch", ["llama", "qwen2-sliding", "lfm2"])
def test_a_fork_shares_the_keys_and_values_and_leaves_its_parent_alone(arch):
    """`forward.fork` (multi-turn branches): the attention layers' tensors shared by reference, never copied; the
    child decoding, forking and dropping rows changes nothing the parent sees (its next logits equal those of an
    untouched deep copy), recurrent layers (LFM2's short conv, written in place) included."""
    import copy

    from branchreplay.decode.forward import SHARED_LAYERS, decode_one, fork, prefill
    from branchreplay.tiny_models import tiny_model

    model = tiny_model(arch).eval()
    with torch.no_grad():
        cache, _ = prefill(model, list(range(3, 12)))
        untouched = copy.deepcopy(cache)
        child = fork(cache)
        shared = [(a, b) for a, b in zip(cache.layers, child.layers, strict=True) if type(a) in SHARED_LAYERS]
        assert all(a.keys is b.keys and a.values is b.values for a, b in shared)
        assert any(type(a) not in SHARED_LAYERS for a in cache.layers) == (arch == "lfm2")  # LFM2: copied
        child.reorder_cache(torch.tensor([0, 0, 0]))  # three streams, one token each, then one dropped
        decode_one(model, torch.tensor([[20], [21], [22]]), child, torch.full((3, 1), 9))
        child.reorder_cache(torch.tensor([0, 2]))
        decode_one(model, torch.tensor([[23], [24]]), child, torch.full((2, 1), 10))
        _, ours = prefill(model, [30, 31], cache, position=9)
        _, theirs = prefill(model, [30, 31], untouched, position=9)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "lfm2", "mamba", "jamba", "mamba2", "bamba", "falcon_h1", "nemotron_h",
                                  "qwen3_next"])
def test_a_prefill_after_a_cache_equals_one_prefill_of_the_whole(arch, keep64):
    """Multi-turn sampling prefills a conversation's new tokens after its parent's cache (`forward.prefill` with a
    position): the next logits equal one prefill of the whole sequence (float64; float32 kernels of the SSM scans:
    1e-5). Mamba's and Jamba's forwards restart the scan when a cache is continued with several tokens (off by
    0.07-0.8), so they take the tokens one at a time (`Family.continues_cache`); a control feeding them at once
    shows the error."""
    from branchreplay.decode.forward import fork, prefill
    from branchreplay.engine.families import FAMILIES
    from branchreplay.tiny_models import tiny_model

    model = keep64(tiny_model(arch, torch.float64)).eval()
    ids = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        _, whole = prefill(model, ids)
        cache, _ = prefill(model, ids[:20])
        _, continued = prefill(model, ids[20:], fork(cache), position=20)
        at_once = model(input_ids=torch.tensor([ids[20:]]), position_ids=torch.arange(20, 30)[None],
                        cache=fork(cache), use_cache=True).logits[:, -1]
    torch.testing.assert_close(continued, whole, rtol=0, atol=1e-5)
    assert FAMILIES[model.config.model_type].continues_cache == (arch not in ("mamba", "jamba"))
    if arch in ("mamba", "jamba"):
        assert (at_once - whole).abs().max() > 1e-2


def test_branches_sharing_a_start_prefill_it_once_and_equal_each_alone(keep64):
    """`forward.prefill_branches` (multi-turn replies forked inside a turn): per branch the logits of prefilling it
    alone (float64), the shared starts run once: 7 of the branches' 12 ids."""
    from branchreplay.decode.forward import fork, prefill, prefill_branches
    from branchreplay.tiny_models import tiny_model

    model = keep64(tiny_model("llama", torch.float64))
    branches = [[5, 6, 7, 8], [5, 6, 7, 9, 10], [5, 6], [11]]
    with torch.no_grad():
        cache, _ = prefill(model, list(range(3, 12)))
        fed = []
        hook = model.register_forward_pre_hook(lambda m, args, kwargs: fed.append(kwargs["input_ids"].shape[1]),
                                               with_kwargs=True)
        filled = prefill_branches(model, cache, 9, branches)
        hook.remove()
        alone = [prefill(model, b, fork(cache), position=9)[1] for b in branches]
    assert sum(fed) == 7
    for (_, ours), theirs in zip(filled, alone, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def test_a_start_the_prompts_share_is_prefilled_once_for_the_step():
    """sample_groups prefills the step's prompts as a trie: a shared system start (12 ids) runs once, not once per
    prompt, and each group still draws what it draws alone (float64)."""
    import branchreplay.decode.loop as sampling

    model = make_model("llama").double()
    system = [1, 7, 7, 3, 9, 12, 30, 31, 32, 33, 34, 35]
    prompts = [system + [40, 41], system + [50, 51, 52], [60, 61, 62], system + [40, 41]]
    config = SamplingConfig(temperature=0.9, max_new_tokens=1)  # one token: the prefill is every forward
    fed = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: fed.append(kwargs["input_ids"].numel()),
                                           with_kwargs=True)
    together = sampling.sample_groups(model, prompts, 2, config, {2}, [torch.Generator().manual_seed(k)
                                                                       for k in range(len(prompts))])
    hook.remove()
    assert sum(fed) == len(system) + 2 + 3 + 3  # the system start once; the repeated prompt not again
    alone = [sample_group(model, p, 2, config, {2}, torch.Generator().manual_seed(k)) for k, p in enumerate(prompts)]
    for a_group, b_group in zip(alone, together, strict=True):
        assert [s.completion_ids for s in b_group] == [s.completion_ids for s in a_group]
        for a, b in zip(a_group, b_group, strict=True):
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-12)


def test_one_generator_per_prompt_or_a_named_error():
    import branchreplay.decode.loop as sampling

    with pytest.raises(ValueError, match="4 prompts and 3 generators"):
        sampling.sample_groups(make_model("llama"), PROMPTS, 2, SamplingConfig(max_new_tokens=2), {2}, [None] * 3)


def test_auto_cache_on_the_cpu_is_the_plain_llama_step_where_it_applies(monkeypatch):
    """sampling.cache_implementation 'auto' decodes Llama-architecture models on the CPU with the plain step
    (`llama_rows`) in float32 and float64, and falls back to the dynamic cache (transformers' forward) for other
    families, sliding windows, bfloat16, CPU autocast and a model with a forward hook or an instance forward other
    than packed_linears' (which the plain step would skip); 'static' is taken where it applies, not for Mistral's
    sliding window."""
    import branchreplay.decode.rows as rows

    static, auto = SamplingConfig(cache_implementation="static"), SamplingConfig()
    assert not rows.uses_static(make_model("llama"), auto) and rows.uses_static(make_model("llama"), static)
    assert not rows.uses_static(make_model("mistral"), static)
    for kind in ("llama", "qwen2", "qwen3"):
        assert rows.uses_plain(make_model(kind), auto) and rows.uses_plain(make_model(kind).double(), auto)
    assert not rows.uses_plain(make_model("llama"), SamplingConfig(cache_implementation="dynamic"))
    assert not rows.uses_plain(make_model("gpt2"), auto) and not rows.uses_plain(make_model("mistral"), auto)
    assert not rows.uses_plain(make_model("llama").bfloat16(), auto)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not rows.uses_plain(make_model("llama"), auto)
    hooked = make_model("llama")
    hooked.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert not rows.uses_plain(hooked, auto)
    wrapped = make_model("llama")  # an instance forward, as accelerate's hooks set one
    wrapped.model.layers[0].self_attn.forward = lambda *a, **k: None
    assert not rows.uses_plain(wrapped, auto)
    from branchreplay.decode import packed_linears as packing
    monkeypatch.setattr(packing, "MAX_PACKED_RATIO", float("inf"))
    with packing.packed_linears(make_model("llama"), rows=8) as packed:  # packed_linears' own instance forwards
        assert "forward" in packed.lm_head.__dict__ and rows.uses_plain(packed, auto)
