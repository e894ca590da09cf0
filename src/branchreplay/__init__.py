"""branchreplay: exact, prefix-shared RL post-training over a tree of rollouts.

    tree = RolloutTree(rollouts)                       # radix trie: shared prefixes become shared nodes
    out = replay_backward(model, tree, GRPOLoss())     # each unique position computed once; grads as the naive sum
"""

from .lazy import lazy_exports

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
    "naive_backward": ".reference.naive",
    "token_weights": ".losses",
}
__all__ = sorted([*_EXPORTS, "replay_backward", "replay_logprobs"])


def replay_backward(model, trees, loss, *, force: bool = False, **options):
    """`engine.replay_backward` (its arguments, result and errors), where `force=True` first checks a family
    outside the registry against the naive reference on `model` itself (`engine.self_check.check_once`: once per
    model class, config and dtype in the process) and then runs the engine on it trusted.

    Raises:
        UnsupportedModelError: as the engine's, and an unregistered family whose self-check fails.
        ValueError: `force=True` on a critic or under data parallelism (`check_once` says what to run instead).
    """
    from .engine.replay import replay_backward as run

    _check_forced(model, force)
    return run(model, trees, loss, trusted=force, **options)


def replay_logprobs(model, trees, *, force: bool = False, **options):
    """`engine.replay_logprobs`, with `force` as `replay_backward`'s."""
    from .engine.replay import replay_logprobs as run

    _check_forced(model, force)
    return run(model, trees, trusted=force, **options)


def _check_forced(model, force: bool) -> None:
    """The self-check of `force=True`, on the model the engine runs: a peft model's base, a vision-language model's
    language model (as `engine.replay` resolves them)."""
    from .engine.families import FAMILIES, check_trusted
    from .engine.self_check import check_once
    from .engine.vision import language_model
    from .models import base_of

    check_trusted(force, "force")
    runs = language_model(base_of(model))
    if force and runs.config.model_type not in FAMILIES:
        check_once(runs)


__getattr__ = lazy_exports(__name__, _EXPORTS)
