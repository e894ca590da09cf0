"""Losses of whole sequences over the tree: a function of each rollout's summed logprob (DPO; sequence-level
importance ratios), exactly, in two passes of the execution stack.

A token-level loss is a sum over the nodes, so one pass computes it (`stack.replay_backward`). A loss of the
sequence sums s_i = sum_t loss_mask[i, t] * logp[i, t] is not: the derivative at a token depends on the whole
rollout. By the chain rule, dL/dtheta = sum_i (dL/ds_i) ds_i/dtheta, so

    pass 1  `replay_logprobs` (no graph): s_i for every rollout;
            c_i = dL/ds_i by autograd on the scalar function L(s);
    pass 2  `replay_backward` of the linear loss sum_i c_i s_i: its gradient is dL/dtheta.

Pass 2 recomputes the logprobs of pass 1 with the same weights, so the two agree to the last bit on a given device
and dtype (pass 1's are kept in float64 for a float64 model, in float32 otherwise: `ReplayResult`). The cost
over a token-level loss is one forward pass without a graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..losses import LossInputs
from ..tree import ReplayResult, Rollout, RolloutTree
from .config import EngineConfig
from .stack import replay_backward, replay_logprobs

SequenceLoss = Callable[[torch.Tensor], torch.Tensor]
"""[N] float64 summed logprobs (nats) of the N rollouts of all the trees, in order -> scalar loss."""


def replay_sequence_backward(model, trees: RolloutTree | list[RolloutTree], loss: SequenceLoss, *,
                             temperature: float = 1.0, engine: EngineConfig = EngineConfig(),
                             force: bool = False) -> tuple[float, torch.Tensor, ReplayResult]:
    """Gradients of `loss`(s) into `param.grad`, where s [N] are the rollouts' summed logprobs over their
    loss_mask, as `loss(s).backward()` on the naive per-rollout sums would give them (module docstring).

    Returns (the loss value, s [N] float64, pass 2's `ReplayResult`). Each rollout's `weights` are ignored (the
    loss sets them); `loss_mask` selects the summed positions. Same arguments and errors as `replay_backward`;
    raises ValueError when `loss` does not return a finite scalar.
    """
    trees = [trees] if isinstance(trees, RolloutTree) else list(trees)
    first = replay_logprobs(model, trees, temperature=temperature, engine=engine, force=force)
    rollouts = [r for t in trees for r in t.rollouts]
    s = torch.stack([(lp.double() * r.loss_mask).sum() for lp, r in zip(first.logprobs, rollouts)])
    leaf = s.clone().requires_grad_(True)
    value = loss(leaf)
    if value.dim() != 0 or not torch.isfinite(value):
        raise ValueError(f"the sequence loss must return a finite scalar, got {value!r}")
    (coefficients,) = torch.autograd.grad(value, leaf)
    linear, k = [], 0
    for t in trees:
        weighted = [Rollout(r.token_ids, loss_mask=r.loss_mask, weights=coefficients[k + i] * r.loss_mask)
                    for i, r in enumerate(t.rollouts)]
        linear.append(RolloutTree(weighted))
        k += len(t.rollouts)
    second = replay_backward(model, linear, _weighted_logprobs, temperature=temperature, engine=engine, force=force)
    return float(value.detach()), s, second


def _weighted_logprobs(x: LossInputs) -> torch.Tensor:
    """sum over the node's rollouts and positions of c_i * logp (the weights carry c_i)."""
    return (x.weights * x.logprobs).sum()
