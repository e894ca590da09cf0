"""How a run stops early: interrupted by a signal (after a checkpoint), failed (after a checkpoint of the last good
step), or because another rank died; and the signal handler that turns Ctrl-C into a stop after the step."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .parallel import Ranks


class StepSkipped(RuntimeWarning):
    """A step was skipped: its reward, or every item's environment, failed (the warning's text says which). The
    command line does not print it: the step's line says it (`log.progress_info`)."""


class TrainingInterrupted(RuntimeError):
    """SIGINT/SIGTERM stopped training after a checkpoint was written; `run_dir` is the folder to resume."""

    def __init__(self, run_dir: Path, step: int):
        super().__init__(f"training stopped after step {step}; checkpoint saved. Resume with: "
                         f"branchreplay train --resume {run_dir}")
        self.run_dir, self.step = run_dir, step


class TrainingAborted(RuntimeError):
    """A second SIGINT/SIGTERM ended the run at once, inside a step or a checkpoint's write; the last complete
    checkpoint of `run_dir` (written atomically) is intact, and the steps after it train again on resume."""

    def __init__(self, run_dir: Path, during: str, kept: Path | None):
        then = (f"{kept.name} is intact. Resume with: branchreplay train --resume {run_dir}" if kept is not None
                else "no checkpoint was written yet: start the run again")
        super().__init__(f"aborted during {during} at a second signal; {then}")
        self.run_dir = run_dir


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


class RankStuck(RankDied):
    """Another rank of a data-parallel run is alive (its heartbeat beats) but never came to the collective this rank
    waited in, until `parallel.timeout_s`: it is stuck in its own code (a reward function, an environment). The
    message names it and its phase (`parallel.Heartbeat.stuck_ranks`)."""


def raise_if_a_rank_died(ranks: Ranks | None, during: str, run_dir: Path, error: Exception) -> None:
    """Raise `RankDied` when `error` (a failed collective, or a checkpoint write that failed with it) came from
    another rank that stopped beating (`parallel.Heartbeat`), saying what the ranks were `during` ("step 3", "the
    checkpoint of step 3") and what the dead rank last said it was doing (its error, when it raised); `RankStuck`
    when the collective timed out, the others beat, and one of them was not waiting in a collective (what it was
    doing, for how long); return otherwise, and at once in one process or for the trainer's own errors."""
    if ranks is None or ranks.heartbeat is None or isinstance(error, TrainingFailed):
        return
    heartbeat = ranks.heartbeat
    said = " ".join(str(error).split())[:200]
    dead = heartbeat.dead_ranks()
    if dead:
        heartbeat.leaving()
        last = "; ".join(f"rank {r}: {text}" for r in dead if (text := heartbeat.last_phase(r)))
        raise RankDied(run_dir, f"rank {', '.join(map(str, dead))} of {ranks.world_size} died during {during} "
                       + (f"({last}; " if last else "(") + f"no heartbeat for {heartbeat.wait_s:g} s; the collective "
                       f"said: {said})") from error
    stuck = heartbeat.stuck_ranks() if "timed out" in said.lower() else []  # a rank that never came
    if stuck:
        heartbeat.leaving()
        what = "; ".join(f"rank {r} has been at '{text}' for {seconds:.0f} s" for r, text, seconds in stuck)
        raise RankStuck(run_dir, f"rank {', '.join(str(r) for r, _, _ in stuck)} of {ranks.world_size} did not "
                        f"arrive during {during} within parallel.timeout_s, alive but stuck ({what}; its heartbeat "
                        "beats: a reward function past task.reward_timeout_s, an environment or a tool that does not "
                        f"return?); the collective said: {said}") from error


@contextlib.contextmanager
def stop_on_signals(stop: list, console, aborted_line: Callable[[], str] = lambda: ""):
    """While active, the first SIGINT/SIGTERM appends its name to `stop` (the loop then finishes the step, saves and
    stops); a second one raises KeyboardInterrupt (the trainer turns it into `TrainingAborted`). Only in the main
    thread (Python's signal rule).

    What the user sees comes at once, from a watcher thread woken by the signal (`signal.set_wakeup_fd`): Python
    runs a signal handler only when the main thread is back in Python, and a collective waiting for another rank
    (gloo's all-gather while that rank samples) can hold it for minutes. So the watcher prints "finishing this
    step ...", and at a second signal "aborting", then, if the main thread has not raised within `ABORT_GRACE_S`
    seconds, prints `aborted_line()` (what is intact, how to resume) and ends the process (exit 130)."""
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
    watcher = threading.Thread(target=_watch, args=(read, console, aborted, aborted_line), name="branchreplay-signals",
                               daemon=True)
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


def _watch(read: int, console, aborted: threading.Event, aborted_line: Callable[[], str]) -> None:
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
                timer = threading.Timer(ABORT_GRACE_S, _abort, (console, aborted, aborted_line))
                timer.daemon = True
                timer.start()
        console.file.flush()


def _abort(console, aborted: threading.Event, aborted_line: Callable[[], str]) -> None:
    """End the process (exit 130) unless the main thread took the second signal itself, with `aborted_line()`."""
    if aborted.is_set():
        return
    line = aborted_line()
    if line:
        console.print(line, markup=False, highlight=False)
        console.file.flush()
    os._exit(130)
