"""The execution stack over a tree of rollouts: exact forward and backward, each unique position computed once.

    replay_backward(model, trees, loss, engine=EngineConfig())   # gradients into param.grad, as the naive sum's
    replay_logprobs(model, trees)                                # old-policy or reference logprobs, no graph
    sequence.replay_sequence_backward(model, trees, loss_of_sums)  # a loss of summed logprobs (DPO), two passes

Modules: `replay` (one call: its checks, forests and rotary regimes; a rank's share), `stack` (the traversal of a tree),
`model_view` (the model as the engine reads it), `packs` (siblings grouped into forwards, chunks of long nodes),
`schedule` (which shared nodes run once), `masks` (tree masks), `head` (LM-head logprobs in checkpointed chunks),
`embedding` (the input embedding's gradient in one pass), `planner` (memory model and replay plan), `attention` (split
prefix attention), `families` (the registry), `cache` (the prefix cache), `recurrent` (SSM / conv state), `positions`
(length-dependent rotary encodings), `config` (`EngineConfig`), `sequence` (losses of whole sequences), `kernels` (split
attention's block kernels), `sharding` and `distributed` (data parallelism), `context_parallel` (a shared prefix once
across the ranks).
"""

from .. import lazy_exports

_EXPORTS = {
    "EngineConfig": ".config",
    "FAMILIES": ".families",
    "UnsupportedModelError": ".families",
    "HeadMismatchError": ".head",
    "replay_backward": ".replay",
    "replay_logprobs": ".replay",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)  # `EngineConfig` (a config section) without torch
