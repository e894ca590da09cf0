"""Atomic training checkpoints in a run folder, written by every rank of a data-parallel run together.

    RUN_DIR/checkpoints/step-000010/   model.safetensors and config.json (a Hugging Face model folder), or the LoRA
                                       adapter's files; optimizer/ (DCP shards, loaded on any world size);
                                       trainer_state.pt (step, scheduler, RNG states, counters); critic/ (PPO's
                                       value model, as above); checksums.json (every other file's size and SHA-256)
    RUN_DIR/checkpoints/latest         text: the name of the newest complete checkpoint

A crash or a rank that dies during a save leaves the previous checkpoint or the new one, never a half-written one
(`save_checkpoint` lists every file and how it is written); a checkpoint damaged after it was written is told by
its checksums.json (`faults`), and a resume then takes the newest intact one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ...engine.parallel.distributed import raise_together
from ...models import tied_names

_NAME = re.compile(r"^step-(\d+)$")
WEIGHTS = "model.safetensors"
ADAPTER = "adapter_model.safetensors"
OPTIMIZER = "optimizer"
STATE = "trainer_state.pt"
CRITIC = "critic"
CHECKSUMS = "checksums.json"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


# The files of a checkpoint (save_checkpoint writes them):
# RUN_DIR/checkpoints/step-000010/model.safetensors   the consolidated weights (shared tensors, e.g. tied
#                                                     embeddings, once), gathered to rank 0 and written there
# RUN_DIR/checkpoints/step-000010/config.json         the model's config (and generation_config.json, the
#                                                     tokenizer's files): the folder loads with
#                                                     `AutoModelForCausalLM.from_pretrained` (the export)
# RUN_DIR/checkpoints/step-000010/adapter_model.safetensors, adapter_config.json
#                                                     instead, for a LoRA run (model.lora_r): the adapter only,
#                                                     as peft's `save_pretrained` writes it
# RUN_DIR/checkpoints/step-000010/optimizer/          the optimizer state, sharded: `torch.distributed.checkpoint`
#                                                     (DCP), each rank writing its own shards (FSDP2), a
#                                                     replicated tensor (DDP) once, by one of the ranks; keyed by
#                                                     parameter name, so any world size loads it (DCP reshards)
# RUN_DIR/checkpoints/step-000010/trainer_state.pt    step, scheduler, python/numpy/torch RNG states, counters
# RUN_DIR/checkpoints/step-000010/critic/             PPO's value model: model.safetensors, config.json,
#                                                     optimizer/ and trainer_state.pt (its scheduler), as above
# RUN_DIR/checkpoints/step-000010/checksums.json      every other file of the folder: its size in bytes and its
#                                                     SHA-256, written last
# RUN_DIR/checkpoints/latest                          text: the name of the newest complete checkpoint
def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, scheduler, keep: int = 2,
                    extra: dict | None = None, tokenizer=None, critic: tuple | None = None) -> Path:
    """Write the checkpoint of `step` atomically (its files: the comment above), point `latest` at it, delete all
    but the `keep` newest.

    A collective in a data-parallel run: every rank calls it (the weights are gathered to rank 0, the optimizer
    shards written by their ranks). `extra`: small picklable trainer counters, returned by `load_checkpoint`;
    `tokenizer`: saved beside the weights when given, so that the folder is a complete Hugging Face model.
    `critic`: (value model, its optimizer, its scheduler), written into critic/ of the same checkpoint.
    Returns the checkpoint folder. Raises OSError on a write failure (the previous checkpoint stays valid); in a
    data-parallel run every rank raises (the others a RuntimeError naming the rank), except for a failure inside
    DCP's own collectives, which the others see at the collective timeout (parallel.timeout_s).

    A checkpoint is written into a hidden temporary folder next to its target (rank 0 creates it and every rank
    writes into it: ranks on several nodes need a shared filesystem), every file fsynced; after a barrier rank 0
    renames it into place (rename is atomic on POSIX), and only then is `latest` replaced (written to a temporary
    file, fsynced, os.replace). A crash at any point, or a rank that dies during the save, leaves either the
    previous checkpoint or the new one, never a half-written one; leftover temporary folders are ignored by
    `latest_checkpoint` and removed by the next save."""
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    root = checkpoints_dir(run_dir)
    name = f"step-{step:06d}"
    tmp, error = [None], None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for leftover in root.glob(".tmp-*"):  # from a save that crashed
                if leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink(missing_ok=True)
            tmp = [tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root)]
            os.chmod(tmp[0], 0o777 & ~_umask())  # mkdtemp's 0700 would stay on the renamed checkpoint
        except OSError as e:
            error = e
    raise_together(error, "writing the checkpoint", kinds=(OSError,))
    if distributed:
        dist.broadcast_object_list(tmp, src=0)
    tmp = Path(tmp[0])
    try:
        weights = _save_optimizer(tmp, model, optimizer, distributed)
        critic_weights = _save_optimizer(tmp / CRITIC, critic[0], critic[1], distributed) if critic else None
        error = None
        if rank == 0:
            try:
                _write_rank0(tmp, model, weights, tokenizer, scheduler, step, extra)
                if critic:
                    _write_rank0(tmp / CRITIC, critic[0], critic_weights, None, critic[2], step, None)
            except OSError as e:
                error = e
        del weights, critic_weights
        # every rank's shards and rank 0's files are on disk, or every rank raises
        raise_together(error, "writing the checkpoint", kinds=(OSError,))
        if rank == 0:
            try:
                _publish(tmp, root, name, keep)
            except OSError as e:
                error = e
        # no rank goes on before the checkpoint is in place
        raise_together(error, "writing the checkpoint", kinds=(OSError,))
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root / name


def _save_optimizer(folder: Path, model, optimizer, distributed: bool) -> dict:
    """Every rank: the optimizer's shards into folder/optimizer (DCP); returns the model's full state dict (rank 0
    writes it; empty for a LoRA model, whose adapter peft writes)."""
    weights = {} if is_lora(model) else get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    try:
        with _single_process_quiet():
            dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=folder / OPTIMIZER,
                     no_dist=not distributed)
    except CheckpointException as e:  # DCP's wrapper (a BaseException) of every rank's failure: the file error
        raise _file_error(e, folder) from e
    return weights


def _file_error(error: CheckpointException, folder: Path) -> OSError:
    """The OSError behind a DCP failure (a read-only folder), or one that says what DCP said and the space left on
    the disk (a full disk fails inside torch's writer, as "unexpected pos ...")."""
    failures = [exc for exc, _ in error.failures.values()]
    found = next((exc for exc in failures if isinstance(exc, OSError)), None)
    if found is not None:
        return found
    free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
    return OSError(f"the optimizer state could not be written ({failures[0]}); {free / 2**20:.1f} MiB free on the "
                   "disk")


def _write_rank0(tmp: Path, model, weights: dict, tokenizer, scheduler, step: int, extra: dict | None) -> None:
    """Rank 0's files: the consolidated weights (a LoRA model's adapter), the configs, the tokenizer, the trainer
    state."""
    if is_lora(model):
        model.save_pretrained(tmp)  # adapter_model.safetensors and adapter_config.json (naming the base model)
    else:
        safetensors.torch.save_file(_without_tied(model, weights), str(tmp / WEIGHTS), metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "scheduler": scheduler.state_dict(), "rng": _rng_state(), "extra": extra or {}},
               tmp / STATE)


