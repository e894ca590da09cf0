"""Multi-turn training (issue 13): the trainer over environment trajectories on a tiny Llama and a byte-level chat
template. Checks: rollouts are the trajectories' ids with the loss on assistant tokens only, rewards combine the
final and per-turn ones as configured, the gradient over the shared-turn trees equals each trajectory run alone,
runs of GRPO and PPO train with the multi-turn metrics, a failing reset skips its item, tool output is cut to
agent.max_tool_output_tokens, forks inside a turn, and a template with tool support renders the tools."""

import json

import pytest
import torch

from branchreplay.decode.config import SamplingConfig
from branchreplay.losses import GRPOLoss
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.rl.agent.conversation import Conversation
from branchreplay.rl.agent.environments import TRUNCATED, EnvResponse, ToolEnvironment
from branchreplay.rl.agent.task import AgentConfig, trajectory_reward
from branchreplay.rl.config import Config
from branchreplay.rl.data.order import prompt_indices
from branchreplay.rl.policy import Policy
from branchreplay.rl.rollouts.trajectories import sample_trajectories
from branchreplay.rl.run.log import progress_info
from branchreplay.rl.run.trainer import Trainer
from branchreplay.tree import RolloutTree
from helpers import grads, held_float64
from test_rl_agent_environments import EOS, TurnTokenizerWithDecode, _chatty_model
from test_rl_run_trainer import generate, with_advantages

ITEMS = [{"question": f"q{i}", "target": i % 3} for i in range(8)]


class Counter:
    """A user who answers "go on" until the third reply, reporting one tool call per turn (every other one failed);
    per-turn reward 0.1 per reply; final reward: the number of assistant tokens' text length modulo 3 == target
    (spread inside a group). reset fails for the item {"question": "broken"}, step for {"question": "bad step"}."""

    def reset(self, item):
        if item["question"] == "broken":
            raise KeyError("no such puzzle")
        return [{"role": "user", "content": item["question"]}]

    def step(self, messages, item):
        if item["question"] == "bad step":
            raise RuntimeError("the puzzle server is down")
        n = sum(m["role"] == "assistant" for m in messages)
        return EnvResponse([{"role": "user", "content": "go on"}], done=n >= 3, reward=0.1, tool_calls=1,
                           tool_errors=n % 2)

    def final_reward(self, messages, item):
        text = "".join(m["content"] for m in messages if m["role"] == "assistant")
        return float(len(text) % 3 == item["target"])


def make_config(tmp_path, algorithm="grpo", **sections) -> Config:
    data = {
        "algorithm": algorithm,
        "model": {"spec": "tiny:llama"},
        "agent": {"environment": "tests.unused:Counter", "max_turns": 4},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "turn_branching": [2, 2]},
        "grpo": {"num_generations": 4, "prompts_per_step": 2, "learning_rate": 1e-2, "lr_scheduler": "constant"},
        "train": {"steps": 2, "output_dir": str(tmp_path / "run"), "save_steps": 0, "eval_steps": -1},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return Config.from_dict(data)


def make_trainer(config, items=ITEMS, dtype=torch.float32):
    model = _chatty_model().to(dtype)
    if dtype == torch.float64:
        held_float64(model)
    return Trainer(config, model=model, tokenizer=TurnTokenizerWithDecode(), train_data=items, eval_data=items[:3],
                   env=Counter())


pytestmark = pytest.mark.usefixtures("one_thread")


