"""Crash consistency, proven by killing: a tiny run (8 steps, a checkpoint every step) is killed with SIGKILL 21 times,
at three sites a step drawn from a seeded generator among six (sampling, the update, the optimizer shards written, the
weights written, the checkpoint complete but not renamed, renamed but `latest` not yet naming it), in steps 1 to 7, and
resumed after each kill; another run is killed 8 times at moments drawn at random (so also inside a write, wherever one
falls), resumed after each (a fresh run with kills twice as early, where the machine sped up since the uninterrupted run
was timed). After every kill the run folder is usable: its latest checkpoint is complete and loads (none only before the
first). Each run that ends after its kills logs what an uninterrupted run logs, every step. The processes are forked
from a server that has imported torch once (multiprocessing's forkserver), so each attempt starts in under a second. A
checkpoint written in place, with a completeness check that looks at the weights alone, fails it (checked by mutating
the code)."""

import json
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from branchreplay.rl.run.checkpoint import latest_checkpoint, load_checkpoint
from test_rl_run_trainer import make_config, make_trainer

SITES = ("sampling", "update", "optimizer shards", "weights", "before rename", "before latest")
STEPS = 8


def _config(tmp: Path):
    return make_config(tmp, train={"steps": STEPS, "save_steps": 1, "keep_checkpoints": 2})


def _attempt(tmp: str, site: str | None, step: int) -> None:
    """One process of the run: resume (or start) it, and at `site` of `step` say so in tmp/at-site, then wait to
    be killed. site None: train to the end."""
    import safetensors.torch

    import branchreplay.rl.run.checkpoint as checkpoint
    from branchreplay.rl.policy import Policy
    from branchreplay.rl.rollouts.sampler import Sampler

    torch.set_num_threads(1)
    tmp = Path(tmp)
    trainer = make_trainer(_config(tmp))

    def stop_here(saving: bool):
        if (trainer.step if saving else trainer.step + 1) == step:
            (tmp / "at-site").write_text(f"{site} {step}")
            time.sleep(60)  # the test kills this process here

    def wrap(owner, name, when: str, saving: bool):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if when == "before":
                stop_here(saving)
            out = original(*args, **kwargs)
            if when == "after":
                stop_here(saving)
            return out

        setattr(owner, name, wrapped)

    if site is not None:
        owner, name, when, saving = {
            "sampling": (Sampler, "sample", "before", False),
            "update": (Policy, "backward", "after", False),  # gradients computed, the optimizer not stepped
            "optimizer shards": (checkpoint.dcp, "save", "after", True),
            "weights": (safetensors.torch, "save_file", "after", True),
            "before rename": (checkpoint, "_publish", "before", True),
            "before latest": (checkpoint, "write_atomic", "before", True),
        }[site]
        wrap(owner, name, when, saving)
    run = tmp / "run"
    trainer.fit(resume=run if latest_checkpoint(run) is not None else None)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def forks():
    """A forkserver context whose server has imported torch, transformers and the trainer once."""
    context = mp.get_context("forkserver")
    # the package's modules (Python 3.11's forkserver does not apply sys.path to its preload: the tests' own modules,
    # light, are imported by each child)
    context.set_forkserver_preload(["branchreplay.rl.run.trainer", "branchreplay.models", "rich.console"])
    return context


@pytest.mark.slow
def test_runs_killed_29_times_stay_usable_and_end_as_an_uninterrupted_one(tmp_path, forks):
    whole_run_s = 0.0
    for straight in (tmp_path / "warm-up", tmp_path / "straight"):  # the first starts the fork server
        process = forks.Process(target=_attempt, args=(str(straight), None, 0))
        began = time.monotonic()
        process.start()
        process.join(120)
        assert process.exitcode == 0
        whole_run_s = time.monotonic() - began
    rng = random.Random(0)
    # three sites a step, in the order a step meets them (after "before latest" the step is saved: no site is left)
    kills = [(step, site) for step in range(1, STEPS) for site in sorted(rng.sample(SITES, 3), key=SITES.index)]
    killed = tmp_path / "killed"
    for step, site in kills:
        (killed / "at-site").unlink(missing_ok=True)
        process = forks.Process(target=_attempt, args=(str(killed), site, step))
        process.start()
        deadline = time.monotonic() + 120
        while not (killed / "at-site").exists() and process.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert (killed / "at-site").exists(), f"the attempt never reached {site} of step {step}"
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)
        assert process.exitcode == -signal.SIGKILL
        found = _usable(killed / "run", tmp_path)
        if found is None:
            assert step == 1, (site, step)  # killed before the first checkpoint: the next attempt starts afresh
            continue
        # the last complete one; or, killed after the rename and before `latest` named it, the one renamed
        assert found in (step - 1, step), (site, step, found)
    _finish_and_compare(forks, killed, straight)
    assert len(kills) >= 20

    scale = 1.0
    for fresh in range(3):  # a fresh run, with kills twice as early, where the machine sped up since `whole_run_s`
        timed, kills = tmp_path / f"timed-{fresh}", 0
        while kills < 8:  # at random moments: the run moves on by what each attempt finished before its kill
            process = forks.Process(target=_attempt, args=(str(timed), None, 0))
            process.start()
            process.join(rng.uniform(0.05, 0.4) * scale * whole_run_s)
            if not process.is_alive():
                break  # the run ended before this kill
            os.kill(process.pid, signal.SIGKILL)
            process.join(30)
            kills += 1
            _usable(timed / "run", tmp_path)
        _finish_and_compare(forks, timed, straight)
        if kills >= 4:
            break
        scale /= 2
    assert kills >= 4, f"only {kills} of the timed kills came before the run ended"


def _usable(run: Path, tmp_path: Path) -> int | None:
    """The step of the run folder's latest checkpoint, after checking that it is complete and loads (None: there is
    none yet)."""
    found = latest_checkpoint(run)
    if found is None:
        return None
    fresh = make_trainer(_config(tmp_path / "fresh"))
    step = load_checkpoint(found, fresh.model, fresh.policy.optimizer, fresh.policy.scheduler)[0]
    assert step == int(found.name.split("-")[1])
    return step


def _finish_and_compare(forks, tmp: Path, straight: Path) -> None:
    """Resume the run of `tmp` to its end; its metrics must equal the uninterrupted run's, every step."""
    process = forks.Process(target=_attempt, args=(str(tmp), None, 0))
    process.start()
    process.join(120)
    assert process.exitcode == 0
    ours, theirs = _metrics(tmp / "run"), _metrics(straight / "run")
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(1, STEPS + 1))
    for a, b in zip(ours, theirs, strict=True):
        for key in ("reward", "loss", "grad_norm", "learning_rate", "num_tokens"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
