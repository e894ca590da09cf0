"""Faults in a data-parallel run on 2 CPU processes with gloo: a rank killed mid-step (`RankDied`, the heartbeat
of rl/run/parallel.py), a reward error in the held-out eval and a checkpoint write error on one rank, each stopping
every rank at once; the checkpoint left behind resumes."""

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from branchreplay.engine.parallel.distributed import free_port
from helpers import spawn_ranks
from test_engine_distributed import _records, _train_config


def _record_outcome(path, call) -> None:
    """Write the seconds `call()` took and how it ended ("no error", or the exception's type and text) to `path`."""
    t0 = time.perf_counter()
    try:
        call()
        outcome = "no error"
    except BaseException as e:  # noqa: BLE001 (what the test reads)
        outcome = f"{type(e).__name__}: {e}"
    path.write_text(f"{time.perf_counter() - t0:.1f}\n{outcome}")


def _killed_worker(rank: int, world: int, port: int, tmp: str, killed: int, phase: str = "backward") -> None:
    import signal
    from pathlib import Path

    from branchreplay.rl.run.stops import RankDied
    from test_rl_run_trainer import make_trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    trainer = make_trainer(_train_config(Path(tmp), 3, "fsdp2", "killed"), dtype=torch.float64)
    if rank == killed and phase == "backward":  # kill -9 of itself in step 3, as its backward starts
        backward = trainer.policy.backward
        trainer.policy.backward = lambda *args: os.kill(os.getpid(), signal.SIGKILL) if trainer.step == 2 \
            else backward(*args)
    if rank == killed and phase == "checkpoint":  # in the checkpoint of step 3, its optimizer shards written
        import torch.distributed.checkpoint as dcp

        save = dcp.save
        dcp.save = lambda *args, **kwargs: (save(*args, **kwargs), trainer.step == 3 and os.kill(
            os.getpid(), signal.SIGKILL))[0]
    t0 = time.perf_counter()
    try:
        trainer.fit()
        outcome = "no error"
    except RankDied as e:
        outcome = str(e)
    (Path(tmp) / "survivor.txt").write_text(f"{time.perf_counter() - t0:.1f}\n{outcome}")
    os._exit(0)  # as the CLI after RankDied: the broken process group is not torn down


@pytest.mark.slow
@pytest.mark.parametrize("killed, phase", [(1, "backward"), (0, "backward"), (1, "checkpoint")],
                         ids=["rank-1", "rank-0-the-store", "rank-1-in-the-checkpoint"])