def test_rollouts_rewards_and_groups_of_a_multi_turn_step(tmp_path):
    # 12 new tokens: every first reply of this seed ends before the limit, so every trajectory forks twice
    config = make_config(tmp_path, agent={"turn_reward_weight": 0.5, "turn_reward_reduction": "mean"},
                         sampling={"max_new_tokens": 12})
    trainer = make_trainer(config)
    batch = with_advantages(trainer, generate(trainer, 1))
    assert len(batch.rollouts) == 2 and all(len(g) == 4 for g in batch.rollouts)
    for group, trajectories in zip(batch.rollouts, batch.trajectories, strict=True):
        for r, t in zip(group, trajectories, strict=True):
            assert r.token_ids.tolist() == t.conversation.ids and t.turns == 3
            assert r.loss_mask.tolist() == t.conversation.loss_mask  # assistant tokens only
    assert [{r.group for r in group} for group in batch.rollouts] == [{0}, {1}]  # one group per item
    flat = [t for g in batch.trajectories for t in g]
    assert {len(t.turn_rewards) for t in flat} <= {2, 3}  # a third reply cut at max_new_tokens gets no answer
    expected = torch.tensor([t.reward + 0.5 * sum(t.turn_rewards) / len(t.turn_rewards) for t in flat])
    torch.testing.assert_close(batch.rewards, expected)
    t = flat[0]
    summed = trajectory_reward(t, AgentConfig(turn_reward_weight=2.0))
    assert summed == pytest.approx(t.reward + 0.2 * len(t.turn_rewards))
    spread = 0
    for k, group in enumerate(batch.rollouts):  # the baseline is the item's group
        rewards = batch.rewards[4 * k : 4 * k + 4]
        adv = torch.tensor([r.advantages[0] for r in group], dtype=torch.float32)
        if rewards.max() > rewards.min():
            spread += 1
            torch.testing.assert_close(adv, (rewards - rewards.mean()) / (rewards.std() + 1e-4))
        else:
            assert not adv.any()
    assert spread >= 1, "no group with different rewards: the advantage check did not run"
    # the calls counted are those whose results the model read: one per "go on" answer, the 1st and 3rd failing
    read = [sum(m["content"] == "go on" for m in t.conversation.messages) for t in flat]
    calls = sum(read)
    assert batch.metrics["turns/mean"] == 3.0 and batch.metrics["tool_calls/mean"] == calls / len(flat)
    failed = sum(n % 2 for r in read for n in range(1, r + 1))
    assert batch.metrics["tool_calls/error_rate"] == pytest.approx(failed / calls)
    done = sum(t.ended_by == "done" for t in flat) / len(flat)
    assert batch.metrics["agent/ended_by/done"] == done and batch.metrics["time/sample_env_s"] >= 0
    assert batch.truncated == [t.truncated for t in flat]


def test_gradient_over_shared_turns_equals_each_trajectory_alone(tmp_path, keep64):
    """The trees of a multi-turn step (whole earlier turns shared, loss mask with holes at environment turns) give
    the naive per-trajectory gradient."""
    trainer = make_trainer(make_config(tmp_path, grpo={"loss_type": "grpo"}), dtype=torch.float64)
    keep64(trainer.model)
    batch = with_advantages(trainer, generate(trainer, 1))
    assert sum(float(r.advantages.abs().sum()) for r in batch.flat) > 0, "no advantage: the gradient would be zero"
    trees = [RolloutTree(group) for group in batch.rollouts]
    stats = sum((t.stats for t in trees[1:]), trees[0].stats)
    prompt_only = sum(t.conversation.turn_starts[0] + sum(len(x.conversation.ids) - x.conversation.turn_starts[0]
                                                          for x in g) for g in batch.trajectories for t in g[:1])
    assert stats.physical_tokens < prompt_only  # whole first turns shared, not only the prompt
    trainer.model.zero_grad(set_to_none=True)
    Policy(trainer.model, temperature=1.0).accumulate(trees, GRPOLoss())
    tree_grads = grads(trainer.model)
    trainer.model.zero_grad(set_to_none=True)
    naive_backward(trainer.model, [r for g in batch.rollouts for r in g], GRPOLoss(), temperature=1.0)
    err = max_rel_grad_err(tree_grads, grads(trainer.model))
    assert err <= 1e-9, f"multi-turn trees vs naive: max relative grad error {err:.3e}"


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "rloo", "reinforce_pp"])
def test_multi_turn_runs_train_and_log(tmp_path, algorithm):
    config = make_config(tmp_path, algorithm, train={"eval_steps": 0, "log_completions": True})
    trainer = make_trainer(config)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    run = trainer.fit()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 0 and "eval/turns_mean" in records[0] and records[0]["eval/skipped"] == 0
    step = records[1]
    for key in ("turns/mean", "tool_calls/mean", "tool_calls/error_rate", "tree/token_ratio", "time/sample_env_s",
                "time/sample_model_s", "completions/mean_length"):
        assert key in step, key
    assert step["tree/token_ratio"] > 1.0
    logged = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert logged[0]["messages"][0] == {"role": "user", "content": logged[0]["messages"][0]["content"]}
    assert {"turns", "ended_by", "reward"} <= set(logged[0]) and trainer.reward_name() == "tests.unused:Counter"
    assert ("advantage" in logged[0]) == (algorithm == "grpo")  # the others set theirs per token, later
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters(), strict=True))


