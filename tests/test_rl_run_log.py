"""What a training run prints and logs (rl/run/log.py, rl/run/evaluation.py's naming): the step lines and the
held-out progress, plain lines off a terminal, the held-out score's name, TensorBoard, Weights & Biases and
completions.jsonl. The stand-ins (tiny Llama, byte tokenizer, toy task) are tests/test_rl_run_trainer.py's."""

import json

import pytest
import torch

from branchreplay.rl.config import Config
from branchreplay.rl.run.trainer import Trainer
from branchreplay.tiny_models import tiny_model
from test_rl_run_trainer import DATA, ByteTokenizer, _metrics, byte_reward, make_config, make_trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_run_prints_a_line_per_step_and_eval_progress(tmp_path):
    """The user sees every step's reward and its sampling / training seconds, and the held-out evaluation advance."""
    from rich.console import Console

    config = make_config(tmp_path, train={"steps": 2, "eval_steps": 2})
    trainer = make_trainer(config)
    trainer.console = Console(record=True, width=200, force_terminal=False)
    trainer.fit()
    text = trainer.console.export_text()
    assert "step 0/2  held-out accuracy" in text
    for step in (1, 2):
        line = next(x for x in text.splitlines() if x.startswith(f"step {step}/2  reward"))
        assert " sample " in line and " train " in line, line
        assert ("held-out accuracy" in line) == (step == 2), line
    phases = []
    trainer.status = phases.append
    trainer.evaluate()
    assert phases[0] == "held-out eval: 0/4 answers" and phases[-1] == "held-out eval: 4/4 answers", phases


def test_a_log_that_is_not_a_terminal_gets_plain_unwrapped_lines_and_eval_progress(tmp_path, capsys):
    """Printed to a file (here pytest's capture), a run wrapped rich's lines at 80 columns, printed the progress
    bar's frame, and showed nothing during the held-out evaluation (minutes at step 0 on a loaded host: it looked
    hung). Now: no bar, a line per evaluation batch, every step on one line however long; the libraries' own
    progress bars are off ("Writing model shards")."""
    import datasets
    from transformers.utils import logging

    from branchreplay.rl.cli import _plain_output

    make_trainer(make_config(tmp_path, train={"steps": 2, "eval_steps": 2, "output_dir": str(tmp_path / ("a" * 90))}
                             )).fit()
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert not [line for line in lines if line.startswith("step") and "━" in line], out  # the bar's frame
    assert len([line for line in lines if line.startswith("held-out eval: 0/4 answers (")]) == 2, out
    step = next(line for line in lines if line.startswith("step 2/2  reward"))
    assert "held-out accuracy" in step and f"run {tmp_path / ('a' * 90)}" in out, out  # each on one line
    try:
        _plain_output()
        assert not logging.is_progress_bar_enabled() and not datasets.is_progress_bar_enabled()
    finally:
        logging.enable_progress_bar()
        datasets.enable_progress_bars()


def _wandb_history(run_dir) -> list[dict]:
    """The history rows of every offline W&B run file under run_dir/wandb, in order: the file is LevelDB's log
    format (32 KiB blocks of chunks with a 7-byte header: CRC, length, type) after W&B's 7-byte header, each record
    a `wandb_internal_pb2.Record`."""
    import struct

    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, record = path.read_bytes(), 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            record, pos = record + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or its last chunk
                parsed = wandb_internal_pb2.Record()
                parsed.ParseFromString(record)
                record = b""
                if parsed.WhichOneof("record_type") == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                 for i in parsed.history.item})
    return rows


