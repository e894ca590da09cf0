"""The GRPO trainer when a run is resumed or fails: a resume that lengthens the run or changes it, a reward that
fails on the held-out answers, an incomplete latest checkpoint, a full disk and a read-only folder. The stand-ins
(tiny Llama, byte tokenizer, toy task) are tests/test_rl_run_trainer.py's.
"""

import shutil

import pytest

from branchreplay.rl.run.checkpoint import latest_checkpoint
from branchreplay.rl.run.stops import TrainingFailed
from test_rl_run_trainer import _metrics, byte_reward, make_config, make_trainer


@pytest.mark.slow
def test_a_resume_may_lengthen_the_run_and_keeps_every_config(tmp_path):
    """A finished 2-step cosine run resumed to 4 steps: steps 3 and 4 train at the 4-step schedule's rates for steps
    3 and 4 (before: 0.0 at step 3, the 2-step schedule's end, which the optimizer's saved state carried);
    config.yaml keeps the 2-step config and config-resumed-at-step-3.yaml the 4-step one; a second resume starts
    from the newest."""
    import yaml

    lr = {"learning_rate": 1e-3, "lr_scheduler": "cosine"}
    fresh = _metrics(make_trainer(make_config(tmp_path / "fresh", grpo=lr, train={"steps": 4})).fit())
    run = make_trainer(make_config(tmp_path, grpo=lr, train={"steps": 2})).fit()
    make_trainer(make_config(tmp_path, grpo=lr, train={"steps": 4})).fit(resume=run)
    rates = [r["learning_rate"] for r in _metrics(run)]
    assert rates[:2] == pytest.approx([1e-3, 5e-4]) and 0.0 not in rates
    assert rates[2:] == pytest.approx([r["learning_rate"] for r in fresh][2:])
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 2
    assert yaml.safe_load((run / "config-resumed-at-step-3.yaml").read_text())["train"]["steps"] == 4
    make_trainer(make_config(tmp_path, grpo=lr, train={"steps": 5})).fit(resume=run)
    assert sorted(p.name for p in run.glob("config*.yaml")) == ["config-resumed-at-step-3.yaml",
                                                                "config-resumed-at-step-5.yaml", "config.yaml"]


def test_a_resume_that_changes_the_run_is_refused_by_name(tmp_path):
    """`train --resume RUN --algorithm rloo` (and a loss type, a group size) would make one folder hold two runs:
    refused by name before anything loads, on the command line as in `fit`; train.steps below the checkpoint's
    step too."""
    from branchreplay.rl.config import parse_args

    run = make_trainer(make_config(tmp_path, train={"steps": 2})).fit()
    with pytest.raises(ValueError, match=r"algorithm was 'grpo', now 'rloo'. Start another run"):
        parse_args(["--resume", str(run), "--train.steps", "4", "--algorithm", "rloo"])
    with pytest.raises(ValueError, match=r"grpo.loss_type was 'dapo', now 'grpo'.*another --train.output_dir"):
        parse_args(["--resume", str(run), "--grpo.loss_type", "grpo"])
    with pytest.raises(ValueError, match=r"checkpoint is at step 2, so train.steps=1 trains nothing"):
        parse_args(["--resume", str(run), "--train.steps", "1"])
    with pytest.raises(ValueError, match=r"grpo.num_generations was 4, now 2"):
        make_trainer(make_config(tmp_path, grpo={"num_generations": 2}, train={"steps": 3})).fit(resume=run)
    config, _ = parse_args(["--resume", str(run), "--train.steps", "3", "--engine.max_pack_tokens", "8"])
    assert config.train.steps == 3 and config.engine.max_pack_tokens == 8  # what a resume may change