def _publish(tmp: Path, root: Path, name: str, keep: int) -> None:
    """Write checksums.json, fsync the temporary folder, rename it into place, point `latest` at it, prune to the
    `keep` newest."""
    files = sorted(f for f in tmp.rglob("*") if f.is_file())
    write_atomic(tmp / CHECKSUMS, json.dumps({f.relative_to(tmp).as_posix(): {"bytes": f.stat().st_size,
                                                                            "sha256": _sha256(f)} for f in files},
                                             indent=1))
    for f in sorted(tmp.rglob("*"), reverse=True):  # files first, then their folders
        if f.is_file():
            os.chmod(f, 0o666 & ~_umask())  # as open() makes them (safetensors writes 0600)
        _fsync(f)
    _fsync(tmp)
    target = root / name
    if target.exists():  # re-saving a step (e.g. after a resume): replace it
        shutil.rmtree(target)
    os.rename(tmp, target)
    write_atomic(root / "latest", name)
    _fsync(root)
    for old in _complete(root)[:-keep]:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: str | Path, verify: bool = False) -> Path | None:
    """The newest complete checkpoint folder of a run, or None. Uses `latest`, else the highest complete step.
    `verify`: also compare every file's SHA-256 with checksums.json (reads the whole checkpoint), going back to an
    earlier checkpoint while one fails."""
    root = checkpoints_dir(run_dir)
    pointer = root / "latest"
    first = [root / pointer.read_text().strip()] if pointer.is_file() else []
    for candidate in first + _complete(root)[::-1]:
        if not faults(candidate, verify):
            return candidate
    return None


