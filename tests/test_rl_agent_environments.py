"""Multi-turn pieces (issue 13): a trajectory's token ids built turn by turn (`rl.conversation`) equal the chat
template's rendering of the final conversation on prefix-stable templates, a template that is not is refused by
name, and the tool environment (`rl.environments`) turns every failure into the tool's reply."""

import time

import pytest

from branchreplay.rl.agent.conversation import Conversation, TemplateNotPrefixStableError, message_delta_ids
from branchreplay.rl.agent.environments import TRUNCATED, ToolEnvironment, load_environment

EOS = 2


class TurnTokenizer:
    """Bytes 3..255 are text, "$" is id 2 (EOS, the end of every turn); template "<R>:<content>$\\n" per message,
    generation prompt "A:"."""

    eos_token_id, bos_token_id, name_or_path = EOS, None, "turn-test-template"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"{m['role'][0].upper()}:{m['content']}$\n" for m in messages)
        return text + ("A:" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": [EOS if b == ord("$") else max(b, 3) for b in text.encode()]})


def _sampled(tok, text):
    """What a sampler draws for an assistant turn: the text's ids and the end-of-turn token."""
    return tok(text).input_ids + [EOS]


def test_ids_equal_the_template_of_the_final_conversation():
    tok = TurnTokenizer()
    conv = Conversation.start(tok, [{"role": "system", "content": "calc"}, {"role": "user", "content": "2+3?"}])
    conv.add_assistant(_sampled(tok, "call add"), "call add")
    conv.add_environment(tok, [{"role": "tool", "content": "5"}])
    conv.add_assistant(_sampled(tok, "it is 5"), "it is 5")
    conv.add_environment(tok, [{"role": "user", "content": "sure?"}])
    conv.add_assistant(_sampled(tok, "yes"), "yes")
    rendered = tok(tok.apply_chat_template(conv.messages, add_generation_prompt=False)).input_ids
    assert conv.ids == rendered[: len(conv.ids)] and rendered[len(conv.ids):] == tok("\n").input_ids  # the template's
    # newline after the last end-of-turn token is not part of the trajectory (TRL's _get_tool_suffix_ids cuts there)
    trained = [t for t, m in zip(conv.ids, conv.loss_mask, strict=True) if m]
    assert trained == _sampled(tok, "call add") + _sampled(tok, "it is 5") + _sampled(tok, "yes")
    assert len(conv.turn_starts) == 3 and conv.loss_mask[conv.turn_starts[1] - 1] == 0.0


def test_sampled_ids_are_kept_as_sampled():
    """A sampler may draw ids that the text does not re-tokenize to: they stay, never re-encoded."""
    tok = TurnTokenizer()
    conv = Conversation.start(tok, [{"role": "user", "content": "q"}])
    odd = [100, 101, EOS]
    conv.add_assistant(odd, "de")
    conv.add_environment(tok, [{"role": "tool", "content": "r"}])
    assert conv.ids[conv.turn_starts[0] : conv.turn_starts[0] + 3] == odd


def test_unstable_template_and_unfinished_turn_refused():
    class Unstable(TurnTokenizer):  # marks the last message: earlier turns render differently once one follows
        name_or_path = "unstable-template"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            text = super().apply_chat_template(messages[:-1], False, False)
            return text + f"LAST:{messages[-1]['content']}$\n" + ("A:" if add_generation_prompt else "")

    with pytest.raises(TemplateNotPrefixStableError, match="unstable-template"):
        message_delta_ids(Unstable(), [{"role": "tool", "content": "5"}])
    tok = TurnTokenizer()
    conv = Conversation.start(tok, [{"role": "user", "content": "q"}])
    conv.add_assistant(tok("no end").input_ids, "no end")  # truncated: no end-of-turn token
    with pytest.raises(ValueError, match="finished assistant turn"):
        conv.add_environment(tok, [{"role": "tool", "content": "r"}])


@pytest.mark.smollm2
def test_smollm2_template_is_prefix_stable_and_ids_match():
    from branchreplay.models import load_model

    _, tok = load_model("smollm2")
    conv = Conversation.start(tok, [{"role": "user", "content": "What is 2 + 3?"}])
    for text, reply in (("Let me add.", {"role": "tool", "content": "5"}), ("It is 5.", None)):
        conv.add_assistant(tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id], text)
        if reply:
            conv.add_environment(tok, [reply])
    rendered = tok(tok.apply_chat_template(conv.messages, tokenize=False), add_special_tokens=False).input_ids
    assert conv.ids == rendered[: len(conv.ids)] and len(rendered) - len(conv.ids) <= 1


