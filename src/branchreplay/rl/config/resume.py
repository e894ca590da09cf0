"""What a resumed run may change, and where its configs are kept.

A run folder keeps every config the run used: `config.yaml` (the first, never rewritten) and, for each resume that
changed something, `config-resumed-at-step-N.yaml` (N: the first step it trained). `--resume RUN_DIR` starts from
the newest of them, then the command line's overrides apply, and only what does not change what the run trains on
and towards may differ (`RESUMABLE`: how long it runs, how often it saves and evaluates, how gradients are
computed, the engine, the launch, where samples come from and the device). Any other change (the algorithm, the
model, the objective, the sampling, the task, the seed) would make one run folder hold two runs: it is refused by
name. A launch setting of the run does not bind its resume: `parallel.strategy` fsdp2 or ddp of a data-parallel run
becomes auto when the resume is not started by torchrun, so that it runs in one process with no extra flag.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import yaml

FIRST = "config.yaml"
RESUMED = re.compile(r"^config-resumed-at-step-(\d+)\.yaml$")
RESUMABLE = ("train.steps", "train.save_steps", "train.eval_steps", "train.keep_checkpoints", "train.log_completions",
             "train.max_failed_steps", "train.output_dir", "train.method", "train.unknown_family", "train.report_to",
             "task.reward_timeout_s", "engine.*",
             "parallel.*", "sampling.backend", "sampling.vllm_url", "sampling.vllm_timeout_s", "model.device")
"""Fields a resume may change (`section.*`: every field of the section): how long it runs (train.steps: the
learning-rate schedule is rebuilt over the new total and continues from the checkpoint's step, so the steps after the
resume take the new schedule's rates for their step: a 2-step cosine run resumed to 4 steps trains steps 3 and 4 at
the 4-step schedule's rates for steps 3 and 4), how often it saves and evaluates, how gradients are computed
(train.method: equal to floating-point tolerance), the engine, the launch (parallel.*: another world size), where
samples come from (the vLLM server) and the device."""


def latest_config(run_dir: str | Path) -> Path:
    """The newest config of the run in `run_dir` (module docstring); config.yaml when there is no other."""
    run_dir = Path(run_dir)
    resumed = sorted((int(m.group(1)), p) for p in run_dir.glob("config-resumed-at-step-*.yaml")
                     if (m := RESUMED.match(p.name)))
    return resumed[-1][1] if resumed else run_dir / FIRST


def checkpoint_step(run_dir: str | Path) -> int | None:
    """The step of the run's latest checkpoint (its `checkpoints/latest` pointer), or None."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    match = re.match(r"^step-(\d+)$", pointer.read_text().strip())
    return int(match.group(1)) if match else None


def launch_free(data: dict, overrides: list[str]) -> list[str]:
    """Overrides that turn the run's parallel.strategy (fsdp2 or ddp, a data-parallel launch) into auto when this
    process was not started by torchrun and the command line does not set it (with a warning)."""
    strategy = (data.get("parallel") or {}).get("strategy", "auto")
    named = any(arg.split("=", 1)[0] == "--parallel.strategy" for arg in overrides)
    if strategy == "auto" or named or "RANK" in os.environ:
        return overrides
    warnings.warn(f"the run was launched with parallel.strategy={strategy}; this resume is not started by torchrun, "
                  "so it runs in one process (parallel.strategy auto)", stacklevel=3)
    return [*overrides, "--parallel.strategy=auto"]


def check_resume(saved: dict, resumed: dict, run_dir: Path) -> None:
    """Raise ValueError naming every field whose value `resumed` (the resume's config, as a dict) changes from
    `saved` (the run's newest config) outside `RESUMABLE`, and a train.steps below the checkpoint's step."""
    changed = [(name, before, after) for name, before, after in _differences(saved, resumed)
               if not any(name == f or (f.endswith(".*") and name.startswith(f[:-1])) for f in RESUMABLE)]
    if changed:
        said = "; ".join(f"{name} was {before!r}, now {after!r}" for name, before, after in changed)
        raise ValueError(f"--resume {run_dir} continues the run as it was trained: {said}. Start another run for "
                         "that (another --train.output_dir), or drop the override. A resume may change train.steps, "
                         "the save and eval cadence, train.method, engine.*, parallel.*, the vLLM server and "
                         "model.device")
    task, before, after = resumed.get("task") or {}, saved.get("train") or {}, resumed.get("train") or {}
    was_on, is_on = before.get("eval_steps", 0) >= 0, after.get("eval_steps", 0) >= 0
    if task.get("dataset") and not task.get("eval_dataset") and was_on != is_on:
        raise ValueError(f"--resume {run_dir}: train.eval_steps {'-1 would train on' if was_on else 'would hold out'} "
                         f"the rows of {task['dataset']} that the run {'held out' if was_on else 'trained on'}; keep "
                         "evaluation as it was, or give task.eval_dataset")
    step = checkpoint_step(run_dir)
    steps = (resumed.get("train") or {}).get("steps")
    if step is not None and steps is not None and steps < step:
        raise ValueError(f"--resume {run_dir}: its checkpoint is at step {step}, so train.steps={steps} trains "
                         f"nothing; give train.steps > {step} to go on")


def save_run_config(run_dir: Path, config, saved: dict | None, first_step: int) -> list[str]:
    """Write `config` (a `Config`, its paths and modules resolved) into the run folder: config.yaml for a new run
    (`saved` None); for a resume that changed fields from `saved` (its newest config, as a dict), the config it
    trains with as config-resumed-at-step-N.yaml (N: `first_step`), the earlier ones kept. Returns the changed
    fields ([] for a new run, or a resume that changed nothing)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if saved is None:
        config.save(run_dir / FIRST)
        return []
    changed = changed_fields(saved, config.to_dict())
    if changed:
        config.save(run_dir / f"config-resumed-at-step-{first_step}.yaml")
    return changed


def changed_fields(saved: dict, current: dict) -> list[str]:
    """The fields (section.field) whose values differ between two configs as dicts, train.output_dir aside."""
    return [name for name, _, _ in _differences(saved, current) if name != "train.output_dir"]


def _differences(a: dict, b: dict) -> list[tuple[str, object, object]]:
    out = []
    for section in sorted(set(a) | set(b)):
        x, y = a.get(section), b.get(section)
        if isinstance(x, dict) or isinstance(y, dict):
            x, y = x or {}, y or {}
            out += [(f"{section}.{k}", x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
        elif x != y:
            out.append((section, x, y))
    return out


def read(path: Path) -> dict:
    """A config file as a dict (empty for an empty file)."""
    return yaml.safe_load(Path(path).read_text()) or {}
