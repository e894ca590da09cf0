"""branchreplay: exact, prefix-shared RL post-training over a tree of rollouts.

    tree = RolloutTree(rollouts)                       # radix trie: shared prefixes become shared nodes
    out = replay_backward(model, tree, GRPOLoss())     # each unique position computed once; grads as the naive sum
"""

from .check.reference import naive_backward
from .engine import EngineConfig, UnsupportedModelError, replay_backward, replay_logprobs
from .losses import GRPOLoss, LossInputs, token_weights
from .tree import Node, ReplayResult, Rollout, RolloutTree, TreeStats

__all__ = [
    "EngineConfig",
    "GRPOLoss",
    "LossInputs",
    "Node",
    "ReplayResult",
    "Rollout",
    "RolloutTree",
    "TreeStats",
    "UnsupportedModelError",
    "naive_backward",
    "replay_backward",
    "replay_logprobs",
    "token_weights",
]
