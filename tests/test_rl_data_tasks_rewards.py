"""Tasks (reasoning-gym loading, prompts, answer extraction) and rewards (TRL-style functions and their sum)."""

import math
import sys
import textwrap

import pytest
import torch

from branchreplay.rl.config.task import DEFAULT_TASK, DEFAULT_TASK_CONFIG
from branchreplay.rl.data.rewards import (
    RewardFunctionError,
    compute_rewards,
    load_reward_function,
    make_reward,
    math_verify_reward,
    reasoning_gym_reward,
)
from branchreplay.rl.data.tasks import (
    FEW_SHOT,
    SYSTEM_PROMPT,
    TaskConfig,
    build_messages,
    extract_answer,
    known_tasks,
    load_task,
)


def columns(items):
    return {"answer": [e["answer"] for e in items], "metadata": [e["metadata"] for e in items]}


# --- tasks -----------------------------------------------------------------------------------------------------


def test_default_task_loads_with_requested_sizes():
    cfg = TaskConfig(size=32, eval_size=16)
    train, eval_ = load_task(cfg)
    assert len(train) == 32 and len(eval_) == 16
    item = train[0]
    assert isinstance(item["question"], str) and isinstance(item["answer"], str) and "metadata" in item
    assert [e["question"] for e in train] == [e["question"] for e in load_task(cfg)[0]]  # deterministic


def test_default_train_and_eval_questions_are_mostly_distinct():
    train, eval_ = load_task(TaskConfig())
    train_questions = {e["question"] for e in train}
    overlap = sum(e["question"] in train_questions for e in eval_)
    assert overlap < len(eval_) / 2  # 19 of 64: the 0..10 half of the default task has only 242 questions


def test_config_none_resolves_per_task():
    assert TaskConfig().dataset_kwargs() == DEFAULT_TASK_CONFIG
    assert TaskConfig(name="chain_sum").dataset_kwargs() == {}
    assert TaskConfig(name=DEFAULT_TASK, config={"max_terms": 3}).dataset_kwargs() == {"max_terms": 3}


def test_unknown_task_lists_known_names():
    with pytest.raises(ValueError) as err:
        load_task(TaskConfig(name="chain_summ"))
    msg = str(err.value)
    assert "chain_summ" in msg and "chain_sum" in msg and known_tasks()[0] in msg
    assert "reasoning_gym.factory.DATASETS" in msg


def test_bad_config_key_is_named():
    with pytest.raises(ValueError, match="max_termz"):
        load_task(TaskConfig(name="chain_sum", config={"max_termz": 3}))
    with pytest.raises(ValueError, match="seed"):
        load_task(TaskConfig(name="chain_sum", config={"seed": 3}))


def test_invalid_config_value_is_a_value_error():
    with pytest.raises(ValueError, match="chain_sum"):
        load_task(TaskConfig(name="chain_sum", config={"min_terms": 5, "max_terms": 2}))


def test_known_tasks_sorted_and_contains_candidates():
    names = known_tasks()
    assert names == sorted(names)
    assert {"chain_sum", "basic_arithmetic", "leg_counting", "count_bits"} <= set(names)


