"""The user's own prompts (issue 14, deliverable 3): task.dataset files (JSONL, JSON, Parquet) through Hugging Face
datasets with a column mapping, plain or conversational prompts, a system prompt, and several reward functions with
weights as TRL's reward_funcs / reward_weights, handed prompts and completions in TRL's formats."""

import json

import pytest
import torch

from branchreplay.rl.config import Config
from branchreplay.rl.data.tasks import TaskConfig, load_task, prompt_messages
from branchreplay.rl.run.trainer import Trainer
from branchreplay.tiny_models import tiny_model
from test_rl_run_trainer import ByteTokenizer, generate

pytestmark = pytest.mark.usefixtures("one_thread")

PLAIN = [{"question_text": f"{a}+{b}=?", "solution": str(a + b), "level": a % 2} for a in range(4) for b in range(3)]
CHAT = [{"prompt": [{"role": "user", "content": f"{a}*{b}?"}], "answer": str(a * b)}
        for a in range(3) for b in range(3)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompt_files_columns_and_splits(tmp_path):
    plain = _jsonl(tmp_path / "plain.jsonl", PLAIN)
    cfg = TaskConfig(dataset=plain, prompt_column="question_text", answer_column="solution", eval_size=4,
                     reward="math_verify")
    train, held_out = load_task(cfg)
    assert (len(train), len(held_out)) == (8, 4) and held_out[-1]["question"] == "3+2=?"
    assert train[0]["answer"] == "0" and train[0]["level"] == 0 and train[0]["solution"] == "0"  # columns kept
    import datasets

    parquet = tmp_path / "eval.parquet"
    datasets.Dataset.from_list(PLAIN[:2]).to_parquet(str(parquet))
    train, held_out = load_task(TaskConfig(dataset=plain, eval_dataset=str(parquet), prompt_column="question_text",
                                           answer_column="solution", reward="math_verify"))
    assert (len(train), len(held_out)) == (12, 2)
    found = r"lacks the column\(s\) prompt, answer \(it has question_text, solution, level\)"
    with pytest.raises(ValueError, match=found):
        load_task(TaskConfig(dataset=plain, reward="math_verify"))
    with pytest.raises(FileNotFoundError, match="task.dataset"):
        load_task(TaskConfig(dataset=str(tmp_path / "missing.jsonl"), reward="math_verify"))
    with pytest.raises(ValueError, match="task.reward='task'.*with task.dataset"):
        TaskConfig(dataset=plain)  # the default reward needs a reasoning-gym task: refused before any load
    with pytest.raises(ValueError, match="all held out"):
        load_task(TaskConfig(dataset=plain, prompt_column="question_text", answer_column="solution", eval_size=64,
                             reward="math_verify"))
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"text": "hi"}]}])
    with pytest.raises(ValueError, match="bad.jsonl line 1, column 'prompt': message 0 has 'role' None"):
        load_task(TaskConfig(dataset=bad, eval_size=0, reward="pkg.mod:fn"))
    with pytest.raises(ValueError, match="task.reward_weights has 1 weights for 2"):
        TaskConfig(reward="task,math_verify", reward_weights=[1.0])


def test_the_held_out_split_is_sized_to_the_file_and_none_when_evaluation_is_off(tmp_path):
    """A 24-row file used to fail by default ("24 rows, all held out (task.eval_size=64)"), even with evaluation
    off. Now the default holds one row in ten out (at most 64), and with evaluation off no row is held out
    whatever task.eval_size says; too few rows to hold one out by default is named."""
    rows = _jsonl(tmp_path / "rows.jsonl", [{"prompt": f"{i} + 1 = ?", "answer": str(i + 1)} for i in range(24)])
    cfg = TaskConfig(dataset=rows, reward="math_verify")
    assert [len(split) for split in load_task(cfg)] == [22, 2]
    assert [len(split) for split in load_task(cfg, hold_out=False)] == [24, 0]
    assert [len(split) for split in load_task(TaskConfig(dataset=rows, reward="math_verify", eval_size=64),
                                              hold_out=False)] == [24, 0]
    assert [len(split) for split in load_task(TaskConfig(dataset=rows, reward="math_verify", eval_size=5))] == [19, 5]
    few = _jsonl(tmp_path / "few.jsonl", [{"prompt": "1 + 1 = ?", "answer": "2"}] * 9)
    with pytest.raises(ValueError, match=r"few.jsonl has 9 rows, too few to hold one in ten out for evaluation "
                                         r"\(task.eval_size null\): set task.eval_size.*train.eval_steps -1"):
        load_task(TaskConfig(dataset=few, reward="math_verify"))
    assert TaskConfig().held_out_size() == 64 and [len(s) for s in load_task(TaskConfig(size=8))] == [8, 64]