def load_weights(model, checkpoint: str | Path, verify: bool = True) -> None:
    """Load a checkpoint's weights into `model` (a checkpoint folder or a run folder, whose latest is used), after
    comparing its files with checksums.json (`faults`; `verify` False: the caller did).

    Raises FileNotFoundError when there is no complete checkpoint there, ValueError when the checkpoint does not
    fit the model (another model, or a LoRA adapter for a model without LoRA, or the reverse)."""
    path = Path(checkpoint)
    if not ((path / WEIGHTS).is_file() or (path / ADAPTER).is_file()):
        found = latest_checkpoint(path, verify=verify)
        if found is None:
            raise FileNotFoundError(f"{path} holds no checkpoint ({WEIGHTS} or checkpoints/latest)")
        path = found
    damage = [f for f in faults(path, verify=verify) if not f.startswith("lacks")]
    if damage:
        raise ValueError(f"checkpoint {path} is damaged: {'; '.join(damage)}; load an earlier checkpoint of the run")
    if (path / ADAPTER).is_file() or is_lora(model):
        _load_adapter(model, path)
        return
    try:
        if any(hasattr(p, "to_local") for p in model.parameters()):  # sharded (FSDP2): every rank reads the file
            state = safetensors.torch.load_file(str(path / WEIGHTS))
            state.update({name: state[kept] for name, kept in tied_names(model).items() if kept in state})
            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
        else:
            safetensors.torch.load_model(model, str(path / WEIGHTS), strict=True)
    except RuntimeError as e:
        raise ValueError(f"checkpoint {path} does not fit the model (written for another model.spec?): {e}") from e


def is_lora(model) -> bool:
    """Whether `model` is a peft model (LoRA: its checkpoints hold the adapter only)."""
    return hasattr(model, "peft_config")


def _load_adapter(model, path: Path) -> None:
    """A LoRA checkpoint's adapter into a LoRA model (peft's `set_peft_model_state_dict`), every adapter tensor
    matched. Raises ValueError when one of the two is not LoRA, or the adapter is of another rank or modules."""
    if not (path / ADAPTER).is_file():
        raise ValueError(f"checkpoint {path} holds full weights ({WEIGHTS}), not a LoRA adapter: set model.lora_r to "
                         "0 as the run did")
    if not is_lora(model):
        raise ValueError(f"checkpoint {path} holds a LoRA adapter ({ADAPTER}): set model.lora_r, lora_alpha and "
                         "lora_target_modules as the run did (its config.yaml)")
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    saved = json.loads((path / "adapter_config.json").read_text()) if (path / "adapter_config.json").is_file() else {}
    ours = model.peft_config["default"]
    for key in ("r", "lora_alpha"):
        if key in saved and saved[key] != getattr(ours, key):
            raise ValueError(f"checkpoint {path}'s adapter has {key}={saved[key]}, the model's LoRA layers "
                             f"{getattr(ours, key)}: set model.lora_{'r' if key == 'r' else 'alpha'} as the run did")
    state = safetensors.torch.load_file(str(path / ADAPTER))
    expected = get_peft_model_state_dict(model)
    shapes = {k: tuple(v.shape) for k, v in expected.items()}
    if {k: tuple(v.shape) for k, v in state.items()} != shapes:
        raise ValueError(f"checkpoint {path}'s adapter does not fit the model's LoRA layers (another model.lora_r or "
                         "lora_target_modules than the run's?)")
    set_peft_model_state_dict(model, state)