@pytest.mark.slow
def test_a_reward_that_fails_on_the_held_out_answers_skips_that_evaluation(tmp_path):
    """One rule with the training steps: a reward that raises (or returns the wrong number of values) while scoring
    the held-out answers skips that evaluation with a warning and the run goes on; it used to end the run with a
    traceback from the step-0 evaluation."""
    from rich.console import Console

    def broken_on_held_out(completions, **kwargs):
        if len(completions) == 4:  # the 4 held-out answers (training scores 2 prompts x 4)
            raise KeyError("answer")
        return byte_reward(completions, **kwargs)

    for name, reward in (("raises", broken_on_held_out),
                         ("too-few", lambda completions, **kw: byte_reward(completions)[: 3 if len(completions) == 4
                                                                                    else None])):
        trainer = make_trainer(make_config(tmp_path / name, train={"steps": 2, "eval_steps": 2}), reward_fn=reward)
        trainer.console = Console(record=True, width=200, force_terminal=False)
        with pytest.warns(RuntimeWarning, match="held-out evaluation at step 0 skipped: reward function"):
            run = trainer.fit()
        records = _metrics(run)
        assert [r["step"] for r in records] == [0, 1, 2] and "reward" in records[2]
        assert "eval/error" in records[0] and "eval/accuracy" not in records[0]
        assert "step 0/2  held-out evaluation skipped (reward function" in trainer.console.export_text()


@pytest.mark.slow
def test_an_incomplete_latest_checkpoint_is_named_on_resume(tmp_path):
    """A latest checkpoint with a file missing used to make --resume fall back to the previous one without a word:
    it says which one was incomplete, what it lacks, and which one it resumes from."""
    run = make_trainer(make_config(tmp_path, train={"steps": 2, "save_steps": 1})).fit()
    (run / "checkpoints" / "step-000002" / "model.safetensors").unlink()
    with pytest.warns(RuntimeWarning, match=r"latest checkpoint is incomplete or damaged \(step-000002 lacks "
                                            r"model.safetensors\); resuming from step-000001"):
        make_trainer(make_config(tmp_path, train={"steps": 2, "save_steps": 1})).fit(resume=run)
    assert latest_checkpoint(run).name == "step-000002"


@pytest.mark.slow
@pytest.mark.parametrize("name, cut", [("model.safetensors", 0.5), ("model.safetensors", 100),
                                       ("trainer_state.pt", 64), ("model.safetensors", "flip")])
def test_a_damaged_latest_checkpoint_is_named_and_the_previous_one_resumes(tmp_path, name, cut):
    """A checkpoint file cut short (to half, to 100 or 64 bytes) or with one byte changed used to end `--resume` in
    a safetensors or zip traceback: the resume names the checkpoint and the file, and goes on from the previous
    intact checkpoint; loading the damaged folder by its path is refused with the file named."""
    from branchreplay.rl.run.checkpoint import load_weights

    run = make_trainer(make_config(tmp_path, train={"steps": 2, "save_steps": 1})).fit()
    damaged = run / "checkpoints" / "step-000002"
    data = (damaged / name).read_bytes()
    if cut == "flip":
        data = data[:-9] + bytes([data[-9] ^ 0xFF]) + data[-8:]
        said = rf"{name} fails its SHA-256 checksum"
    else:
        keep = int(len(data) * cut) if isinstance(cut, float) else cut
        data = data[:keep]
        said = rf"{name} has {keep:,} of [\d,]+ bytes"
    (damaged / name).write_bytes(data)
    shutil.copytree(damaged, tmp_path / "kept")  # the resume writes step 2 again
    trainer = make_trainer(make_config(tmp_path, train={"steps": 3, "save_steps": 1}))
    with pytest.warns(RuntimeWarning, match=rf"incomplete or damaged \(step-000002: {said}\); resuming from "
                                            r"step-000001"):
        trainer.fit(resume=run)
    assert trainer.step == 3 and latest_checkpoint(run, verify=True).name == "step-000003"
    if name == "model.safetensors":
        with pytest.raises(ValueError, match=rf"checkpoint .*kept is damaged: {said}; load an earlier"):
            load_weights(trainer.model, tmp_path / "kept")


