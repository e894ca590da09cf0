"""Losses of whole sequences over the tree: any function of the rollouts' per-token logprobs and entropies (DPO and
RLOO on summed logprobs; GSPO's sequence-level importance ratios), exactly, in two passes of the execution stack.

By the chain rule, with logp[i, t] and H[i, t] the logprob and entropy at position t of rollout i,
dL/dtheta = sum_i sum_t (dL/dlogp[i, t]) dlogp[i, t]/dtheta + (dL/dH[i, t]) dH[i, t]/dtheta, so

    pass 1  `replay_logprobs` (no graph): logp and H of every rollout; g = dL/dlogp and h = dL/dH by autograd on
            the scalar function L of them (float64 leaves);
    pass 2  `replay_backward` of the linear loss sum_i sum_t g[i, t] logp[i, t] + h[i, t] H[i, t]: its gradient
            is dL/dtheta (pass 2 recomputes pass 1's values to the last bit on a given device and dtype).

A loss of the summed logprobs s_i (`replay_sequence_backward`) is the case g[i, t] = (dL/ds_i) loss_mask[i, t], h = 0.
Design notes and measurements: docs/notes/execution-stack.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..losses import LossInputs
from ..tree import ReplayResult, Rollout, RolloutTree
from .config import EngineConfig
from .parallel.context_parallel import ContextParallelTree
from .replay import replay_backward, replay_logprobs
from .router import RouterLoss

SequenceLoss = Callable[[torch.Tensor], torch.Tensor]
"""[N] float64 summed logprobs (nats) of the N rollouts of all the trees, in order -> scalar loss."""

TokenFunctionLoss = Callable[[list[torch.Tensor], list[torch.Tensor]], torch.Tensor]
"""(per rollout [T] float64 logprobs, per rollout [T] float64 entropies; both 0 where loss_mask is 0, and the loss
must not depend on them there) of the N rollouts of all the trees, in order -> scalar loss."""


def replay_function_backward(model, trees: RolloutTree | list[RolloutTree], loss: TokenFunctionLoss, *,
                             temperature: float = 1.0, engine: EngineConfig | None = None, trusted: bool = False,
                             first: ReplayResult | None = None, final_backward=None,
                             router: RouterLoss | None = None) -> tuple[float, ReplayResult, ReplayResult]:
    """Gradients of `loss`(logprobs, entropies) into `param.grad`, as its `.backward()` on the naive per-rollout
    logprobs would give them (module docstring).

    `first`: pass 1's result under the current weights (a `replay_logprobs` of the same trees the caller ran, e.g.
    the old-policy pass of the first update): pass 1 is then skipped. `final_backward` as `replay_backward`.
    `router`: a fresh `router.RouterLoss` for an MoE model's router load-balancing loss: pass 1 sums its
    statistics (or `first` was run with it), `loss` reads its value as `router.aux` (a float64 leaf) and pass 2
    adds its gradient.
    Returns (the loss value, pass 1's result, pass 2's). Each rollout's `weights` and advantages are ignored (the
    loss decides); only `loss_mask` positions enter. Same errors as `replay_backward`; raises ValueError when `loss`
    does not return a finite scalar, or `first` has another number of rollouts.
    """
    trees = [trees] if isinstance(trees, RolloutTree) else list(trees)
    rollouts = [r for t in trees for r in t.rollouts]
    if first is None:
        first = replay_logprobs(model, trees, temperature=temperature, engine=engine, trusted=trusted, router=router)
    if len(first.logprobs) != len(rollouts):
        raise ValueError(f"first holds {len(first.logprobs)} rollouts, the trees {len(rollouts)}")
    value, g, h = function_coefficients(loss, first.logprobs, first.entropy, router)
    second = replay_backward(model, linear_trees(trees, g, h), linear_loss, temperature=temperature, engine=engine,
                             trusted=trusted, final_backward=final_backward, router=router)
    return value, first, second


def replay_sequence_backward(model, trees: RolloutTree | list[RolloutTree], loss: SequenceLoss, *,
                             temperature: float = 1.0, engine: EngineConfig | None = None,
                             trusted: bool = False, sums: torch.Tensor | None = None,
                             final_backward=None) -> tuple[float, torch.Tensor, ReplayResult]:
    """Gradients of `loss`(s) into `param.grad`, where s [N] are the rollouts' summed logprobs over their
    loss_mask, as `loss(s).backward()` on the naive per-rollout sums would give them (module docstring).

    Returns (the loss value, s [N] float64, pass 2's `ReplayResult`). `sums`: s under the current weights when the
    caller already has them (`sequence_sums` of a `replay_logprobs` it ran, e.g. the old-policy pass of the first
    update, or with the full parameters of a sharded model): pass 1 is then skipped. `final_backward` as
    `replay_backward`. Same arguments and errors as `replay_backward`; raises ValueError when `loss` does not return
    a finite scalar.
    """
    trees = [trees] if isinstance(trees, RolloutTree) else list(trees)
    rollouts = [r for t in trees for r in t.rollouts]
    if sums is None:
        first = replay_logprobs(model, trees, temperature=temperature, engine=engine, trusted=trusted)
        sums = sequence_sums(first.logprobs, rollouts)
    s = torch.as_tensor(sums, dtype=torch.float64)
    if s.shape != (len(rollouts),):
        raise ValueError(f"sums has shape {tuple(s.shape)}, expected ({len(rollouts)},): one per rollout")
    value, g, h = sequence_coefficients(loss, s, rollouts)
    second = replay_backward(model, linear_trees(trees, g, h), linear_loss, temperature=temperature, engine=engine,
                             trusted=trusted, final_backward=final_backward)
    return value, s, second


def sequence_sums(logprobs: list[torch.Tensor], rollouts: list[Rollout]) -> torch.Tensor:
    """[N] float64: each rollout's logprobs [T] (a `ReplayResult`'s) summed over its loss_mask (differentiable)."""
    return torch.stack([(lp.double() * r.loss_mask).sum() for lp, r in zip(logprobs, rollouts, strict=True)])


def function_coefficients(loss: TokenFunctionLoss, logprobs: list[torch.Tensor], entropy: list[torch.Tensor],
                          router: RouterLoss | None = None) -> tuple[float, list[torch.Tensor], list[torch.Tensor]]:
    """Pass 1's derivatives: (the loss value, g = dL/dlogp and h = dL/dH per rollout [T] float64) of `loss` at the
    rollouts' `logprobs` and `entropy` (per rollout [T]), by autograd on float64 leaves; with `router` (after its
    pass 1), also dL/daux at `router.aux`, handed to `router.set_gradient`. Raises ValueError when `loss` does not
    return a finite scalar."""
    logprobs = [lp.double().clone().requires_grad_(True) for lp in logprobs]
    entropy = [e.double().clone().requires_grad_(True) for e in entropy]
    aux = [router.value()] if router is not None else []
    value = loss(logprobs, entropy)
    if value.dim() != 0 or not torch.isfinite(value):
        raise ValueError(f"the loss must return a finite scalar, got {value!r}")
    grads = torch.autograd.grad(value, logprobs + entropy + aux, allow_unused=True)
    if router is not None:
        router.set_gradient(0.0 if grads[-1] is None else float(grads[-1]))
        grads = grads[:-1]
    n = len(logprobs)
    g = [torch.zeros_like(lp) if d is None else d for lp, d in zip(logprobs, grads[:n], strict=True)]
    h = [torch.zeros_like(e) if d is None else d for e, d in zip(entropy, grads[n:], strict=True)]
    return float(value.detach()), g, h


def sequence_coefficients(loss: SequenceLoss, sums: torch.Tensor, rollouts: list[Rollout]
                          ) -> tuple[float, list[torch.Tensor], list[torch.Tensor]]:
    """`function_coefficients` of a loss of the summed logprobs `sums` [N] float64: g[i, t] = dL/ds_i on the
    rollout's loss_mask, h = 0. Raises ValueError when `loss` does not return a finite scalar."""
    leaf = sums.clone().requires_grad_(True)
    value = loss(leaf)
    if value.dim() != 0 or not torch.isfinite(value):
        raise ValueError(f"the sequence loss must return a finite scalar, got {value!r}")
    (c,) = torch.autograd.grad(value, leaf)
    g = [c[i] * r.loss_mask for i, r in enumerate(rollouts)]  # dL/dlogp[i, t] = dL/ds_i on the summed positions
    h = [torch.zeros(len(r), dtype=torch.float64) for r in rollouts]
    return float(value.detach()), g, h