def test_a_small_file_trains_with_evaluation_off_and_a_config_error_prints_once_per_node(tmp_path, model_folder,
                                                                                         monkeypatch, capsys):
    """The trial's case on the command line: 24 rows, task.eval_size left at its default, --train.eval_steps -1:
    the run trains. Under torchrun a config error printed its line on every rank; now the first rank of each node
    (LOCAL_RANK 0) prints it and the others exit 2 silently; once the process group has started, the rank that
    raised prints its own line and leaves at once (os._exit(2))."""
    from branchreplay.cli import main

    rows = _jsonl(tmp_path / "rows.jsonl", [{"prompt": f"{i} {i}"} for i in range(24)])
    (tmp_path / "my_reward.py").write_text("def ones(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    args = ["train", "--model.spec", str(model_folder), "--task.dataset", rows, "--task.reward", "my_reward:ones",
            "--grpo.num_generations", "2", "--grpo.prompts_per_step", "1", "--sampling.max_new_tokens", "2",
            "--train.steps", "1", "--train.eval_steps", "-1", "--train.output_dir", "run"]
    assert main(args) == 0
    capsys.readouterr()
    for local_rank, said in (("1", ""), ("0", "error: task.eval_size=-3 is out of range; it must be >= 0 or null\n")):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert main([*args, "--task.eval_size", "-3"]) == 2
        assert capsys.readouterr().err == said
    import torch.distributed as dist  # raised after the process group started: the rank's own line, and it leaves

    from branchreplay.rl import cli

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(cli.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit, match="2"):
        main([*args, "--task.eval_size", "-3"])
    assert capsys.readouterr().err == "error: task.eval_size=-3 is out of range; it must be >= 0 or null\n"


def test_prompt_messages_plain_conversational_and_reasoning_gym():
    plain, chat = {"question": "2+2?"}, {"question": [{"role": "user", "content": "2*3?"}]}
    own = {"question": [{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}]}
    cfg = TaskConfig(dataset="x.jsonl", system_prompt="Be brief.", reward="math_verify")
    assert prompt_messages(plain, cfg) == [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "2+2?"}]
    assert prompt_messages(chat, cfg)[0] == {"role": "system", "content": "Be brief."}
    assert prompt_messages(own, cfg) == own["question"]  # its own system message is kept
    bare = TaskConfig(dataset="x.jsonl", reward="math_verify")
    assert prompt_messages(plain, bare) == [{"role": "user", "content": "2+2?"}]
    rg = prompt_messages(plain, TaskConfig(system_prompt="Answer in <answer> tags."))
    assert rg[0]["content"] == "Answer in <answer> tags." and rg[-1] == {"role": "user", "content": "2+2?"}
    assert len(rg) == 6  # the few-shot turns stay


def test_trainer_on_a_conversational_file_with_weighted_rewards(tmp_path, monkeypatch):
    """Two reward functions from a module in the current folder, weights 2 and 0.5: each is handed the prompts as
    message lists and the completions as [{"role": "assistant", ...}], the step's reward is their weighted sum, and
    each is logged as rewards/<name>/mean."""
    (tmp_path / "file_rewards.py").write_text(
        "seen = []\n"
        "def lowercase(prompts, completions, answer, **kw):\n"
        "    seen.append((prompts, completions, answer))\n"
        "    return [sum(ch.islower() for ch in c[0]['content']) / max(len(c[0]['content']), 1) for c in completions]\n"
        "def length(completions, **kw):\n"
        "    return [float(len(c[0]['content'])) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    config = Config.from_dict({
        "model": {"spec": "tiny:llama"},
        "task": {"dataset": _jsonl(tmp_path / "chat.jsonl", CHAT), "eval_size": 2,
                 "reward": "file_rewards:lowercase, file_rewards:length", "reward_weights": [2.0, 0.5]},
        "sampling": {"temperature": 0.7, "max_new_tokens": 6},
        "grpo": {"num_generations": 4, "prompts_per_step": 2, "learning_rate": 1e-2, "lr_scheduler": "constant"},
        "train": {"steps": 1, "output_dir": str(tmp_path / "run"), "save_steps": 0, "eval_steps": -1}})
    trainer = Trainer(config, model=tiny_model("llama", dtype=torch.float32, seed=0), tokenizer=ByteTokenizer())
    batch = generate(trainer, 1)
    import file_rewards

    prompts, completions, answer = file_rewards.seen[-1]
    assert isinstance(prompts[0], list) and prompts[0][0]["role"] == "user"
    assert completions[0][0]["role"] == "assistant" and isinstance(completions[0][0]["content"], str)
    lower = torch.tensor(file_rewards.lowercase(prompts, completions, answer))
    length = torch.tensor(file_rewards.length(completions))
    torch.testing.assert_close(batch.rewards, 2.0 * lower + 0.5 * length)
    assert batch.metrics["rewards/length/mean"] == pytest.approx(length.mean().item())
    assert batch.metrics["rewards/lowercase/mean"] == pytest.approx(lower.mean().item())
    record = trainer.train_step(2)
    assert "rewards/lowercase/mean" in record and "rewards/length/std" in record


