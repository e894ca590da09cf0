"""How a run stops early: interrupted by a signal (after a checkpoint), failed (after a checkpoint of the last good
step), or because another rank died; and the signal handler that turns Ctrl-C into a stop after the step."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path


class TrainingInterrupted(RuntimeError):
    """SIGINT/SIGTERM stopped training after a checkpoint was written; `run_dir` is the folder to resume."""

    def __init__(self, run_dir: Path, step: int):
        super().__init__(f"training stopped after step {step}; checkpoint saved. Resume with: "
                         f"branchreplay train --resume {run_dir}")
        self.run_dir, self.step = run_dir, step


class TrainingFailed(RuntimeError):
    """The run stopped: train.max_failed_steps consecutive steps were skipped (the reward, or every item's
    environment, failed), or the vLLM server stopped answering; the last good step was checkpointed in `run_dir`,
    so the run resumes from it once the cause is fixed. `why` says what happened."""

    def __init__(self, run_dir: Path, why: str):
        super().__init__(f"{why}. Fix it, then resume from the last good step: branchreplay train --resume {run_dir}")
        self.run_dir = run_dir


class RankDied(TrainingFailed):
    """Another rank of a data-parallel run died (killed, out of memory): this rank's collective failed, and the
    heartbeats (`parallel.Heartbeat`) name the dead rank. The last checkpoint in `run_dir` is complete (written
    atomically), so the run resumes from it."""


def raise_if_a_rank_died(ranks, step: int, run_dir: Path, error: RuntimeError) -> None:
    """Raise `RankDied` when `error` (a failed collective during `step`) came from another rank that stopped
    beating (`parallel.Heartbeat`); return otherwise, and at once in one process or for the trainer's own errors."""
    if ranks is None or ranks.heartbeat is None or isinstance(error, TrainingFailed):
        return
    dead = ranks.heartbeat.dead_ranks()
    if dead:
        ranks.heartbeat.leaving()
        said = " ".join(str(error).split())[:200]
        raise RankDied(run_dir, f"rank {', '.join(map(str, dead))} of {ranks.world_size} died during step {step} "
                       f"(no heartbeat for {ranks.heartbeat.wait_s:g} s; the collective said: {said})") from error


@contextlib.contextmanager
def stop_on_signals(stop: list, console):
    """While active, the first SIGINT/SIGTERM appends its name to `stop` (the loop then finishes the step, saves and
    stops); a second one raises KeyboardInterrupt at once. Only in the main thread (Python's signal rule)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.append(signal.Signals(signum).name)
        console.print(f"[yellow]{stop[0]}: finishing this step, then saving a checkpoint (again to abort now)")

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
