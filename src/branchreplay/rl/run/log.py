"""What a training run leaves in its folder: the metrics log (and TensorBoard), the summary table and the plot."""

from __future__ import annotations

import json
import os
import resource
import time
import uuid
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table


def run_console(quiet: bool = False) -> Console:
    """The console a run prints to: rich's own on a terminal; elsewhere (a log file, CI) plain lines that are not
    wrapped at rich's 80 columns, tables at most `COLUMNS` wide (200 when unset)."""
    console = Console(quiet=quiet)
    if console.is_terminal:
        return console
    return Console(quiet=quiet, soft_wrap=True, width=int(os.environ.get("COLUMNS", 200)))


def held_out_progress(console: Console, status=lambda text: None, always: bool = False):
    """The progress callback of a held-out evaluation (`evaluation.evaluate`'s `progress(done, total)`): it hands
    "held-out eval: 16/64 answers" to `status` (a progress bar's text), and prints it with the seconds so far when
    `always`, or when `console` is not a terminal (a log file shows the evaluation advance)."""
    t0 = time.perf_counter()

    def progress(done: int, total: int) -> None:
        text = f"held-out eval: {done}/{total} answers"
        status(text)
        if always or not console.is_terminal:
            console.print(f"{text} ({time.perf_counter() - t0:.0f} s)")

    return progress


def quiet_progress_bars() -> None:
    """Turn off the progress bars of transformers, huggingface_hub and datasets (their own switches), which flood
    a log that is not a terminal ("Writing model shards", "Creating parquet")."""
    from transformers.utils import logging

    logging.disable_progress_bar()  # huggingface_hub's too
    try:
        import datasets  # not a dependency of ours: installed with trl, or by a user's data loading
    except ImportError:
        return
    datasets.disable_progress_bars()


class MetricsLog:
    """RUN_DIR/metrics.jsonl, one JSON object per step (step 0: the evaluation before training), mirrored to the
    loggers of `report_to` (`config.sections.report_targets`): TensorBoard (RUN_DIR/tb) when
    `torch.utils.tensorboard` imports (said on the console when it does not), Weights & Biases (`WandbRun`); and
    RUN_DIR/completions.jsonl, the sampled completions of each step (`write_completions`, train.log_completions).
    Lines of steps after `truncate_after` (written after the checkpoint a resume starts from) are dropped from both,
    so a resumed run's logs read as an uninterrupted one. `config`: the run's config, as W&B's run config."""

    def __init__(self, run_dir: Path, truncate_after: int, console: Console | None = None,
                 report_to: str = "tensorboard", config: dict | None = None):
        from ..config.sections import report_targets

        targets = report_targets(report_to)
        self.path = run_dir / "metrics.jsonl"
        self.records = _truncated(self.path, truncate_after)
        _truncated(run_dir / "completions.jsonl", truncate_after)
        self.completions = None  # opened on the first write_completions
        self.file = open(self.path, "a")
        self.tb = None
        if "tensorboard" in targets:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(run_dir / "tb"))
            except ImportError:
                if console is not None:  # said once, when the run starts: never silently off
                    console.print("TensorBoard: off (pip install tensorboard to mirror metrics.jsonl into RUN_DIR/tb)")
        self.wandb = WandbRun(run_dir, config) if "wandb" in targets else None

    def write(self, record: dict) -> None:
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, record["step"])

    def write_completions(self, step: int, rows: list[dict]) -> None:
        """Append one JSON object per sampled completion of `step` to RUN_DIR/completions.jsonl (TRL's
        log_completions): each row's fields and "step"."""
        if self.completions is None:
            self.completions = open(self.path.with_name("completions.jsonl"), "a")
        self.completions.write("".join(json.dumps({"step": step, **row}) + "\n" for row in rows))
        self.completions.flush()

    def close(self) -> None:
        self.file.close()
        if self.completions is not None:
            self.completions.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


class WandbRun:
    """The run's Weights & Biases run: project $WANDB_PROJECT (default "branchreplay"), named after the run folder,
    its files under RUN_DIR/wandb, its id kept in RUN_DIR/wandb_id so that a resume logs to the same run (W&B
    drops the steps a resume repeats). W&B's own settings apply (WANDB_MODE=offline: no network)."""

    def __init__(self, run_dir: Path, config: dict | None):
        import wandb

        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "branchreplay"), name=run_dir.name,
                                  id=run_id, resume="allow", dir=str(run_dir), config=config)
        except Exception as e:  # noqa: BLE001 (no API key, no network: wandb's own errors)
            raise ValueError(f"train.report_to=wandb: W&B did not start ({type(e).__name__}: {e}); run `wandb "
                             "login`, set WANDB_MODE=offline, or drop wandb from train.report_to") from e

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def finish(self) -> None:
        self.run.finish()


class NoLog:
    """The metrics log of a rank other than 0: records kept in memory, nothing written."""

    def __init__(self):
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def write_completions(self, step: int, rows: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


def _truncated(path: Path, after: int) -> list[dict]:
    """The records of the JSONL file `path` up to step `after`, rewritten atomically without the later ones."""
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in records if r["step"] <= after]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)
    return records


