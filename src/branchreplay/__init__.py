"""branchreplay: exact, prefix-shared RL post-training over a tree of rollouts.

    tree = RolloutTree(rollouts)                       # radix trie: shared prefixes become shared nodes
    out = replay_backward(model, tree, GRPOLoss())     # each unique position computed once; grads as the naive sum
"""

import importlib
import sys

_EXPORTS = {
    "EngineConfig": ".engine.config",
    "GRPOLoss": ".losses",
    "LossInputs": ".losses",
    "Node": ".tree",
    "ReplayResult": ".tree",
    "Rollout": ".tree",
    "RolloutTree": ".tree",
    "TreeStats": ".tree",
    "UnsupportedModelError": ".engine.families",
    "naive_backward": ".check.reference",
    "replay_backward": ".engine.replay",
    "replay_logprobs": ".engine.replay",
    "token_weights": ".losses",
}
__all__ = sorted(_EXPORTS)


def lazy_exports(package: str, exports: dict[str, str]):
    """A module `__getattr__` (PEP 562) for `package`: each public name of `exports` ({name: relative module}) is
    imported from its module on first use and kept, so that importing the package (and parsing a run config)
    does not load torch."""
    def __getattr__(name: str):
        if name not in exports:  # a submodule, as `import package.name` would have bound it
            try:
                value = importlib.import_module(f".{name}", package)
            except ModuleNotFoundError:
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
            setattr(sys.modules[package], name, value)
            return value
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


__getattr__ = lazy_exports(__name__, _EXPORTS)
