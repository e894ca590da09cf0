"""How a run stops early: interrupted by a signal (after a checkpoint), failed (after a checkpoint of the last good
step), or because another rank died; and the signal handler that turns Ctrl-C into a stop after the step."""

from __future__ import annotations

import contextlib
import os
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


def raise_if_a_rank_died(ranks, during: str, run_dir: Path, error: Exception) -> None:
    """Raise `RankDied` when `error` (a failed collective, or a checkpoint write that failed with it) came from
    another rank that stopped beating (`parallel.Heartbeat`), saying what the ranks were `during` ("step 3", "the
    checkpoint of step 3"); return otherwise, and at once in one process or for the trainer's own errors."""
    if ranks is None or ranks.heartbeat is None or isinstance(error, TrainingFailed):
        return
    dead = ranks.heartbeat.dead_ranks()
    if dead:
        ranks.heartbeat.leaving()
        said = " ".join(str(error).split())[:200]
        raise RankDied(run_dir, f"rank {', '.join(map(str, dead))} of {ranks.world_size} died during {during} "
                       f"(no heartbeat for {ranks.heartbeat.wait_s:g} s; the collective said: {said})") from error


@contextlib.contextmanager
def stop_on_signals(stop: list, console):
    """While active, the first SIGINT/SIGTERM appends its name to `stop` (the loop then finishes the step, saves and
    stops); a second one raises KeyboardInterrupt. Only in the main thread (Python's signal rule).

    What the user sees comes at once, from a watcher thread woken by the signal (`signal.set_wakeup_fd`): Python
    runs a signal handler only when the main thread is back in Python, and a collective waiting for another rank
    (gloo's all-gather while that rank samples) can hold it for minutes. So the watcher prints "finishing this
    step ...", and at a second signal "aborting", then ends the process (exit 130) if the main thread has not
    raised within `ABORT_GRACE_S` seconds."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    aborted = threading.Event()  # the main thread took the second signal itself: no process exit

    def handler(signum, frame):
        if stop:
            aborted.set()
            raise KeyboardInterrupt
        stop.append(signal.Signals(signum).name)

    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch, args=(read, console, aborted), name="branchreplay-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(wakeup)
        for s, h in previous.items():
            signal.signal(s, h)
        os.close(write)  # the watcher reads the end of the pipe and returns
        watcher.join(timeout=5)
        if not watcher.is_alive():  # else it still reads `read`: left open rather than closed under it
            os.close(read)


ABORT_GRACE_S = 3.0
"""Seconds a second signal leaves the main thread to raise KeyboardInterrupt before the watcher ends the process."""


def _watch(read: int, console, aborted: threading.Event) -> None:
    """The signals' watcher (`stop_on_signals`): one byte per signal from the wakeup pipe, until it closes; after a
    second SIGINT/SIGTERM, the process ends unless the main thread took it (`aborted`) within `ABORT_GRACE_S`.
    The pipe carries every signal that has a Python handler (math_verify's SIGALRM timeouts, a DataLoader's
    SIGCHLD): only SIGINT and SIGTERM count."""
    seen = 0
    while True:
        data = os.read(read, 16)
        if not data:
            return
        for number in data:
            if number not in (signal.SIGINT, signal.SIGTERM):
                continue
            seen += 1
            name = signal.Signals(number).name
            if seen == 1:
                console.print(f"[yellow]{name}: finishing this step, then saving a checkpoint (again to abort now)")
            elif seen == 2:
                console.print(f"[yellow]{name} again: aborting")
                timer = threading.Timer(ABORT_GRACE_S, lambda: aborted.is_set() or os._exit(130))
                timer.daemon = True
                timer.start()
        console.file.flush()