def test_a_rank_killed_mid_step_stops_the_other_with_its_name_and_the_checkpoint_resumes(killed, phase, tmp_path):
    """kill -9 of one rank in step 3 of a 2-rank FSDP2 run (checkpoint at step 2), in its backward or while the
    ranks write the step-3 checkpoint: the other's collective fails at once (gloo), its heartbeat check names the
    dead rank in a one-line RankDied within parallel.timeout_s (120 s here), and the step-2 checkpoint, still the
    latest and complete, resumes in one process to the end of the run. Rank 0 holds the rendezvous store here (no
    torchrun agent): its death is found by the store going away."""
    from test_rl_run_trainer import make_trainer

    context = mp.get_context("spawn")  # not mp.spawn: it would stop rank 0 as soon as rank 1 dies
    port = free_port()
    procs = [context.Process(target=_killed_worker, args=(r, 2, port, str(tmp_path), killed, phase))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == ([0, -9] if killed == 1 else [-9, 0])
    seconds, outcome = (tmp_path / "survivor.txt").read_text().split("\n", 1)
    during = "the checkpoint of step 3" if phase == "checkpoint" else "step 3"
    assert "\n" not in outcome and outcome.startswith(f"rank {killed} of 2 died during {during}"), outcome
    assert f"--resume {tmp_path / 'killed'}" in outcome and float(seconds) <= 120, (seconds, outcome)
    assert (tmp_path / "killed" / "checkpoints" / "latest").read_text().strip() == "step-000002"
    make_trainer(_train_config(tmp_path, 3, run="killed"), dtype=torch.float64).fit(resume=tmp_path / "killed")
    assert [r["step"] for r in _records(tmp_path / "killed")] == [1, 2, 3]


def _fault_worker(rank: int, world: int, port: int, tmp: str, fault: str) -> None:
    """Rank 1 of a 2-rank run (FSDP2 resharded: the ranks' packs run in lock-step) raises an out-of-memory error in
    its backward of step 2 and exits as the CLI does under torchrun ("raises"), or its reward never returns in step
    2 ("hangs"); each rank writes the seconds to its end and its error."""
    from pathlib import Path

    from test_rl_run_trainer import byte_reward, make_config, make_trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    calls = []

    def reward(completions, **kwargs):
        calls.append(1)
        if rank == 1 and fault == "hangs" and len(calls) == 2:
            time.sleep(600)  # the test ends this process
        return byte_reward(completions, **kwargs)

    config = make_config(Path(tmp), grpo={"prompts_per_step": 2},
                         parallel={"strategy": "fsdp2", "fsdp_mode": "resharded", "timeout_s": 15},
                         task={"reward_timeout_s": 600}, train={"steps": 3, "save_steps": 1})
    trainer = make_trainer(config, dtype=torch.float64, reward_fn=reward)
    if rank == 1 and fault == "raises":
        backward = trainer.policy.backward
        trainer.policy.backward = lambda *args: backward(*args) if trainer.step < 1 else (_ for _ in ()).throw(
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)"))
    _record_outcome(Path(tmp) / f"rank{rank}.txt", trainer.fit)
    os._exit(1)  # as the CLI after an error under torchrun: no teardown of the group another rank may still use


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["raises", "hangs"])
def test_a_rank_that_raises_or_hangs_is_named_in_one_line(tmp_path, fault):
    """Rank 1 raises an out-of-memory error inside the lock-step backward: rank 0 used to wait until
    parallel.timeout_s and end with torch's error; now it ends at once with one line naming rank 1 and its error.
    Rank 1's reward hangs (its heartbeat beats on): rank 0 ends after parallel.timeout_s (15 s) with one line naming
    rank 1 and what it was doing (scoring), not gloo's "Timed out waiting" alone. The step-1 checkpoint is intact."""
    context = mp.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=_fault_worker, args=(r, 2, port, str(tmp_path), fault)) for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(timeout=300)
    procs[1].join(timeout=5 if fault == "hangs" else 60)
    procs[1].kill()
    seconds, outcome = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert "\n" not in outcome, outcome
    if fault == "raises":
        assert outcome.startswith("RankDied: rank 1 of 2 died during step 2 (rank 1: failed in step 2: "
                                  "OutOfMemoryError: CUDA out of memory."), outcome
        assert float(seconds) < 60, (seconds, outcome)  # the timeout is 15 s here, 600 s by default: before, > 15
    else:
        assert outcome.startswith("RankStuck: rank 1 of 2 did not arrive during step 2 within parallel.timeout_s, "
                                  "alive but stuck (rank 1 has been at 'step 2: scoring 4 completions' for "), outcome
        assert 15 <= float(seconds) < 120, (seconds, outcome)
    assert f"--resume {tmp_path / 'run'}" in outcome
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step-000001"


def _eval_error_worker(rank: int, world: int, tmp: str) -> None:
    from pathlib import Path

    from test_rl_run_trainer import byte_reward, make_trainer

    def reward(completions, **kwargs):
        if rank == 1:
            raise RuntimeError("grader crashed")
        return byte_reward(completions, **kwargs)

    trainer = make_trainer(_train_config(Path(tmp), 1), reward_fn=reward)
    _record_outcome(Path(tmp) / f"rank{rank}.txt", trainer.evaluate)  # the expected error caught


@pytest.mark.slow
def test_a_reward_error_in_the_held_out_eval_stops_every_rank_at_once(tmp_path):
    """Rank 1's reward raises during the sharded eval: rank 1 raises it, and rank 0 a RewardFunctionError naming
    rank 1, both at once (they used to wait for each other until the collective timeout)."""
    spawn_ranks(_eval_error_worker, 2, str(tmp_path), group=False)
    outcomes = [(tmp_path / f"rank{r}.txt").read_text().split("\n", 1) for r in range(2)]
    assert all(float(seconds) < 60 for seconds, _ in outcomes), outcomes  # the timeout is 120 s
    assert "grader crashed" in outcomes[1][1]
    # as the same kind of error, so that every rank takes the trainer's path for a failing reward (its warning)
    assert outcomes[0][1].startswith("RewardFunctionError: held-out evaluation failed on rank 1") and \
        "grader crashed" in outcomes[0][1]