# -- the tool environment --------------------------------------------------------------------------------------------

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def fail(x: int) -> int:
    """Always raises.

    Args:
        x: anything
    """
    raise RuntimeError(f"cannot handle {x}")


def hang(x: int) -> int:
    """Sleeps too long.

    Args:
        x: anything
    """
    time.sleep(2)
    return x


def shout(text: str) -> str:
    """Repeats the text many times.

    Args:
        text: what to repeat
    """
    return text * 1000


def _env(**kwargs):
    return ToolEnvironment([add, fail, hang, shout], "Answer with the tools.",
                           reward=lambda messages, item: float(item["answer"] in messages[-1]["content"]), **kwargs)


def _turn(env, text):
    return env.step([{"role": "assistant", "content": text}], {"question": "q", "answer": "5"})


def test_tool_calls_results_and_every_failure_as_a_reply():
    env = _env(timeout_s=0.2, max_output_chars=50)
    opening = env.reset({"question": "2+3?"})
    assert '"name": "add"' in opening[0]["content"] and opening[1] == {"role": "user", "content": "2+3?"}
    ok = _turn(env, 'sure <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert (ok.messages, ok.done, ok.tool_calls, ok.tool_errors) == ([{"role": "tool", "name": "add",
                                                                       "content": "5"}], False, 1, 0)
    cases = {'{"name": "add", "arguments": [1]}': "malformed", "not json": "malformed",
             '{"name": "mul", "arguments": {}}': "unknown tool 'mul'",
             '{"name": "fail", "arguments": {"x": 1}}': "RuntimeError: cannot handle 1",
             '{"name": "hang", "arguments": {"x": 1}}': "did not answer within 0.2 s",
             '{"name": "add", "arguments": {"a": 1}}': "TypeError"}
    for call, expected in cases.items():
        reply = _turn(env, f"<tool_call>{call}</tool_call>")
        assert reply.tool_errors == 1 and expected in reply.messages[0]["content"], (call, reply)
    long = _turn(env, '<tool_call>{"name": "shout", "arguments": {"text": "ab"}}</tool_call>')
    assert long.messages[0]["content"] == "ab" * 25 + TRUNCATED
    done = _turn(env, "The answer is 5.")
    assert done.done and not done.messages
    assert env.final_reward([{"role": "assistant", "content": "5"}], {"answer": "5"}) == 1.0


def test_bad_tools_and_environment_specs_refused():
    def no_doc(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="no_doc"):
        ToolEnvironment([no_doc], "s", reward=lambda m, i: 0.0)
    with pytest.raises(ValueError, match="two tools"):
        ToolEnvironment([add, add], "s", reward=lambda m, i: 0.0)
    with pytest.raises(ValueError, match="package.module:Class"):
        load_environment("nocolon")
    with pytest.raises(ValueError, match="does not import"):
        load_environment("branchreplay.nosuch:Env")
    with pytest.raises(ValueError, match="lacks reset, step, final_reward"):
        load_environment("branchreplay.tree:Node")
    env = load_environment("branchreplay.rl.agent.environments:ToolEnvironment", tools=[add], system_prompt="s",
                           reward=lambda m, i: 0.0)
    assert isinstance(env, ToolEnvironment)


# -- tree sampling across turns ----------------------------------------------------------------------------------

