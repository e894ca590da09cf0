"""A run's check of a model family outside the engine's registry, its verdicts kept in the run folder
(`engine/self_check.py` runs the check: the engine against the naive reference on a small tree of the model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ...engine import UnsupportedModelError
from ...engine.self_check import ensure_supported
from .checkpoint import write_atomic

if TYPE_CHECKING:
    from .parallel import Ranks

SELF_CHECK = "self_check.json"  # the run folder's verdicts on unregistered families


def check_family(model, unknown_family: str, run_dir: Path, ranks: Ranks | None = None, log=print) -> bool:
    """`engine.self_check.ensure_supported` on `model` with train.unknown_family `unknown_family`, its verdicts kept
    in run_dir/self_check.json (written atomically, by rank 0): True when the family is unregistered and passed
    (the engine then runs it trusted). Under torchrun (`ranks`) rank 0 checks, before sharding, and gathers its
    verdict to every rank. Raises UnsupportedModelError on every rank for a refused family."""
    if ranks is None:
        return _check(model, unknown_family, run_dir, log)
    outcome = (None, None)  # rank 0 decides; the others take its verdict (no rank may disagree)
    if ranks.rank == 0:
        try:
            outcome = (_check(model, unknown_family, run_dir, log), None)
        except UnsupportedModelError as e:
            outcome = (None, str(e))
    trusted, error = ranks.gather(outcome)[0]
    if error is not None:
        raise UnsupportedModelError(error)
    return trusted


def _check(model, unknown_family: str, run_dir: Path, log) -> bool:
    path = run_dir / SELF_CHECK
    verdicts = json.loads(path.read_text()) if path.is_file() else {}
    known = dict(verdicts)
    try:
        return ensure_supported(model, unknown_family, verdicts, log=log)
    finally:  # a failed verdict is kept too: the refusal is the same on the next try
        if verdicts != known:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(verdicts, indent=1))