def test_resume_equals_a_straight_run(tmp_path):
    straight = make_trainer(make_config(tmp_path / "a"))
    straight.fit()
    first = make_trainer(make_config(tmp_path / "b", train={"steps": 1}))
    run = first.fit()
    resumed = make_trainer(make_config(tmp_path / "b"))
    resumed.fit(resume=run)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("broken, message", [({"question": "broken", "target": 0}, "no such puzzle"),
                                             ({"question": "bad step", "target": 0}, "puzzle server is down")])
def test_failing_environment_skips_the_item_and_an_all_failed_step(tmp_path, broken, message):
    items = [broken, *ITEMS]
    config = make_config(tmp_path, grpo={"prompts_per_step": 2})
    trainer = make_trainer(config, items=items)
    step = next(s for s in range(1, 20) if 0 in prompt_indices(len(items), 2, 0, s))
    with pytest.warns(RuntimeWarning, match=message):
        batch = generate(trainer, step)
    assert len(batch.rollouts) == 1
    only_broken = make_trainer(config, items=[broken])
    with pytest.warns(RuntimeWarning, match="skipped"):
        assert only_broken.train_step(1) is None
    # the step's record names the real cause (the summary said "reward failed" when the reset had)
    line = progress_info({"step": 1, "skipped": only_broken.skips.why})
    assert message in only_broken.skips.why and ("Counter's reset failed" in line or "Counter's step failed" in line)
    with pytest.warns(RuntimeWarning, match=message):
        metrics = make_trainer(config, items=[broken, ITEMS[0]]).evaluate()  # eval_data = the first 3 items
    assert metrics["eval/skipped"] == 1 and metrics["eval/turns_mean"] > 0


class BadReplies(Counter):
    """Counter, but its step answers "dict reply" with a dict as the content, "no reply" with None, and its final
    reward of "nan reward" is NaN."""

    def step(self, messages, item):
        content = {"dict reply": {"text": "go on"}, "no reply": None}.get(item["question"], "go on")
        if content != "go on":
            return EnvResponse([{"role": "user", "content": content}])
        return super().step(messages, item)

    def final_reward(self, messages, item):
        return float("nan") if item["question"] == "nan reward" else super().final_reward(messages, item)


@pytest.mark.parametrize("question, said", [
    ("dict reply", r"BadReplies's step's message 0 has 'content' \{'text': 'go on'\} \(a dict\)"),
    ("no reply", r"BadReplies's step's message 0 has 'content' None \(a NoneType\)"),
    ("nan reward", r"BadReplies's final_reward gave the reward nan"),
])
def test_an_environment_reply_the_template_cannot_take_skips_the_item_by_name(tmp_path, question, said):
    """A reply whose content is not a string (a dict, None) used to crash the run in the chat template, and a NaN
    final reward stopped it ("rewards hold NaN"): now the item is skipped with a warning naming the environment,
    the field and the item, as when the environment raises."""
    items = [{"question": question, "target": 0}, *ITEMS]
    trainer = Trainer(make_config(tmp_path), model=_chatty_model(), tokenizer=TurnTokenizerWithDecode(),
                      train_data=items, eval_data=items[:3], env=BadReplies())
    step = next(s for s in range(1, 20) if 0 in prompt_indices(len(items), 2, 0, s))
    with pytest.warns(RuntimeWarning, match=f"{said}.*for item .*{question}"):
        batch = generate(trainer, step)
    assert len(batch.rollouts) == 1 and torch.isfinite(batch.rewards).all()