class TurnTokenizerWithDecode(TurnTokenizer):
    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i >= 3).decode("latin-1")


class Feedback:
    """A user who answers "more" until the third reply; per-turn reward 0.1 x the reply number."""

    def reset(self, item):
        return [{"role": "user", "content": item["question"]}]

    def step(self, messages, item):
        from branchreplay.rl.agent.environments import EnvResponse

        n = sum(m["role"] == "assistant" for m in messages)
        return EnvResponse([{"role": "user", "content": "more"}], done=n >= 3, reward=0.1 * n)

    def final_reward(self, messages, item):
        return float(len(messages))


def _chatty_model():
    """The tiny Llama with an LM-head bias toward id 2 (the end of a turn): replies of a few tokens."""
    import torch

    from branchreplay.tiny_models import tiny_model

    return ending_turns(tiny_model("llama", dtype=torch.float32))


def ending_turns(model):
    """`model` with its LM head given a bias toward id 2 (the end of a turn), in the head's dtype."""
    import torch

    weight = model.lm_head.weight
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True, dtype=weight.dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.zero_()
        head.bias[EOS] = 6.0
    model.lm_head = head
    return model


def test_turn_branching_shares_turns_and_logprobs_equal_naive():
    """turn_branching (2, 2) over 3 turns: 4 trajectories, siblings share their first turn's ids, and the sampler's
    logprobs (its caches copied per prefix, only new tokens prefilled) equal each trajectory run alone."""
    import torch

    from branchreplay.decode.config import SamplingConfig
    from branchreplay.reference.naive import naive_backward
    from branchreplay.rl.rollouts.trajectories import sample_trajectories
    from branchreplay.tree import Rollout, RolloutTree

    model, tok = _chatty_model(), TurnTokenizerWithDecode()
    config = SamplingConfig(temperature=1.0, max_new_tokens=12)
    out = sample_trajectories(model, tok, Feedback(), {"question": "hi"}, (2, 2), config, {EOS},
                              torch.Generator().manual_seed(0), max_turns=5)
    assert len(out) == 4 and all(t.turns == 3 and t.ended_by == "done" for t in out)
    assert all(t.turn_rewards == pytest.approx([0.1, 0.2, 0.3]) for t in out)
    ids = [t.conversation.ids for t in out]
    first_turn_end = out[0].conversation.turn_starts[1]
    assert ids[0][:first_turn_end] == ids[1][:first_turn_end] and ids[0][:first_turn_end] != ids[2][:first_turn_end]
    rollouts = [Rollout(t.conversation.ids, t.conversation.loss_mask) for t in out]
    naive = naive_backward(model, rollouts, None).logprobs
    for t, r, lp in zip(out, rollouts, naive, strict=True):
        mask = r.loss_mask > 0
        torch.testing.assert_close(torch.tensor(t.logprobs)[mask], lp[mask], rtol=0, atol=1e-4)
    stats = RolloutTree(rollouts).stats
    assert stats.physical_tokens < stats.logical_tokens - 3 * (out[0].conversation.turn_starts[0])  # turns shared


def test_trajectory_limits_end_it():
    import torch

    from branchreplay.decode.config import SamplingConfig
    from branchreplay.rl.rollouts.trajectories import sample_trajectories

    model, tok = _chatty_model(), TurnTokenizerWithDecode()
    config = SamplingConfig(temperature=1.0, max_new_tokens=12)
    g = torch.Generator().manual_seed(0)
    capped = sample_trajectories(model, tok, Feedback(), {"question": "hi"}, (), config, {EOS}, g, max_turns=2)
    assert [t.ended_by for t in capped] == ["max_turns"] and capped[0].turns == 2
    short = sample_trajectories(model, tok, Feedback(), {"question": "hi"}, (), config, {EOS}, g, max_turns=5,
                                max_context_tokens=40)
    assert short[0].ended_by == "context" and len(short[0].conversation.ids) <= 40
    starts = short[0].conversation.turn_starts  # every reply started with room for max_new_tokens more tokens
    assert all(start + 12 <= 40 for start in starts)
    assert short[0].conversation.loss_mask[-1] == 1.0  # the environment's reply that did not fit is not kept
    with pytest.raises(ValueError, match="context limit"):
        sample_trajectories(model, tok, Feedback(), {"question": "hi"}, (), config, {EOS}, g, max_context_tokens=10)
    truncating = SamplingConfig(temperature=1.0, max_new_tokens=1)
    cut = sample_trajectories(_chatty_model(), tok, Feedback(), {"question": "hi"}, (3,), truncating, {EOS},
                              torch.Generator().manual_seed(1))
    assert any(t.ended_by == "truncated" and t.truncated for t in cut)