def test_plain_file_prompts_are_text_as_in_trl(tmp_path):
    """A plain prompt of task.dataset is tokenized as text (TRL's _tokenize_prompts), unless task.system_prompt makes
    it a conversation; the reward gets the dataset's prompt string and string completions."""
    seen = []

    def reward(prompts, completions, solution, **kwargs):
        seen.append((prompts, completions, solution))
        return [0.0] * len(completions)

    plain = _jsonl(tmp_path / "plain.jsonl", PLAIN)
    task = {"dataset": plain, "prompt_column": "question_text", "answer_column": "solution", "eval_size": 2,
            "system_prompt": "Be brief.", "reward": "math_verify"}
    config = Config.from_dict({"model": {"spec": "tiny:llama"}, "task": task,
                               "sampling": {"max_new_tokens": 4}, "grpo": {"num_generations": 2},
                               "train": {"output_dir": str(tmp_path / "run")}})
    train, held_out = load_task(config.task)
    trainer = Trainer(config, model=tiny_model("llama", dtype=torch.float32, seed=0), tokenizer=ByteTokenizer(),
                      train_data=train, eval_data=held_out, reward_fn=reward)
    batch = generate(trainer, 1)
    prompts, completions, solution = seen[-1]
    assert isinstance(prompts[0], str) and isinstance(completions[0], str) and solution[0].isdigit()
    assert batch.prompt_ids[0] != ByteTokenizer()(batch.items[0]["question"]).input_ids  # system prompt: templated
    raw = Config.from_dict({**config.to_dict(), "task": {**task, "system_prompt": None}})
    batch = generate(Trainer(raw, model=tiny_model("llama", dtype=torch.float32, seed=0), tokenizer=ByteTokenizer(),
                             train_data=train, eval_data=held_out, reward_fn=reward), 1)
    assert batch.prompt_ids[0] == ByteTokenizer()(batch.items[0]["question"]).input_ids  # TRL: plain text, no template


def test_a_run_is_evaluated_from_any_folder_and_titled_with_its_data(model_folder, tmp_path, monkeypatch, capsys):
    """A run started with a relative data file and a reward module of its folder: its saved config names them by
    absolute path, so `eval --checkpoint RUN_DIR` works from another folder (it worked only from the one the run
    started in), and the table is titled with the file and its held-out rows (it said the default task's)."""
    import yaml

    from branchreplay.cli import main

    start, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    start.mkdir()
    elsewhere.mkdir()
    _jsonl(start / "train.jsonl", [{"prompt": f"{a} {b}"} for a in range(5) for b in range(2)])
    (start / "my_rewards.py").write_text("def lengths(completions, **kwargs):\n"
                                         "    return [float(len(c) % 3) for c in completions]\n")
    monkeypatch.chdir(start)
    run = start / "run"
    assert main(["train", "--model.spec", str(model_folder), "--task.dataset", "train.jsonl", "--task.eval_size", "3",
                 "--task.reward", "my_rewards:lengths", "--grpo.num_generations", "2", "--grpo.prompts_per_step",
                 "1", "--sampling.max_new_tokens", "3", "--train.steps", "1", "--train.eval_steps", "-1",
                 "--train.output_dir", "run"]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())["task"]
    assert saved["dataset"] == str(start / "train.jsonl") and saved["reward"] == f"{start / 'my_rewards.py'}:lengths"
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"held-out{start / 'train.jsonl'}(3items)" in "".join(out.split()) and "eval/reward" in out  # own reward


