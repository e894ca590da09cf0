"""The algorithms, each a part of the one training step (`run/step.py`), chosen by name from `ALGORITHMS`.

    grpo          GRPO and its loss types, GSPO, top_entropy_quantile           (TRL 1.16 GRPOTrainer)
    rloo          leave-one-out baseline, sequence-level clipped ratio           (TRL 1.16 RLOOTrainer)
    reinforce_pp  per-token returns, whitened over the step, GRPO's clipped loss  (verl / OpenRLHF REINFORCE++)
    ppo           GAE from a learned critic, clipped policy and value losses      (TRL 0.24 PPOTrainer)
    dpo           preference pairs, TRL's DPO losses and SimPO                    (TRL 1.16 DPOTrainer)

`base.Algorithm` is the interface; `advantages` holds the estimators' math. Adding an algorithm is one module with a
subclass and one line in `ALGORITHMS` (a plain dict by name, after verl's registered estimators and losses); one of
your own, outside the package, is `--algorithm package.module:Class` (docs/algorithms.md shows one). Torch-free
until `algorithm_class` imports a part, so that the config can check a name.
"""

from __future__ import annotations

import importlib

from ...fields import nearest

ALGORITHMS: dict[str, str] = {
    "grpo": "grpo:GRPO",
    "ppo": "ppo:PPO",
    "rloo": "rloo:RLOO",
    "reinforce_pp": "reinforce_pp:ReinforcePP",
    "dpo": "dpo:DPO",
}
"""Name -> the part's `module:Class` in this package."""


def check_algorithm(name) -> None:
    """Raise ValueError naming `algorithm` unless `name` is a key of `ALGORITHMS` or a `package.module:Class` spec
    (imported when the run starts)."""
    if not (isinstance(name, str) and (name in ALGORITHMS or ":" in name)):
        close = nearest(name, list(ALGORITHMS)) if isinstance(name, str) else ""
        raise ValueError(f"algorithm={name!r} is not valid{close}; accepted values: {', '.join(ALGORITHMS)}, or "
                         "package.module:Class (an algorithms.base.Algorithm of your own)")


def algorithm_class(name: str) -> type:
    """The part of `name`: a key of `ALGORITHMS`, or `package.module:Class` (a module of the current folder imports
    without PYTHONPATH). Raises ValueError naming `algorithm` when it cannot be imported or is not an `Algorithm`."""
    from ..data.rewards import import_from_cwd
    from .base import Algorithm

    spec = ALGORITHMS.get(name)
    module_name, _, attr = (f"{__name__}.{spec}" if spec else name).partition(":")
    try:
        module = importlib.import_module(module_name) if spec else import_from_cwd(module_name)
        part = getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"algorithm={name!r} cannot be imported ({type(e).__name__}: {e}); give one of "
                         f"{', '.join(ALGORITHMS)} or package.module:Class") from e
    if not (isinstance(part, type) and issubclass(part, Algorithm)):
        raise ValueError(f"algorithm={name!r} is not a subclass of branchreplay.rl.algorithms.base.Algorithm")
    return part