def test_calculator_tool_and_task():
    """The built-in tool task: `calculate` evaluates arithmetic only, the worked example comes before the question,
    and the reward is the task's verifier on the last reply."""
    from branchreplay.rl.agent.environments import calculate, calculator

    assert (calculate("12 * (3 + 4)"), calculate("7 / 2"), calculate("-3 + 5")) == (84, 3.5, 2)
    for bad in ('__import__("os")', "x + 1", "2 ** 10", "True + 1"):
        with pytest.raises(ValueError, match="only numbers"):
            calculate(bad)
    env = calculator(lambda completions, answer, metadata: [float(f"<answer>{answer[0]}</answer>" in completions[0])])
    opening = env.reset({"question": "What is 2 + 3?"})
    assert [m["role"] for m in opening] == ["system", "user", "assistant", "tool", "assistant", "user"]
    reply = env.step(opening[:3], {})  # the example's own call runs
    assert reply.messages[0]["content"] == "84"
    assert env.final_reward([{"role": "assistant", "content": "<answer>5</answer>"}], {"answer": "5"}) == 1.0


def test_the_calculator_task_holds_no_row_of_a_file_out_with_evaluation_off(tmp_path):
    """agent.environment=calculator on a task.dataset of 8 rows with train.eval_steps -1: every row trains (the
    agent path ignored evaluation being off and asked for a held-out split of one row in ten)."""
    import json

    from branchreplay.rl.agent.task import load_agent_task
    from branchreplay.rl.config import Config

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i} + 1", "answer": str(i + 1)}) + "\n" for i in range(8)))
    data = {"agent": {"environment": "calculator"}, "task": {"dataset": str(rows), "reward": "math_verify"}}
    _, train, held_out = load_agent_task(Config.from_dict({**data, "train": {"eval_steps": -1}}))
    assert (len(train), len(held_out)) == (8, 0)
    with pytest.raises(ValueError, match="too few to hold one in ten out"):
        load_agent_task(Config.from_dict(data))


def test_guess_number_replies_and_reward():
    from branchreplay.rl.agent.environments import GuessNumber

    env = GuessNumber(1, 10)
    items = env.items(5, seed=3)
    assert items == GuessNumber(1, 10).items(5, seed=3) and all(1 <= i["target"] <= 10 for i in items)
    item = {"question": "guess", "target": 7}
    opening = env.reset(item)
    assert opening[-1]["content"].endswith("guess") and opening[1]["content"] == "<answer>5</answer>"

    def reply(text):
        return env.step([*opening, {"role": "assistant", "content": text}], item)

    assert "higher than 3" in reply("<answer>3</answer>").messages[0]["content"]
    assert "lower than 9" in reply("maybe <answer>9</answer>").messages[0]["content"]
    assert "inside <answer></answer>" in reply("seven").messages[0]["content"]
    right = reply("<answer>7</answer>")
    assert right.done and not right.messages
    assert env.final_reward([{"role": "assistant", "content": "<answer>7</answer>"}], item) == 1.0
    assert env.final_reward([{"role": "assistant", "content": "<answer>6</answer>"}], item) == 0.0
    with pytest.raises(ValueError, match="low < high"):
        GuessNumber(5, 5)