@pytest.mark.parametrize("column, value, found", [
    ("question_text", 42, "holds 42 \\(a int\\): it must be text"),
    ("question_text", None, "holds None \\(a NoneType\\): it must be text"),
    ("question_text", "", "is empty; remove the row or fill it"),
    ("solution", {"value": 3}, "holds \\{'value': 3\\} \\(a dict\\): an answer is a string or a number"),
    ("solution", None, "holds None .*an answer is a string or a number"),
    ("solution", " ", "is empty: the reward has no answer to compare with"),
])
def test_a_prompt_file_cell_that_is_not_text_is_named(tmp_path, column, value, found):
    """A prompt or answer of the wrong type, or an empty answer (it trained silently, scored 0 by the task's reward
    and math_verify alike), is one error naming the file, the file's own 1-based line and the column (rows were
    counted from 0, "row 5" on line 6); held-out rows of task.eval_dataset are named with that field."""
    rows = [dict(r) for r in PLAIN]
    rows[5][column] = value
    path = _jsonl(tmp_path / "cells.jsonl", rows)
    cfg = dict(prompt_column="question_text", answer_column="solution", reward="math_verify")
    with pytest.raises(ValueError, match=f"task.dataset {path} line 6, column '{column}' {found}"):
        load_task(TaskConfig(dataset=path, eval_size=2, **cfg))
    with pytest.raises(ValueError, match=f"task.eval_dataset {path} line 6, column '{column}'"):
        load_task(TaskConfig(dataset=_jsonl(tmp_path / "ok.jsonl", PLAIN), eval_dataset=path, **cfg))
    load_task(TaskConfig(dataset=_jsonl(tmp_path / "number.jsonl", PLAIN[:5] + [{**PLAIN[5], "solution": 7}]),
                         eval_size=2, **cfg))  # a number is an answer
    if column == "solution":  # a user's reward function takes its columns as they are, as in TRL
        load_task(TaskConfig(dataset=path, eval_size=2, **{**cfg, "reward": "pkg.mod:fn"}))