def load_checkpoint(checkpoint: str | Path, model, optimizer, scheduler, critic: tuple | None = None,
                    verify: bool = True) -> tuple[int, dict]:
    """Restore weights, optimizer, scheduler and RNG states from a checkpoint folder, on any world size (every rank
    of a data-parallel run calls it); returns (step, extra). `critic`: (value model, optimizer, scheduler) restored
    from critic/. Raises FileNotFoundError when `critic` is given and the checkpoint has none (a run started
    with another algorithm), ValueError when a file fails its checksums.json entry (`load_weights`; `verify` False:
    the caller compared them, as `latest_checkpoint(verify=True)` does). Checkpoints written before the optimizer
    state moved to DCP (a full state dict inside trainer_state.pt) still load."""
    path = Path(checkpoint)
    if critic is not None:
        if not (path / CRITIC / WEIGHTS).is_file():
            raise FileNotFoundError(f"{path} holds no critic/: the run was not trained with algorithm=ppo; resume it "
                                    "with its own algorithm")
        load_checkpoint(path / CRITIC, *critic, verify=False)  # the whole folder's checksums.json covers critic/
    load_weights(model, path, verify)
    state = torch.load(path / STATE, weights_only=False)  # our own file: numpy RNG state needs pickle
    for p in model.parameters():  # torch initialises the optimizer's state only for parameters without grads
        p.grad = None
    if "optimizer" in state:  # written before the optimizer state moved to DCP
        saved = state["optimizer"]
        if all(isinstance(k, str) for k in saved.get("state", {})):  # keyed by parameter name
            set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True))
        else:  # keyed by position (before data parallelism)
            optimizer.load_state_dict(saved)
    else:
        template = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # this world size's shapes / shards
        with _single_process_quiet():
            dcp.load(template, checkpoint_id=path / OPTIMIZER, no_dist=not dist.is_initialized())
        set_optimizer_state_dict(model, optimizer, template["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return int(state["step"]), state["extra"]


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it "assumes" one process whenever torch.distributed is not initialised: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _without_tied(model, state: dict) -> dict:
    """`state` with one entry per tensor (safetensors refuses shared storage), contiguous, as `save_model` writes."""
    tied = tied_names(model)
    return {k: v.contiguous() for k, v in state.items() if k not in tied}


def _complete(root: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first (temporary folders never match the step-N name)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and _is_complete(p)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def _is_complete(path: Path) -> bool:
    """Renamed into place only when complete; a copy that lost the DCP metadata is not (a folder without an
    optimizer/ subfolder is of the earlier format, its optimizer state inside trainer_state.pt)."""
    return not faults(path)


def faults(path: Path, verify: bool = False) -> list[str]:
    """What keeps a checkpoint folder from being loaded, one phrase each ([] when none): "lacks model.safetensors"
    for a file it needs, "model.safetensors has 100 of 2,113,928 bytes" for a file whose size differs from
    checksums.json, and with `verify` "trainer_state.pt fails its SHA-256 checksum" (reads every file).

    A checkpoint damaged after it was written (a file cut short by a copy, a disk that lost blocks) is told by its
    checksums.json: a file of another size counts as missing wherever checkpoints are listed, and a resume, an export
    or an evaluation also compares every file's SHA-256 before reading it. A resume then takes the newest intact
    checkpoint, with a warning naming the damaged one and its file (`incomplete_latest`); loading a damaged folder
    by its path raises ValueError naming the file. Checkpoints written before checksums.json are checked for their
    files' presence only."""
    if not path.is_dir():
        return ["lacks the folder"]
    out = [f"lacks {m}" for m in missing(path)]
    listed = path / CHECKSUMS
    if not listed.is_file():  # written before checksums, or not complete
        return out
    try:
        entries = {str(name): (int(entry["bytes"]), str(entry["sha256"]))
                   for name, entry in json.loads(listed.read_text()).items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return out + [f"{CHECKSUMS} cannot be read"]
    for name, (size_listed, sha256) in entries.items():
        file = path / name
        if not file.is_file():
            out.append(f"lacks {name}")
        elif (size := file.stat().st_size) != size_listed:
            out.append(f"{name} has {size:,} of {size_listed:,} bytes")
        elif verify and _sha256(file) != sha256:
            out.append(f"{name} fails its SHA-256 checksum")
    return list(dict.fromkeys(out))


def missing(path: Path) -> list[str]:
    """What a checkpoint folder lacks to be complete, as paths relative to it ([] when complete)."""
    if not path.is_dir():
        return ["the folder"]
    optimizer = path / OPTIMIZER
    out = [] if (path / WEIGHTS).is_file() or (path / ADAPTER).is_file() else [WEIGHTS]
    out += [] if (path / STATE).is_file() else [STATE]
    out += [f"{OPTIMIZER}/.metadata"] if optimizer.exists() and not (optimizer / ".metadata").is_file() else []
    if (path / CRITIC).exists():
        out += [f"{CRITIC}/{m}" for m in missing(path / CRITIC)]
    return out


def incomplete_latest(run_dir: str | Path, found: Path | None, verify: bool = False) -> str:
    """Why the checkpoint that `latest` points at is not the one a resume takes (`found`, `latest_checkpoint`'s):
    "step-000003 lacks model.safetensors", "step-000003: model.safetensors has 100 of 2,113,928 bytes", or "" when
    it is."""
    pointer = checkpoints_dir(run_dir) / "latest"
    if not pointer.is_file():
        return ""
    name = pointer.read_text().strip()
    if found is not None and found.name == name:
        return ""
    found_faults = faults(checkpoints_dir(run_dir) / name, verify)
    if all(f.startswith("lacks ") for f in found_faults):
        return f"{name} lacks {', '.join(f.removeprefix('lacks ') for f in found_faults)}"
    return f"{name}: {'; '.join(found_faults)}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