def test_a_reply_ending_on_another_eos_id_ends_the_trajectory():
    """A model whose generation config adds EOS ids (Qwen's <|endoftext|>, Llama 3.1's <|eom_id|>): a reply that
    stops on one of them is not the template's end of turn, so no environment turn follows it."""
    others = set(range(3, 256))  # every text id also ends a reply: most replies end on one of them
    out = sample_trajectories(_chatty_model(), TurnTokenizerWithDecode(), Counter(), ITEMS[0], (4,),
                              SamplingConfig(temperature=1.0, max_new_tokens=8), {EOS} | others,
                              torch.Generator().manual_seed(0), max_turns=3)
    ends = {t.ended_by for t in out}
    assert "end_of_sequence" in ends and ends <= {"end_of_sequence", "done"}
    assert all(t.conversation.ids[-1] in others for t in out if t.ended_by == "end_of_sequence")


def test_tool_output_cut_and_forks_inside_a_turn():
    def echo(text: str) -> str:
        """Repeat the text many times.

        Args:
            text: what to repeat
        """
        return text * 50

    class Caller(ToolEnvironment):  # the first reply always "calls" the tool, whatever the model wrote
        def step(self, messages, item):
            if sum(m["role"] == "assistant" for m in messages) == 1:
                messages = [*messages[:-1], {"role": "assistant",
                                             "content": '<tool_call>{"name": "echo", "arguments": {"text": "ab"}}'
                                                        "</tool_call>"}]
            return super().step(messages, item)

    env = Caller([echo], "s", reward=lambda m, i: 0.0)
    tok, model = TurnTokenizerWithDecode(), _chatty_model()
    config = SamplingConfig(temperature=1.0, max_new_tokens=8)
    out = sample_trajectories(model, tok, env, {"question": "q"}, (1,), config, {EOS},
                              torch.Generator().manual_seed(0), max_turns=2, max_tool_output_tokens=5)
    tool = [m for m in out[0].conversation.messages if m["role"] == "tool"][0]
    assert tool["content"] == "ababa" + TRUNCATED
    forked = sample_trajectories(model, tok, Counter(), {"question": "q", "target": 0}, (((0, 2), (3, 2)),),
                                 SamplingConfig(temperature=1.0, max_new_tokens=12), {EOS},
                                 torch.Generator().manual_seed(0), max_turns=1)
    starts = forked[0].conversation.turn_starts[0]
    first = [t.conversation.ids[starts : starts + 3] for t in forked]
    assert len(forked) == 4 and first[0] == first[1] and first[2] == first[3]


def test_a_template_with_tool_support_renders_the_tools():
    class ToolTemplate(TurnTokenizerWithDecode):
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, tools=None):
            head = "T:" + ",".join(t["function"]["name"] for t in tools) + "$\n" if tools else ""
            return head + super().apply_chat_template(messages, tokenize, add_generation_prompt)

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    plain, native = (ToolEnvironment([add], "calc", reward=lambda m, i: 0.0) for _ in range(2))
    plain.bind(TurnTokenizerWithDecode())
    native.bind(ToolTemplate())
    assert plain.template_tools is None and '"name": "add"' in plain.system_prompt
    assert native.template_tools == native.schemas and '"name": "add"' not in native.system_prompt
    out = sample_trajectories(_chatty_model(), ToolTemplate(), native, {"question": "q"}, (1,),
                              SamplingConfig(max_new_tokens=4), {EOS}, torch.Generator().manual_seed(0))
    assert out[0].conversation.ids[:6] == ToolTemplate()("T:add$").input_ids
    tok = ToolTemplate()  # later turns' deltas under the tools too: the ids equal the rendering with them
    conv = Conversation.start(tok, [{"role": "user", "content": "2+3?"}], tools=native.schemas)
    conv.add_assistant(tok("call add").input_ids + [EOS], "call add")
    conv.add_environment(tok, [{"role": "tool", "content": "5"}], tools=native.schemas)
    conv.add_assistant(tok("it is 5").input_ids + [EOS], "it is 5")
    rendered = tok(tok.apply_chat_template(conv.messages, add_generation_prompt=False, tools=native.schemas))
    assert conv.ids == rendered.input_ids[: len(conv.ids)] and conv.ids[:6] == tok("T:add$").input_ids