def test_an_assistant_tool_call_without_content_is_a_message():
    """Chat templates take {"role": "assistant", "content": None, "tool_calls": [...]}; content None alone is not."""
    from branchreplay.rl.data.cells import check_messages

    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "1+1"}}}
    check_messages([{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": None, "tool_calls": [call]}],
                   "row 0:")
    with pytest.raises(ValueError, match="row 0: message 1 has 'content' None"):
        check_messages([{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": None}], "row 0:")


BROKEN = {  # file text -> what the one line says after the file's name
    "": "has no rows",
    "\n  \n\n": "has no rows",
    '{"question_text": "1+1=?", "solution": "2"},\n': "line 1 is not valid JSON: Extra data at column 44",
    '{"question_text": "1+1=?", "solution": "2"}\n{"question_text": "\\ud800", "solution": "2"}\n':
        "line 2, column 'question_text': a lone surrogate",
    '{"question_text": "1+1=?", "solution": "2"}\n[1, 2]\n': "line 2 holds a JSON list, not an object of columns",
    '{"question_text": "1+1=?", "solution": "2"}\n{"solution": "4"}\n': "line 2 lacks the column(s) question_text",
}


@pytest.mark.parametrize("text", BROKEN, ids=["empty", "blank-lines", "trailing-comma", "lone-surrogate", "a-list",
                                              "a-row-without-a-column"])
def test_a_broken_jsonl_file_is_one_line_naming_the_file_and_the_line(tmp_path, text):
    """task.dataset and dpo.dataset alike (they ended in a traceback of the datasets library, or its "Instruction
    'train' corresponds to no data!")."""
    from branchreplay.rl.data.datafiles import read_rows

    path = tmp_path / "broken.jsonl"
    path.write_text(text, errors="surrogatepass")
    with pytest.raises(ValueError, match=f"task.dataset {path} {BROKEN[text]}".replace("(", r"\(").replace(")", r"\)")):
        load_task(TaskConfig(dataset=str(path), prompt_column="question_text", answer_column="solution",
                             eval_size=0, reward="math_verify"))
    with pytest.raises(ValueError, match=f"dpo.dataset {path}"):
        read_rows(path, "dpo.dataset", ("question_text",))


def test_a_string_cell_stays_a_string(tmp_path):
    """" 1." in a JSONL cell is the string " 1.", not the number 1.0 (the datasets library read it as one)."""
    path = _jsonl(tmp_path / "strings.jsonl", [{"question_text": "1-0=?", "solution": " 1."}] * 3)
    train, _ = load_task(TaskConfig(dataset=path, prompt_column="question_text", answer_column="solution",
                                    eval_size=0, reward="math_verify"))
    assert train[0]["answer"] == " 1."


def test_a_new_users_reward_errors_come_early_and_loud(tmp_path, monkeypatch, capsys, model_folder):
    """Issue 64: a reward needing a column the file lacks was found at step 1, skipped with a RuntimeWarning quoting
    trainer.py, and `--train.steps 1` exited 0; a raising reward kept no traceback anywhere. Now the first is one
    line and exit 2 before the model loads (the model folder does not exist), the second exit 1 naming
    RUN_DIR/errors.log, which holds the traceback through the user's own line; the step says it once."""
    from branchreplay.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a} {b}"}) + "\n" for a in range(3, 9)
                                                  for b in range(3, 5)))
    (tmp_path / "new_user_rewards.py").write_text(
        "def correct(completions, answer, **kwargs):\n    return [float(c == a) for c, a in zip(completions, answer)]\n"
        "\n\ndef broken(completions, **kwargs):\n    return [1 / 0 for c in completions]\n")
    common = ["--task.dataset", "train.jsonl", "--task.eval_size", "2", "--grpo.num_generations", "2",
              "--grpo.prompts_per_step", "2", "--sampling.max_new_tokens", "3", "--train.eval_steps", "-1"]
    assert main(["train", "--model.spec", "no-such-model-folder", *common, "--task.reward",
                 "new_user_rewards:correct", "--train.output_dir", "a"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not (tmp_path / "a").exists()
    assert ("task.reward 'new_user_rewards:correct' needs the argument 'answer', which no column of task.dataset "
            "train.jsonl supplies (its columns: prompt;") in err
    assert main(["train", "--model.spec", str(model_folder), *common, "--task.reward", "new_user_rewards:broken",
                 "--train.steps", "1", "--train.output_dir", "b"]) == 1
    out, err = capsys.readouterr()
    logged = (tmp_path / "b" / "errors.log").read_text()
    assert "ZeroDivisionError: division by zero" in logged and "new_user_rewards.py" in logged
    assert "return [1 / 0 for c in completions]" in logged
    assert "every step of this run was skipped" in err and "b/errors.log" in err
    assert "RuntimeWarning" not in out + err and "trainer.py" not in out + err
    assert out.count("division by zero") == 1  # the step's line


def test_dry_run_prints_each_rewards_value_per_completion_and_trains_nothing(tmp_path, monkeypatch, capsys,
                                                                            model_folder):
    """`train --dry-run` samples 2 prompts x min(G, 4) completions with the run's own config, scores each with each
    reward function and prints them; no run folder is written. A raising reward: exit 1, its traceback printed."""
    from branchreplay.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a} {b}", "target": str(a)}) + "\n"
                                                  for a in range(3, 9) for b in range(3, 5)))
    (tmp_path / "dry_rewards.py").write_text(
        "def length(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n\n\n"
        "def hit(completions, target, **kwargs):\n    return [float(t in c) for c, t in zip(completions, target)]\n\n\n"
        "def broken(completions, **kwargs):\n    raise ValueError('no grader here')\n")
    common = ["--dry-run", "--model.spec", str(model_folder), "--task.dataset", "train.jsonl", "--task.eval_size", "2",
              "--grpo.num_generations", "8", "--sampling.max_new_tokens", "4", "--train.output_dir", "run"]
    assert main(["train", *common, "--task.reward", "dry_rewards:length,dry_rewards:hit",
                 "--task.reward_weights", "[1.0, 2.0]"]) == 0
    out = capsys.readouterr().out
    assert "2 prompts x 4 completions, nothing trained" in out and "length" in out and "hit" in out
    rows = [line for line in out.splitlines() if line.startswith("│ 3 3") or line.startswith("│ 3 4")]
    assert len(rows) == 8 and not (tmp_path / "run").exists()
    assert main(["train", *common, "--task.reward", "dry_rewards:broken"]) == 1
    err = capsys.readouterr().err
    assert "reward function 'broken' raised ValueError: no grader here" in err and "dry_rewards.py" in err
