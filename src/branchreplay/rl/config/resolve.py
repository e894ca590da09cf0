"""A run's config as later commands need it, whatever folder they start in: its files and its modules resolved.

The config a run saves (config.yaml) is read again by `--resume`, `eval --checkpoint RUN_DIR` and `export`, maybe from
another folder. A relative data path (task.dataset: train.jsonl) or a module of the current folder (task.reward
my_rewards:fn) would then name nothing, or something else. `resolved` gives absolute paths for the files that exist
(task.dataset, task.eval_dataset, dpo.dataset, a model folder or file of model.spec and ppo.value_model), and for a
module spec whose module is a file of the current folder (a top-level module, `my_rewards`) the file's path
(`/abs/dir/my_rewards.py:fn`, which `data.rewards.import_from_cwd` loads from anywhere). Torch-free.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
from pathlib import Path

FILES = (("task", "dataset"), ("task", "eval_dataset"), ("dpo", "dataset"), ("model", "spec"), ("ppo", "value_model"))
MODULE_SPECS = (("task", "reward"), ("agent", "environment"))


def resolved(config):
    """A copy of `config` (a `Config`) with its files and current-folder modules resolved (module docstring)."""
    out = copy.deepcopy(config)
    for section, name in FILES:
        part = getattr(out, section)
        value = getattr(part, name)
        if isinstance(value, str) and value and Path(value).exists():
            setattr(part, name, str(Path(value).resolve()))
    for section, name in MODULE_SPECS:
        part = getattr(out, section)
        value = getattr(part, name)
        if isinstance(value, str):
            setattr(part, name, ",".join(module_spec(s.strip()) for s in value.split(",")))
    out.algorithm = module_spec(out.algorithm)
    return out


def module_spec(spec: str) -> str:
    """`spec` ("module:attribute", or a built-in name) with a top-level module found in the current folder as its
    file's absolute path; anything else unchanged."""
    module, sep, attr = spec.partition(":")
    if not sep or "." in module or module.endswith(".py"):
        return spec
    path = Path.cwd() / f"{module}.py"
    if not path.is_file() or _importable_elsewhere(module):
        return spec
    return f"{path.resolve()}:{attr}"


def _importable_elsewhere(module: str) -> bool:
    """Whether `module` imports without the current folder (an installed module keeps its name)."""
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in saved if p not in ("", os.getcwd(), ".")]
        spec = importlib.util.find_spec(module)
        return spec is not None and spec.origin is not None and Path(spec.origin).parent != Path.cwd()
    except (ImportError, ValueError):
        return False
    finally:
        sys.path[:] = saved