WRITE_ERRORS = {"disk full": (OSError, 28, "No space left on device"), "permission": (PermissionError, 13,
                                                                                     "Permission denied")}


def _save_error_worker(rank: int, world: int, tmp: str, error: str) -> None:
    from pathlib import Path

    import branchreplay.rl.run.checkpoint as checkpoint
    from test_rl_run_trainer import make_trainer

    def fails(*args, **kwargs):
        kind, number, text = WRITE_ERRORS[error]
        raise kind(number, text)

    trainer = make_trainer(_train_config(Path(tmp), 1))
    checkpoint._write_rank0 = fails  # rank 0's files fail, after every rank wrote its optimizer shards
    _record_outcome(Path(tmp) / f"rank{rank}.txt", lambda: trainer.save(Path(tmp) / "run"))  # the error caught


@pytest.mark.slow
@pytest.mark.parametrize("error", WRITE_ERRORS)
def test_a_checkpoint_write_error_on_rank_0_stops_every_rank_at_once(tmp_path, error):
    """No half-written checkpoint, and no rank waits for the collective timeout (120 s) to learn of it. The other
    rank takes the same path whatever OSError it was (a PermissionError is one: the type is gathered, not read from
    its name)."""
    spawn_ranks(_save_error_worker, 2, str(tmp_path), error, group=False)
    outcomes = [(tmp_path / f"rank{r}.txt").read_text().split("\n", 1) for r in range(2)]
    assert all(float(seconds) < 60 for seconds, _ in outcomes), outcomes
    for rank in range(2):  # the run's one-line error on every rank (a TrainingFailed, issue 29 item 7)
        assert outcomes[rank][1].startswith("TrainingFailed: the checkpoint of step 0 could not be written"), outcomes
        assert WRITE_ERRORS[error][2] in outcomes[rank][1]
    assert "writing the checkpoint failed on rank 0" in outcomes[1][1], outcomes[1]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not [p for p in checkpoints.iterdir() if p.name != "latest"] if checkpoints.exists() else True


@pytest.fixture
def rendezvous(monkeypatch):
    """(a rendezvous store on a free port, a function making rank 0's `Heartbeat` among `world` ranks against it);
    the heartbeats stop after the test."""
    import torch.distributed as dist

    from branchreplay.rl.run.parallel import Heartbeat

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    made = []

    def rank_0(world: int) -> Heartbeat:
        made.append(Heartbeat(0, world, period_s=0.05, wait_s=0.3))
        return made[-1]

    yield store, rank_0
    for heartbeat in made:
        heartbeat.stop()


def test_the_heartbeat_names_the_silent_rank_and_not_a_survivor_that_is_leaving(rendezvous):
    """Of 3 ranks, rank 1 stopped beating and rank 2 stopped because it found rank 1 dead (`leaving`): rank 0
    names rank 1 only (with 3 or more ranks a slower survivor must not blame the one that left first)."""
    from branchreplay.rl.run.parallel import Heartbeat

    store, rank_0 = rendezvous
    heartbeat = rank_0(3)
    for rank in (1, 2):
        store.add(f"{Heartbeat.PREFIX}{rank}/beats", 1)
    store.set(f"{Heartbeat.PREFIX}2/leaving", "1")
    assert heartbeat.dead_ranks() == [1]


def test_a_rank_that_raised_or_is_leaving_is_not_named_stuck(rendezvous):
    """Of 4 ranks, rank 1 raised (its phase says so), rank 2 is leaving and rank 3 sits in its reward: rank 0 names
    rank 3 only (with 3 or more ranks a survivor that timed out first must not be taken for the stuck one)."""
    import json

    from branchreplay.rl.run.parallel import Heartbeat

    store, rank_0 = rendezvous
    heartbeat = rank_0(4)
    phases = {1: "failed in step 2: RuntimeError: Timed out", 2: "step 2: scoring 8 completions",
              3: "step 2: scoring 8 completions"}
    for rank, text in phases.items():
        store.set(f"{Heartbeat.PREFIX}{rank}/phase", json.dumps([time.time() - 30, text, False]))
    store.set(f"{Heartbeat.PREFIX}2/leaving", "1")
    assert [(r, text) for r, text, _ in heartbeat.stuck_ranks()] == [(3, "step 2: scoring 8 completions")]


