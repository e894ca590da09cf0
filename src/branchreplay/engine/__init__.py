"""The execution stack over a tree of rollouts: exact forward and backward, each unique position computed once.

    replay_backward(model, trees, loss, engine=EngineConfig())   # gradients into param.grad, as the naive sum's
    replay_logprobs(model, trees)                                # old-policy or reference logprobs, no graph
    replay_with(model, trees, loss, ReplayOptions(...))          # either, its options in one object
    sequence.replay_sequence_backward(model, trees, loss_of_sums)  # a loss of summed logprobs (DPO), two passes

Modules: `replay` (one call: checks, forests, rotary regimes; a rank's share), `stack` (a tree's traversal),
`model_view` (the model as the engine reads it), `packs`, `schedule`, `masks`, `head` (LM-head logprobs), `embedding`,
`planner` (memory model, replay plan), `attention` and `kernels` (split prefix attention), `families` (the registry),
`self_check` (an unregistered family against the naive reference), `cache`, `recurrent`, `positions`, `vision`,
`router`, `config` (`EngineConfig`), `options` (`ReplayOptions`), `sequence` (losses of whole sequences), and
`parallel/` (data parallelism). docs/architecture.md says what each holds.
"""

from ..lazy import lazy_exports

_EXPORTS = {
    "EngineConfig": ".config",
    "FAMILIES": ".families",
    "UnsupportedModelError": ".families",
    "HeadMismatchError": ".head",
    "ReplayOptions": ".options",
    "replay_with": ".replay",
    "replay_backward": ".replay",
    "replay_logprobs": ".replay",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)  # `EngineConfig` (a config section) without torch