def _hanging_on_step(step: int, before=lambda: None):
    """byte_reward, except that its call of training step `step` never returns (after calling `before`)."""
    import threading

    calls = []

    def hanging(completions, **kwargs):
        calls.append(len(completions) == 8)  # training calls (2 prompts x 4), not evaluation calls
        if calls[-1] and sum(calls) == step:
            before()
            threading.Event().wait()
        return byte_reward(completions, **kwargs)

    return hanging


@pytest.mark.slow
def test_a_reward_that_never_returns_skips_its_step_after_task_reward_timeout_s(tmp_path):
    """A reward function that never returns used to hold the run forever, printing nothing: past
    task.reward_timeout_s the call counts as a reward that raised (the step skipped with a warning naming the
    function and the limit) and the run goes on."""
    config = make_config(tmp_path, task={"reward_timeout_s": 1}, train={"steps": 3})
    with pytest.warns(RuntimeWarning, match=r"step 2 skipped: reward function 'hanging' raised TimeoutError: reward "
                                            r"function 'hanging' did not return within task.reward_timeout_s=1 s"):
        run = make_trainer(config, reward_fn=_hanging_on_step(2)).fit()
    assert [("skipped" in r, r["step"]) for r in _metrics(run)] == [(False, 1), (True, 2), (False, 3)]


@pytest.mark.slow
def test_a_reward_under_its_timeout_may_use_signals_itself(tmp_path):
    """The timeout runs the reward in the main thread (a SIGUSR1 at the limit), so a reward function that uses
    signals itself, as math-verify's default timeouts do, still runs: in a thread of its own it raised
    "signal only works in main thread" and every step was skipped."""
    import signal

    from math_verify import parse

    def with_alarm(completions, **kwargs):
        signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))  # raises outside the main thread
        assert parse("1/2", parsing_timeout=5)  # math-verify's own SIGALRM timeout
        return byte_reward(completions, **kwargs)

    previous = signal.getsignal(signal.SIGUSR1)
    run = make_trainer(make_config(tmp_path, task={"reward_timeout_s": 30}, train={"steps": 2}),
                       reward_fn=with_alarm).fit()
    assert [("skipped" in r) for r in _metrics(run)] == [False, False]
    assert signal.getsignal(signal.SIGUSR1) is previous  # the timeout's handler is gone after each call


@pytest.mark.slow
def test_a_second_signal_ends_the_run_with_one_line_and_the_last_checkpoint_intact(tmp_path):
    """SIGINT twice while a reward function hangs in step 2: the first asks for a stop after the step, which does
    not end; the second used to end in a KeyboardInterrupt traceback. Now `TrainingAborted`, one line naming what
    was interrupted and the intact checkpoint (step 1's), which resumes."""
    import os
    import signal
    import time

    from branchreplay.rl.run.stops import TrainingAborted

    def twice():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # two SIGINTs pending at once are delivered as one
        os.kill(os.getpid(), signal.SIGINT)

    config = make_config(tmp_path, train={"steps": 3, "save_steps": 1})
    with pytest.raises(TrainingAborted) as aborted:
        make_trainer(config, reward_fn=_hanging_on_step(2, twice)).fit()
    run = tmp_path / "run"
    assert str(TrainingAborted(run, "step 1", None)) == ("aborted during step 1 at a second signal; no checkpoint "
                                                        "was written yet: start the run again")
    assert str(aborted.value) == (f"aborted during step 2 at a second signal; step-000001 is intact. Resume with: "
                                  f"branchreplay train --resume {run}")
    assert latest_checkpoint(run, verify=True).name == "step-000001"
    make_trainer(make_config(tmp_path, train={"steps": 3, "save_steps": 1})).fit(resume=run)
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]