def test_build_messages_and_extract_answer():
    msgs = build_messages("What is 2 + 2?")
    assert msgs[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert msgs[-1] == {"role": "user", "content": "What is 2 + 2?"}
    assert [m["role"] for m in msgs[1:-1]] == ["user", "assistant"] * len(FEW_SHOT)
    assert all(extract_answer(reply) is not None for _, reply in FEW_SHOT)
    assert extract_answer("so <answer> 4 </answer>") == "4"
    assert extract_answer("<answer>3</answer> no, <answer>4</answer>") == "4"
    assert extract_answer("the answer is 4") is None


# --- reasoning-gym reward ----------------------------------------------------------------------------------------


def test_reasoning_gym_reward_correct_wrong_and_untagged():
    train, _ = load_task(TaskConfig(name="chain_sum", size=3, eval_size=1))
    items = [train[i] for i in range(3)]
    wrong = str(int(items[1]["answer"]) + 1)
    completions = [f"<answer>{items[0]['answer']}</answer>", f"<answer>{wrong}</answer>", items[2]["answer"]]
    reward = reasoning_gym_reward(train)
    out = reward(prompts=[""] * 3, completions=completions, completion_ids=[[1]] * 3, **columns(items))
    assert out == [1.0, 0.0, 0.0]


# --- math-verify reward ------------------------------------------------------------------------------------------


def test_math_verify_reward_equivalent_forms_and_unparsable_gold():
    pytest.importorskip("math_verify")
    out = math_verify_reward(
        prompts=[""] * 4,
        completions=["<answer>\\frac{1}{2}</answer>", "so the answer is 0.5", "<answer>0.25</answer>", "0.5"],
        completion_ids=[[]] * 4,
        answer=["0.5", "\\frac{1}{2}", "1/2", "not a number at all"],
    )
    assert out == [1.0, 1.0, 0.0, None]


# --- load_reward_function ----------------------------------------------------------------------------------------


def test_load_reward_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            NOT_CALLABLE = 3
            def length_reward(completions, **kwargs):
                return [float(len(c)) for c in completions]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards_mod", raising=False)
    func = load_reward_function("my_rewards_mod:length_reward")
    assert func(completions=["ab", "c"]) == [2.0, 1.0]
    dataset = load_task(TaskConfig(size=2, eval_size=1))[0]
    assert make_reward("my_rewards_mod:length_reward", dataset) is func  # TaskConfig.reward, as train uses it
    assert make_reward("math_verify", dataset) is math_verify_reward
    assert make_reward("task", dataset).__name__ == "reasoning_gym"
    with pytest.raises(ValueError, match=r"task.reward='my_rewards_mod:NOT_CALLABLE'.*accepted: 'task'"):
        make_reward("my_rewards_mod:NOT_CALLABLE", dataset)
    with pytest.raises(ValueError, match="package.module:function"):
        load_reward_function("my_rewards_mod.length_reward")
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        load_reward_function("no_such_module_xyz:f")
    with pytest.raises(AttributeError, match="missing"):
        load_reward_function("my_rewards_mod:missing")
    with pytest.raises(TypeError, match="NOT_CALLABLE"):
        load_reward_function("my_rewards_mod:NOT_CALLABLE")


# --- compute_rewards ---------------------------------------------------------------------------------------------

KW = {"prompts": ["p"] * 3, "completions": ["a", "b", "c"], "completion_ids": [[1], [2], [3]], "columns": {}}


def const(values, name="const", as_list=True):
    """A reward function returning ``values`` (as a new list unless ``as_list`` is False)."""

    def f(**kwargs):
        return list(values) if as_list else values

    f.__name__ = name
    return f


def test_compute_rewards_weighted_nansum_skips_none():
    f1 = const([1.0, None, None])
    f2 = const([0.5, 2.0, None])
    with pytest.warns(UserWarning, match=r"\[2\]"):
        out = compute_rewards([f1, f2], [2.0, 0.5], **KW)
    assert out.dtype == torch.float32 and out.shape == (3,)
    assert out.tolist() == [2.0 * 1.0 + 0.5 * 0.5, 0.5 * 2.0, 0.0]
    assert not any(math.isnan(x) for x in out.tolist())


def test_compute_rewards_default_weights_and_columns_are_passed():
    seen = {}

    def f(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, completion_ids=completion_ids, answer=answer, extra=kwargs)
        return [float(a == c) for a, c in zip(answer, completions, strict=True)]

    out = compute_rewards([f, const([1.0] * 3)], None, **{**KW, "columns": {"answer": ["a", "x", "c"], "k": [0] * 3}})
    assert out.tolist() == [2.0, 1.0, 2.0]
    assert seen == {
        "prompts": KW["prompts"],
        "completion_ids": KW["completion_ids"],
        "answer": ["a", "x", "c"],
        "extra": {"k": [0] * 3},
    }


@pytest.mark.parametrize("bad", [[1.0, 2.0], (1.0, 2.0, 3.0), 1.0])
def test_compute_rewards_wrong_output_names_function_and_lengths(bad):
    with pytest.raises(RewardFunctionError, match="shape_bug") as err:
        compute_rewards([const([0.0] * 3), const(bad, "shape_bug", as_list=False)], None, **KW)
    assert "length 3" in str(err.value)


def test_compute_rewards_refuses_values_that_are_not_numbers():
    """A string is never read as a number ("1.0" used to become 1.0 silently); numpy scalars and one-element
    tensors are numbers, as TRL takes them."""
    import numpy as np

    with pytest.raises(RewardFunctionError, match=r"'strings' returned '1.0' \(a str\) for sample 1; a reward is a "):
        compute_rewards([const([0.0, "1.0", None], "strings")], None, **KW)
    out = compute_rewards([const([np.float32(0.5), torch.tensor(2.0), np.int64(1)])], None, **KW)
    assert out.tolist() == [0.5, 2.0, 1.0]


def test_compute_rewards_wraps_raising_function():
    def broken(**kwargs):
        raise KeyError("answer")

    with pytest.raises(RewardFunctionError, match="broken") as err:
        compute_rewards([broken], None, **KW)
    assert isinstance(err.value.__cause__, KeyError)


def test_compute_rewards_weight_count_must_match():
    with pytest.raises(ValueError, match="2 reward weights for 1"):
        compute_rewards([const([0.0] * 3)], [1.0, 1.0], **KW)


def test_a_reward_module_in_the_current_folder_imports_without_pythonpath(tmp_path, monkeypatch):
    import sys

    from branchreplay.rl.data.rewards import load_reward_function

    (tmp_path / "my_rewards_issue14.py").write_text("def length(completions, **kwargs):\n"
                                                    "    return [float(len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    path = list(sys.path)
    fn = load_reward_function("my_rewards_issue14:length")
    assert fn(completions=["ab", "c"]) == [2.0, 1.0] and sys.path == path  # the path is restored