def test_multi_turn_config_errors():
    base = {"agent": {"environment": "calculator"}}
    with pytest.raises(ValueError, match="set agent.environment"):
        Config.from_dict({"sampling": {"turn_branching": [2, 4]}})
    with pytest.raises(ValueError, match="make them equal"):
        Config.from_dict({**base, "sampling": {"turn_branching": [2, 3]}})
    with pytest.raises(ValueError, match="unset sampling.branching"):
        Config.from_dict({**base, "sampling": {"branching": [[0, 8]]}})
    with pytest.raises(ValueError, match=r"turn_branching\[1\]"):
        Config.from_dict({**base, "sampling": {"turn_branching": [2, [[0, 2], [0, 2]]]}})
    with pytest.raises(ValueError, match="agent.environment='calc'"):
        Config.from_dict({"agent": {"environment": "calc"}})
    with pytest.raises(ValueError, match="agent.max_turns"):
        Config.from_dict({"agent": {"max_turns": 0}})
    with pytest.raises(ValueError, match="the later forks would never happen"):
        Config.from_dict({"agent": {"environment": "calculator", "max_turns": 1},
                          "sampling": {"turn_branching": [2, 4]}})
    with pytest.raises(ValueError, match="leaves no room for a reply"):
        Config.from_dict({"agent": {"environment": "calculator", "max_context_tokens": 64},
                          "sampling": {"max_new_tokens": 64}})
    ok = Config.from_dict({**base, "sampling": {"turn_branching": [[[0, 2], [16, 2]], 2]}})
    assert ok.sampling.turn_branching == (((0, 2), (16, 2)), 2)
    assert Config.from_dict(ok.to_dict()) == ok


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_turn_of_every_item_in_one_loop_equals_each_request_alone(keep64, cache):
    """`InProcessTurns` (the trainer's multi-turn sampler): every reply of a turn of every item decodes in one loop
    from each conversation's cache kept from its parent's turn (static: each history held once, read by its rows
    through split prefix attention). Against each request sampled alone (its whole conversation prefilled from
    nothing, `sample_from`) with the same generator per (item, branch path), float64: the same trajectories, ids
    and logprobs to 1e-12, forks inside a turn included; an item whose reset fails is reported by name, an item
    opening exactly as another one gets its own trajectories. Every token is prefilled once: the system prompt
    the openings share in the first forward, then only the conversations' new tokens (a radix trie of all the
    requests' ids). A control with the generators of two paths swapped differs."""
    from branchreplay.decode.forward import prefill
    from branchreplay.decode.loop import sample_from
    from branchreplay.decode.turns import InProcessTurns
    from branchreplay.rl.rollouts.trajectories import Limits, sample_trajectories_turnwise

    class Briefed(Counter):
        def reset(self, item):
            return [{"role": "system", "content": "You count with care, one step at a time."}, *super().reset(item)]

    model, tok, env = keep64(_chatty_model().double()), TurnTokenizerWithDecode(), Briefed()
    config = SamplingConfig(temperature=1.0, max_new_tokens=8, cache_implementation=cache)
    items = [ITEMS[0], ITEMS[1], {"question": "broken"}, ITEMS[3], ITEMS[0]]
    branching, limits = (((0, 2), (2, 2)), 2), Limits(max_turns=3)

    def generator(k, path, swap=False):
        path = {(0,): (1,), (1,): (0,)}.get(path, path) if swap and k == 0 else path
        return torch.Generator().manual_seed(1000 * k + sum(10 ** d * (j + 1) for d, j in enumerate(path)))

    def alone(swap):
        def sample_turn(requests, keys):
            out = []
            for (ids, schedule), key in zip(requests, keys, strict=True):
                cache_, logits = prefill(model, ids)
                out.append(sample_from(model, cache_, logits, len(ids), schedule, config, {EOS},
                                       generator(*key, swap=swap)))
            return out
        return sample_trajectories_turnwise(sample_turn, tok, env, items, branching, config, limits)

    prefilled, requests = [], []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: prefilled.append(kwargs["input_ids"].numel())
                                           if "logits_to_keep" in kwargs else None, with_kwargs=True)
    turns = InProcessTurns(model, config, {EOS}, generator)
    together, errors = sample_trajectories_turnwise(
        lambda r, keys: (requests.extend(ids for ids, _ in r), turns(r, keys))[1], tok, env, items, branching, config,
        limits)
    hook.remove()
    reference, reference_errors = alone(swap=False)
    assert list(together) == [0, 1, 3, 4] and errors == reference_errors and "no such puzzle" in errors[0]
    assert sum(len(v) for v in together.values()) > 12 and max(t.turns for v in together.values() for t in v) == 3
    for k in together:
        assert [t.conversation.ids for t in together[k]] == [t.conversation.ids for t in reference[k]]
        for a, b in zip(together[k], reference[k], strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-12)
    assert [t.conversation.ids for t in together[0]] != [t.conversation.ids for t in together[4]]
    openings = [ids for ids in requests[:4]]
    shared = next(i for i in range(min(map(len, openings))) if len({s[i] for s in openings}) > 1)
    assert shared > 40 and prefilled[0] == shared
    assert sum(prefilled) == len({tuple(ids[:n]) for ids in requests for n in range(1, len(ids) + 1)})
    swapped, _ = alone(swap=True)
    assert [t.conversation.ids for t in swapped[0]] != [t.conversation.ids for t in together[0]]