def test_metrics_go_to_weights_and_biases_when_asked(tmp_path, monkeypatch):
    """`report_to: wandb` (TRL's name) was dropped with a warning and `--train.report_to` did not exist: the run now
    logs every step's metrics to W&B (offline here: no network), and a resume logs to the same run. Asking for it
    without wandb installed is refused by name before anything loads."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert Config.from_dict({"report_to": ["tensorboard", "wandb"]}).train.report_to == "tensorboard,wandb"  # TRL's
    run = make_trainer(make_config(tmp_path, train={"steps": 2, "report_to": "wandb"})).fit()
    rows = _wandb_history(run)
    assert [(r["_step"], r["reward"], r["loss"]) for r in rows] == [(r["step"], r["reward"], r["loss"])
                                                                    for r in _metrics(run)]
    run_id = (run / "wandb_id").read_text()
    make_trainer(make_config(tmp_path, train={"steps": 3, "report_to": "wandb"})).fit(resume=run)
    assert [r["_step"] for r in _wandb_history(run)] == [1, 2, 3]
    assert {p.name.rsplit("-", 1)[1] for p in (run / "wandb").glob("offline-run-*")} == {run_id}
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find(name, *a))
    with pytest.raises(ValueError, match="train.report_to asks for wandb, which is not installed: pip install wandb"):
        Config.from_dict({"train": {"report_to": "tensorboard,wandb"}})


def test_log_completions_and_tensorboard_notice(tmp_path):
    """train.log_completions writes every sampled completion of each step to RUN_DIR/completions.jsonl (TRL's
    log_completions), truncated on resume like metrics.jsonl; a run without TensorBoard says so when it starts."""
    from rich.console import Console

    console = Console(record=True, width=200)
    config = make_config(tmp_path, train={"steps": 2, "log_completions": True})
    trainer = Trainer(config, model=tiny_model("llama", dtype=torch.float32, seed=0), tokenizer=ByteTokenizer(),
                      train_data=DATA, eval_data=DATA[:4], reward_fn=byte_reward, console=console)
    batch_rewards = []
    score = trainer.source.score
    trainer.source.score = lambda drawn: batch_rewards.append(b := score(drawn)) or b
    run = trainer.fit()
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 8 + [2] * 8  # 2 prompts x 4 completions per step
    assert rows[0]["prompt"] in [d["question"] for d in DATA] and isinstance(rows[0]["completion"], str)
    assert [r["reward"] for r in rows[:8]] == pytest.approx(batch_rewards[0].rewards.tolist())
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        assert "TensorBoard: off" in console.export_text()
    assert trainer.reward_name() == "byte_reward"
    from branchreplay.rl.run.log import MetricsLog

    MetricsLog(run, truncate_after=1).close()  # what a resume from step 1 does to both logs
    assert {json.loads(line)["step"] for line in (run / "completions.jsonl").read_text().splitlines()} == {1}


def test_what_the_held_out_score_is_called():
    """"accuracy" when the task says its scores are one (its verifier, math_verify, or an environment declaring
    scores_accuracy, as the built-in ones), else "mean reward": an agent run printed "held-out accuracy 2.000" for
    an environment whose rewards are not in [0, 1]."""
    from branchreplay.rl.agent.environments import GuessNumber, calculator
    from branchreplay.rl.run.evaluation import score_name

    config = Config()
    assert score_name(config) == "accuracy" and score_name(config, GuessNumber()) == "accuracy"
    assert score_name(config, calculator(byte_reward)) == "accuracy"
    assert score_name(config, object()) == "mean reward"
    custom = Config.from_dict({"task": {"reward": "task,test_models_lora:length_reward", "reward_weights": [1.0, 0.5]}})
    assert score_name(custom) == "mean reward"


def test_the_held_out_score_of_your_own_reward_is_logged_as_eval_reward(tmp_path):
    """With the user's own reward function the held-out score is its mean reward (-0.018 in a trial): logged as
    eval/reward, as the step line's "held-out mean reward" says; it was logged as eval/accuracy. The summary and
    the plot read it."""
    from rich.console import Console

    config = make_config(tmp_path, task={"reward": "test_rl_run_trainer:byte_reward"},
                         train={"steps": 1, "eval_steps": 1})
    trainer = make_trainer(config)
    trainer.console = Console(record=True, width=200, force_terminal=False)
    records = _metrics(trainer.fit())
    assert [("eval/reward" in r, "eval/accuracy" in r) for r in records] == [(True, False), (True, False)]
    text = trainer.console.export_text()
    assert "step 1/1  reward" in text and "held-out mean reward" in text
    assert "│ eval/reward " in text, text  # the summary table's row


def test_a_step_drawn_ahead_shows_the_samplers_own_time_its_staleness_and_importance_ratio():
    """With grpo.max_staleness the console said `sample 0.0 s` (the trainer's wait) and showed the staleness and the
    importance ratio only in metrics.jsonl: the step line now has the sampler process's own seconds, the wait, the
    staleness and the importance-sampling ratio's mean and min."""
    from branchreplay.rl.run.log import step_line

    record = {"step": 3, "loss": 0.1, "reward": 0.5, "tree/logical_tokens": 1000, "time/step_s": 2.0,
              "time/sample_s": 0.02, "time/sampler_process_s": 1.7, "time/train_s": 1.9,
              "sample/staleness_mean": 1.0, "sample/staleness_max": 1,
              "sampling/importance_sampling_ratio/mean": 0.998, "sampling/importance_sampling_ratio/min": 0.91}
    line = step_line(record, 10)
    assert "sample 1.7 s (waited 0.0 s)" in line and "staleness 1.0 (max 1)" in line
    assert "IS ratio 0.998 (min 0.910)" in line
    drawn_ahead = ("sample/", "sampling/", "time/sampler")
    synchronous = step_line({k: v for k, v in record.items() if not k.startswith(drawn_ahead)}, 10)
    assert "sample 0.0 s" in synchronous and "staleness" not in synchronous and "IS ratio" not in synchronous


def test_the_metrics_page_lists_every_metric_a_run_logs(tmp_path):
    """docs/metrics.md names every key of metrics.jsonl: GRPO with the KL and the held-out evaluation, then PPO (a
    new metric without a line there fails this)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    listed = {k.strip("`") for line in page.splitlines() if line.startswith("| `")
              for k in line.split("|")[1].replace(",", " ").split() if k.startswith("`")}
    logged = set()
    for algorithm, sections in [("grpo", {"grpo": {"beta": 0.04}}), ("ppo", {})]:
        config = make_config(tmp_path / algorithm, train={"steps": 1, "eval_steps": 1}, **sections)
        config = Config.from_dict({**config.to_dict(), "algorithm": algorithm})
        run = make_trainer(config).fit()
        logged |= {k for line in (run / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}
    named = {k.replace("byte_reward", "<name>") for k in logged}
    missing = sorted(named - listed)
    assert not missing, f"logged but not on docs/metrics.md: {missing}"
    assert {"kl", "objective/rlhf_reward", "eval/accuracy", "tree/token_ratio"} <= named
