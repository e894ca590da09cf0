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
                    extra: dict | None = None) -> Path:
    """Write the checkpoint of `step` atomically, point `latest` at it, delete all but the `keep` newest.

    `extra`: small picklable trainer counters, returned by `load_checkpoint`.
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
    try:
        safetensors.torch.save_model(model, str(tmp / WEIGHTS))
        torch.save(
            {
                "step": step,
                "optimizer": optimizer.state_dict(),
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
        safetensors.torch.load_model(model, str(path / WEIGHTS), strict=True)
    except RuntimeError as e:
        raise ValueError(f"checkpoint {path} does not fit the model (written for another model.spec?): {e}") from e


def load_checkpoint(checkpoint: str | Path, model, optimizer, scheduler) -> tuple[int, dict]:
    """Restore weights, optimizer, scheduler and RNG states from a checkpoint folder; returns (step, extra)."""
    path = Path(checkpoint)
    load_weights(model, path)
    state = torch.load(path / STATE, weights_only=False)  # our own file: numpy RNG state needs pickle
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return int(state["step"]), state["extra"]


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
