"""A run's skipped steps: a step whose reward, or every item's environment, failed trains nothing; it is logged
with why, and with where the reward's traceback was written (RUN_DIR/errors.log). train.max_failed_steps of them in
a row stop the run, and so does a run whose every step was skipped (`Trainer._loop`)."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from .log import skip_reason
from .stops import StepSkipped


@dataclass
class Skips:
    """The skipped steps of a run. limit: train.max_failed_steps (0: they never stop the run); why and traceback:
    the last skipped step's reason and the file holding its reward's traceback (None when none was written);
    in_a_row: skipped steps since the last trained one."""

    limit: int
    why: str | None = None
    traceback: Path | None = None
    in_a_row: int = 0

    def skipped(self, step: int, error: Exception, run_dir: Path, write: bool) -> None:
        """Record that `step` was skipped because of `error` (a RewardFunctionError or an ItemError), its traceback
        appended to RUN_DIR/errors.log when `write` (rank 0) and it has one, and warn once (`StepSkipped`)."""
        self.why, self.traceback = str(error), None
        if write and getattr(error, "traceback", ""):
            self.traceback = write_traceback(run_dir, step, error.traceback)
        warnings.warn(f"step {step} skipped: {self.reason()}", StepSkipped, stacklevel=3)

    def count(self, trained: bool) -> None:
        self.in_a_row = 0 if trained else self.in_a_row + 1

    def reason(self) -> str:
        return skip_reason(self.why, self.traceback)

    def record(self, step: int) -> dict:
        """The metrics record of skipped `step`."""
        return {"step": step, "skipped": self.why, **({"traceback": str(self.traceback)} if self.traceback else {})}

    @property
    def too_many(self) -> bool:
        """train.max_failed_steps skipped steps in a row."""
        return bool(self.limit) and self.in_a_row >= self.limit

    def all_of(self, steps: int) -> bool:
        """Whether the last `steps` steps (a run's, all of them) were all skipped, under a limit."""
        return bool(self.limit) and 0 < steps == self.in_a_row


def write_traceback(run_dir: Path, step: int, text: str) -> Path:
    """Append a failed reward's traceback (`text`) under a line naming `step` to RUN_DIR/errors.log; returns its
    path."""
    path = run_dir / "errors.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"step {step}: {time.strftime('%Y-%m-%d %H:%M:%S')}\n{text.rstrip()}\n\n")
    return path