def test_a_rank_died_error_skips_the_teardown_of_the_broken_group(monkeypatch, tmp_path):
    """`train` closes the process group after a failed run (a barrier), except after RankDied: the group is broken,
    its barrier would raise another error (gloo) or block (nccl) in place of the one-line message."""
    import branchreplay.rl.run.trainer as trainer
    from branchreplay.rl.run.stops import RankDied

    class Dying:
        def __init__(self, config):
            pass

        def fit(self, resume):
            raise RankDied(tmp_path, "rank 1 of 2 died during step 3")

    torn_down = []
    monkeypatch.setattr(trainer, "Trainer", Dying)
    monkeypatch.setattr(trainer, "shutdown", lambda: torn_down.append(True))
    with pytest.raises(RankDied, match="rank 1 of 2 died during step 3"):
        trainer.train(None)
    assert not torn_down


def _blocked_worker(rank: int, world: int, tmp: str) -> None:
    import signal
    import threading
    from pathlib import Path

    import torch.distributed as dist
    from rich.console import Console

    from branchreplay.rl.run.stops import stop_on_signals

    if rank == 1:  # the other rank is still sampling: rank 0 waits for it in a collective
        time.sleep(6)
        said = (Path(tmp) / "rank0.log").read_text()  # what the user saw before the collective returned
        (Path(tmp) / "seen-while-waiting.txt").write_text(said)
        dist.barrier()
        return
    with open(Path(tmp) / "rank0.log", "w") as log:
        console, stop = Console(file=log, force_terminal=False), []
        with stop_on_signals(stop, console):
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C while in the collective
            dist.barrier()
            console.print(f"barrier returned, stop={stop}")


@pytest.mark.slow
def test_ctrl_c_is_answered_at_once_while_a_collective_waits(tmp_path):
    """Ctrl-C on rank 0 while it waits in a collective for a rank still sampling (minutes on a loaded machine):
    Python runs the handler only when the collective returns, so the user saw nothing until the step ended; the
    watcher thread says at once that the run stops after this step."""
    spawn_ranks(_blocked_worker, 2, str(tmp_path))
    assert "SIGINT: finishing this step" in (tmp_path / "seen-while-waiting.txt").read_text()
    assert (tmp_path / "rank0.log").read_text().splitlines()[-1] == "barrier returned, stop=['SIGINT']"


WATCHED = """
import ctypes, os, signal, sys, threading
from rich.console import Console
from branchreplay.rl.run import stops

stops.ABORT_GRACE_S = 0.5
stop = []
with stops.stop_on_signals(stop, Console(file=sys.stdout, force_terminal=False)):
    signal.signal(signal.SIGALRM, lambda *args: None)  # as math_verify's timeouts install one
    kills = [(0.2, signal.SIGALRM), (0.4, signal.SIGALRM), (0.6, signal.SIGINT), (0.8, signal.SIGALRM)]
    kills += [(1.0, signal.SIGINT)] if sys.argv[1] == "twice" else []
    for at, number in kills:  # threads started before the mask below: the signals reach a thread that takes them
        threading.Timer(at, os.kill, (os.getpid(), number)).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGALRM})  # the main thread stuck in C, as in
    ctypes.CDLL(None).sleep(3)                                                # a collective
    print("main thread back", stop, flush=True)
"""


@pytest.mark.parametrize("times", ["once", "twice"])
def test_other_signals_do_not_count_and_a_second_ctrl_c_aborts_a_stuck_run(tmp_path, times):
    """SIGALRM (math_verify's timeouts) reaches the same wakeup pipe: it must neither stop nor abort the run. One
    SIGINT: said at once, the run goes on to the end of its step. A second SIGINT while the main thread is stuck
    in C code (a collective): 'aborting', and the process ends with 130 after ABORT_GRACE_S."""
    import subprocess
    import sys

    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    done = subprocess.run([sys.executable, str(script), times], capture_output=True, text=True, timeout=60)
    out = done.stdout
    assert "SIGINT: finishing this step" in out and "SIGALRM" not in out, out
    if times == "once":
        assert done.returncode == 0 and "aborting" not in out and "main thread back ['SIGINT']" in out, out
    else:
        assert done.returncode == 130 and "SIGINT again: aborting" in out and "main thread back" not in out, out