def test_evaluation_runs_its_items_in_batches_with_the_runs_cache(tmp_path, monkeypatch):
    """`evaluate_agent` takes the run's sampling.cache_implementation (static here: the static rows decode) and runs
    the held-out items `batch_size` at a time, reporting progress after each batch; the metrics equal those of one
    batch of every item (greedy). The items may be a dataset that takes one index at a time (reasoning-gym's: no
    slices)."""
    import branchreplay.decode.rows as rows
    from branchreplay.decode.rows.static import StaticRows
    from branchreplay.rl.run.evaluation import evaluate_agent

    built = []
    monkeypatch.setattr(rows, "StaticRows", lambda *a, **k: built.append(1) or StaticRows(*a, **k))

    config = make_config(tmp_path, sampling={"cache_implementation": "static"})
    model, tok, calls = _chatty_model(), TurnTokenizerWithDecode(), []
    class OneIndex:  # as reasoning-gym's ProceduralDataset
        def __len__(self):
            return 5

        def __getitem__(self, k: int) -> dict:
            if not isinstance(k, int):
                raise TypeError(f"unsupported operand type(s) for +: 'int' and '{type(k).__name__}'")
            return ITEMS[k]

    batched = evaluate_agent(model, tok, config, Counter(), OneIndex(), {EOS}, lambda *a: calls.append(a), 2)
    assert calls == [(0, 5), (2, 5), (4, 5), (5, 5)] and built
    whole = evaluate_agent(model, tok, config, Counter(), ITEMS[:5], {EOS}, None, 8)
    assert {k: v for k, v in batched.items() if k != "time/eval_s"} == {
        k: v for k, v in whole.items() if k != "time/eval_s"}


def test_items_sampled_in_waves_equal_the_whole_step(tmp_path, keep64):
    """sampling.max_num_seqs with multi-turn items: waves of max_num_seqs // num_generations items (here one item
    per wave), each its own turn-by-turn loop; in float64 the trajectories equal those of the whole step at once
    (ids; logprobs to 1e-12), since each item draws from its own generator."""
    out = []
    for limit in (None, 4):
        config = make_config(tmp_path / str(limit), sampling={"max_num_seqs": limit})
        trainer = make_trainer(config, dtype=torch.float64)
        keep64(trainer.model)
        out.append(sum(generate(trainer, 1).trajectories, []))
    assert len(out[0]) > 2 and [t.conversation.ids for t in out[0]] == [t.conversation.ids for t in out[1]]
    for a, b in zip(*out, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-12, rel=0)