HELD_OUT = ("eval/accuracy", "eval/reward")
"""The held-out score's metric, whichever the run logs (`evaluation.score_key`)."""


def held_out_key(records: list[dict]) -> str:
    """The first of `HELD_OUT` that a record holds ("eval/accuracy" when none does)."""
    return next((key for key in HELD_OUT if any(key in r for r in records)), HELD_OUT[0])


def summarize(console: Console, run_dir: Path, records: list[dict], reward_name: str = "reward") -> Path:
    """Print a table of the run's main metrics (first, last, best) and save RUN_DIR/training.png: train reward and
    held-out score by step, labelled with `reward_name` (the reward functions' or the environment's name), whole
    steps on the axis. Returns the plot's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    table = Table(title=f"run {run_dir}")
    for col in ("metric", "first", "last", "min", "max"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for key in ("reward", "rewards/accuracies", "rewards/margins", *HELD_OUT, "eval/frac_correct", "loss",
                "entropy", "completions/mean_length", "turns/mean", "tool_calls/mean", "tool_calls/error_rate",
                "eval/turns_mean", "eval/tool_calls_mean", "tree/token_ratio", "time/sample_s", "time/sample_env_s",
                "time/train_s", "time/step_s"):
        values = [r[key] for r in records if key in r]
        if values:
            table.add_row(key, *(f"{v:.4g}" for v in (values[0], values[-1], min(values), max(values))))
    console.print(table)
    fig, ax = plt.subplots(figsize=(7, 4))
    plotted = False
    for key, label, style in (("reward", f"train reward ({reward_name})", "-"),
                              ("rewards/accuracies", "DPO preference accuracy", "-"),
                              (held_out_key(records), f"held-out ({reward_name})", "o-")):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=label)
            plotted = True
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylabel("mean score")
    if plotted:  # below the axes: inside, it covered the reward curve
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    ax.grid(alpha=0.3)
    path = run_dir / "training.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    console.print(f"plot: {path}")
    return path


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: torch.cuda.max_memory_allocated on a GPU, else the process's peak RSS (getrusage)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def skip_reason(why: str, traceback_file=None) -> str:
    """Why a step was skipped, and where its reward's traceback was written when one was (RUN_DIR/errors.log)."""
    return f"{why}; traceback in {traceback_file}" if traceback_file else why


def progress_info(record: dict) -> str:
    """One line for the progress bar: reward (DPO: the preference accuracy), loss (PPO: the policy's and the
    critic's), tokens per second (logical positions per step second)."""
    if "loss" not in record:
        why = " ".join(str(record.get("skipped", "the reward failed")).split())
        return f"skipped ({skip_reason(why if len(why) <= 100 else why[:97] + '...', record.get('traceback'))})"
    tokens_per_s = record["tree/logical_tokens"] / max(record["time/step_s"], 1e-9)
    head = (f"reward {record['reward']:.3f}" if "reward" in record
            else f"rewards/accuracies {record['rewards/accuracies']:.3f}")
    loss = f"loss {record['loss']:+.4f}"
    if "loss/value_avg" in record:  # PPO: the policy loss and the critic's, as TRL's PPOTrainer logs them
        loss = f"policy loss {record['loss']:+.4f}  value loss {record['loss/value_avg']:.4f}"
    return f"{head}  {loss}  {tokens_per_s:.0f} tok/s"


def step_line(record: dict, total_steps: int, score: str = "accuracy") -> str:
    """One printed line per step (kept above the progress bar): the bar's info, the sampling / training split in
    seconds (drawn ahead: the sampler process's own seconds and the trainer's wait), the staleness and the importance
    sampling ratio's mean and min where the step has them, and the held-out score when the step evaluated, called
    `score` ("accuracy" when the task's scores are one, else "mean reward": `rl.run.evaluation.score_name`), or why
    the evaluation was skipped."""
    parts = [f"step {record['step']}/{total_steps}"]
    if "loss" in record:
        sample = f"sample {record['time/sample_s']:.1f} s"
        if "time/sampler_process_s" in record:  # drawn ahead: the sampler's own seconds, then the trainer's wait
            sample = f"sample {record['time/sampler_process_s']:.1f} s (waited {record['time/sample_s']:.1f} s)"
        parts += [progress_info(record), sample, f"train {record['time/train_s']:.1f} s"]
        if "sample/staleness_mean" in record:
            parts.append(f"staleness {record['sample/staleness_mean']:.1f} (max {record['sample/staleness_max']})")
        if "sampling/importance_sampling_ratio/mean" in record:
            parts.append(f"IS ratio {record['sampling/importance_sampling_ratio/mean']:.3f} "
                         f"(min {record['sampling/importance_sampling_ratio/min']:.3f})")
    elif record["step"] > 0:
        parts.append(progress_info(record))
    key = held_out_key([record])
    if key in record:
        parts.append(f"held-out {score} {record[key]:.3f} ({record['time/eval_s']:.0f} s)")
    if "eval/error" in record:
        parts.append(f"held-out evaluation skipped ({record['eval/error'][:100]})")
    return "  ".join(parts)