def linear_trees(trees: list, g: list[torch.Tensor], h: list[torch.Tensor]) -> list:
    """Pass 2's trees: each of `trees` (`RolloutTree`s, or a rank's `ContextParallelTree` parts) rebuilt with the
    coefficients riding on its rollouts, g[i] [T] on the weights and h[i] [T] on the advantages (per rollout of the
    trees, in order), so that `linear_loss` over them is sum_i sum_t g[i, t] logp[i, t] + h[i, t] H[i, t]."""
    out, k = [], 0
    for t in trees:
        rollouts = [Rollout(r.token_ids, loss_mask=r.loss_mask, weights=g[k + i] * r.loss_mask,
                            advantages=h[k + i] * r.loss_mask) for i, r in enumerate(t.rollouts)]
        k += len(rollouts)
        if isinstance(t, ContextParallelTree):
            out.append(ContextParallelTree(t.prefix, RolloutTree(rollouts) if rollouts else None, t.rounds, t.rank))
        else:
            out.append(RolloutTree(rollouts, images=t.images))
    return out


def linear_loss(x: LossInputs) -> torch.Tensor:
    """Pass 2's loss over a node: sum over its rollouts and positions of g * logp + h * H (the weights carry g, the
    advantages h: `linear_trees`)."""
    return (x.weights * x.logprobs).sum() + (x.advantages * x.entropy).sum()
