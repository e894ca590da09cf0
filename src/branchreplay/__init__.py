"""branchreplay: exact, prefix-shared RL post-training over a tree of rollouts.

    tree = RolloutTree(rollouts)                       # radix trie: shared prefixes become shared nodes
    out = replay_backward(model, tree, GRPOLoss())     # each unique position computed once; grads as the naive sum
"""

from .engine import ReplayResult, replay_backward, replay_logprobs
from .losses import GRPOLoss, LossInputs, token_weights
from .reference import naive_backward
from .state import UnsupportedModelError
from .tree import Node, Rollout, RolloutTree, TreeStats

__all__ = [
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