def test_a_resume_may_not_train_on_the_rows_it_held_out(tmp_path):
    """Turning evaluation on or off changes which rows of task.dataset (without task.eval_dataset) are trained on:
    a resume that flips it is refused by name; with an eval_dataset it may."""
    from branchreplay.rl.config.resume import check_resume

    saved = {"task": {"dataset": "rows.jsonl"}, "train": {"eval_steps": -1}}
    with pytest.raises(ValueError, match=r"train.eval_steps would hold out the rows of rows.jsonl that the run "
                                         r"trained on"):
        check_resume(saved, {**saved, "train": {"eval_steps": 10}}, tmp_path)
    with pytest.raises(ValueError, match=r"train.eval_steps -1 would train on the rows of rows.jsonl that the run "
                                         r"held out"):
        check_resume({**saved, "train": {"eval_steps": 5}}, saved, tmp_path)
    held = {"task": {"dataset": "rows.jsonl", "eval_dataset": "held.jsonl"}, "train": {"eval_steps": -1}}
    check_resume(held, {**held, "train": {"eval_steps": 10}}, tmp_path)


def test_a_checksums_file_of_the_wrong_shape_is_named(tmp_path):
    from branchreplay.rl.run.checkpoint import faults

    run = make_trainer(make_config(tmp_path, train={"steps": 1})).fit()
    folder = latest_checkpoint(run)
    for text in ("[1, 2]", '{"model.safetensors": {"sha256": "0"}}', '{"a": 3}'):
        (folder / "checksums.json").write_text(text)
        assert faults(folder, verify=True) == ["checksums.json cannot be read"]


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (one tiny checkpoint fits, two do not); skips where mounting is not permitted."""
    import subprocess

    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.slow
def test_a_full_disk_ends_the_run_with_one_line_and_the_last_checkpoint_intact(small_disk):
    """The step-2 checkpoint does not fit on the disk: the run ends with one line naming the step, the disk's
    error and the checkpoint that is intact; that checkpoint resumes, and no half-written folder is left."""
    config = make_config(small_disk, train={"steps": 3, "save_steps": 1, "keep_checkpoints": 1})
    with pytest.raises(TrainingFailed, match=r"the checkpoint of step 2 could not be written .*(No space left on "
                                             r"device|MiB free on the disk).*step-000001 is intact.*--resume"):
        make_trainer(config).fit()
    run = small_disk / "run"
    assert latest_checkpoint(run).name == "step-000001"
    assert not list((run / "checkpoints").glob(".tmp-*"))
    trainer = make_trainer(make_config(small_disk, train={"steps": 3, "save_steps": 1, "keep_checkpoints": 1}))
    from branchreplay.rl.run.checkpoint import load_checkpoint

    assert load_checkpoint(latest_checkpoint(run), trainer.model, trainer.policy.optimizer,
                           trainer.policy.scheduler)[0] == 1


@pytest.mark.slow
def test_a_read_only_folder_ends_the_run_with_one_line_and_the_last_checkpoint_intact(tmp_path, monkeypatch):
    """The step-2 checkpoint cannot be put in place (a folder that turned read-only: EROFS, injected where the
    rename happens): one line, and the step-1 checkpoint stays the latest and complete."""
    import errno

    import branchreplay.rl.run.checkpoint as checkpoint

    publish = checkpoint._publish

    def read_only(tmp, root, name, keep):
        if name == "step-000002":
            raise OSError(errno.EROFS, "Read-only file system", str(root))
        return publish(tmp, root, name, keep)

    monkeypatch.setattr(checkpoint, "_publish", read_only)
    with pytest.raises(TrainingFailed, match=r"step 2 could not be written .*Read-only file system.*step-000001 is "
                                             r"intact"):
        make_trainer(make_config(tmp_path, train={"steps": 3, "save_steps": 1})).fit()
    run = tmp_path / "run"
    assert latest_checkpoint(run).name == "step-000001" and not list((run / "checkpoints").glob(".tmp-*"))
