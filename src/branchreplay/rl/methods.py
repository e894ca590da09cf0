"""How the trainer computes a step's logprobs and gradients: `engine.method`.

    branchreplay  the execution stack over the prefix tree (`engine.replay_backward`): each unique position once.
    naive         each rollout alone, unpadded, through the unmodified Hugging Face forward
                  (`check.reference.naive_backward`): the reference every exactness test compares with.
    padded        TRL's padded batch: prompts left-padded, completions right-padded, one [B, T_max] forward and
                  backward (`check.padded.padded_backward`).

All three give the same logprobs and gradients to floating-point tolerance, so two runs of one config and seed that
differ only in the method train the same model (`scripts/compare_methods.py`, docs/convergence.md); they differ in
time and memory. The two references run the token-level losses only (GRPO, REINFORCE++, PPO's policy and, naive,
its critic): `Config` refuses the rest.
"""

from __future__ import annotations

import torch

from ..check.padded import padded_backward
from ..check.reference import naive_backward
from ..engine import EngineConfig, replay_backward, replay_logprobs
from ..tree import ReplayResult, RolloutTree, TreeStats


def tree_backward(model, trees: list[RolloutTree], loss, *, temperature: float, engine: EngineConfig,
                  force: bool = False, final_backward=None, lockstep: bool = False) -> ReplayResult:
    """Forward and backward of `loss` over `trees` by `engine.method`; gradients accumulate into `param.grad`.
    Same arguments, result and errors as `engine.replay_backward` (`final_backward`, `lockstep`: branchreplay
    only)."""
    if engine.method == "branchreplay":
        return replay_backward(model, trees, loss, temperature=temperature, engine=engine, force=force,
                               final_backward=final_backward, lockstep=lockstep)
    _no_lockstep(lockstep, engine.method)
    return _reference(model, trees, loss, temperature, engine.method)


def tree_logprobs(model, trees: list[RolloutTree], *, temperature: float, engine: EngineConfig,
                  force: bool = False, lockstep: bool = False) -> ReplayResult:
    """Per-rollout logprobs and entropies (a critic's values) without a graph, by `engine.method`; as
    `engine.replay_logprobs`."""
    if engine.method == "branchreplay":
        return replay_logprobs(model, trees, temperature=temperature, engine=engine, force=force, lockstep=lockstep)
    _no_lockstep(lockstep, engine.method)
    with torch.no_grad():
        return _reference(model, trees, None, temperature, engine.method)


def _no_lockstep(lockstep: bool, method: str) -> None:
    if lockstep:
        raise ValueError(f"engine.method={method!r} does not run FSDP2's resharded mode (its lock-step is the "
                         "engine's): use parallel.fsdp_mode gather-once, or engine.method branchreplay")


def _reference(model, trees: list[RolloutTree], loss, temperature: float, method: str) -> ReplayResult:
    if not trees:
        return ReplayResult([], [], 0.0, TreeStats(0, 0, 0, 0, 0))
    rollouts = [r for t in trees for r in t.rollouts]
    stats = sum((t.stats for t in trees[1:]), trees[0].stats)
    if method == "naive":
        result = naive_backward(model, rollouts, loss, temperature=temperature)
    else:  # the pads are masked out of every attention: any id in the vocabulary serves
        result = padded_backward(model, rollouts, loss, temperature=temperature)
    result.stats = stats  # the tree's sizes (what branchreplay would have run), as every method logs them
    return result
