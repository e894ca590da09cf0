"""Atomic training checkpoints in a run folder.

    RUN_DIR/checkpoints/step-000010/model.safetensors   model weights (shared tensors, e.g. tied embeddings, once)
    RUN_DIR/checkpoints/step-000010/trainer_state.pt    step, optimizer, scheduler, python/numpy/torch RNG states
    RUN_DIR/checkpoints/latest                          text: the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary folder next to its target, every file fsynced, then renamed into
place (rename is atomic on POSIX), and only then is `latest` replaced (written to a temporary file, fsynced,
os.replace). A crash at any point leaves either the previous checkpoint or the new one, never a half-written one;
leftover temporary folders are ignored by `latest_checkpoint` and removed by the next save.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

_NAME = re.compile(r"^step-(\d+)$")
WEIGHTS = "model.safetensors"
STATE = "trainer_state.pt"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, scheduler, keep: int = 2,
                    extra: dict | None = None, full_state: tuple[dict, dict] | None = None) -> Path:
    """Write the checkpoint of `step` atomically, point `latest` at it, delete all but the `keep` newest.

    `extra`: small picklable trainer counters, returned by `load_checkpoint`. `full_state`: (model, optimizer)
    full state dicts already gathered from the ranks (`full_state`), for a data-parallel run's rank 0; by default
    they are read from `model` and `optimizer`. The optimizer state is keyed by parameter name
    (torch.distributed.checkpoint.state_dict's full format), so any world size resumes it.
    Returns the checkpoint folder. Raises OSError on a write failure (the previous checkpoint stays valid)."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob(".tmp-*"):  # from a save that crashed
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
    name = f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    model_state, optimizer_state = full_state or _full_state(model, optimizer)
    try:
        safetensors.torch.save_file(_without_tied(model, model_state), str(tmp / WEIGHTS))
        torch.save(
            {
                "step": step,
                "optimizer": optimizer_state,
                "scheduler": scheduler.state_dict(),
                "rng": _rng_state(),
                "extra": extra or {},
            },
            tmp / STATE,
        )
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        target = root / name
        if target.exists():  # re-saving a step (e.g. after a resume): replace it
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic(root / "latest", name)
    _fsync(root)
    for old in _complete(root)[:-keep]:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return target


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder of a run, or None. Uses `latest`, else the highest complete step."""
    root = checkpoints_dir(run_dir)
    pointer = root / "latest"
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if _is_complete(target):
            return target
    complete = _complete(root)
    return complete[-1] if complete else None


def load_weights(model, checkpoint: str | Path) -> None:
    """Load a checkpoint's weights into `model` (a checkpoint folder or a run folder, whose latest is used).

    Raises FileNotFoundError when there is no complete checkpoint there."""
    path = Path(checkpoint)
    if not (path / WEIGHTS).is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"{path} holds no checkpoint ({WEIGHTS} or checkpoints/latest)")
        path = found
    try:
        if any(hasattr(p, "to_local") for p in model.parameters()):  # sharded (FSDP2): every rank reads the file
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            state = safetensors.torch.load_file(str(path / WEIGHTS))
            state.update({name: state[kept] for name, kept in _tied_names(model).items() if kept in state})
            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
        else:
            safetensors.torch.load_model(model, str(path / WEIGHTS), strict=True)
    except RuntimeError as e:
        raise ValueError(f"checkpoint {path} does not fit the model (written for another model.spec?): {e}") from e


def load_checkpoint(checkpoint: str | Path, model, optimizer, scheduler) -> tuple[int, dict]:
    """Restore weights, optimizer, scheduler and RNG states from a checkpoint folder; returns (step, extra)."""
    path = Path(checkpoint)
    load_weights(model, path)
    state = torch.load(path / STATE, weights_only=False)  # our own file: numpy RNG state needs pickle
    saved = state["optimizer"]
    if all(isinstance(k, str) for k in saved.get("state", {})):  # keyed by parameter name: any world size
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        for p in model.parameters():  # torch initialises the optimizer's state only for parameters without grads
            p.grad = None
        set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True))
    else:  # keyed by position (checkpoints written before data parallelism)
        optimizer.load_state_dict(saved)
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return int(state["step"]), state["extra"]


def full_state(model, optimizer) -> tuple[dict, dict]:
    """(model, optimizer) full state dicts on the CPU, keyed by parameter name; a collective on every rank of a
    data-parallel run (FSDP2 shards are gathered), a plain read in one process."""
    return _full_state(model, optimizer)


def _full_state(model, optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def _tied_names(model) -> dict[str, str]:
    """{name of a parameter that repeats an earlier one (tied weights, e.g. lm_head.weight): the earlier name}."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def _without_tied(model, state: dict) -> dict:
    """`state` with one entry per tensor (safetensors refuses shared storage), contiguous, as `save_model` writes."""
    tied = _tied_names(model)
    return {k: v.contiguous() for k, v in state.items() if k not in tied}


def _complete(root: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first (temporary folders never match the step-N name)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and _is_complete(p)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def _is_complete(path: Path) -> bool:
    return (path / WEIGHTS).is_file() and (path / STATE).is_file()


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
