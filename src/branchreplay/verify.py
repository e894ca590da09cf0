"""`branchreplay verify`: the execution stack against the naive per-rollout reference, on trees of every shape.

For each shape in `scenarios.SHAPES` (shared prompt, branches of branches, identical / prefix / empty completion,
forest of prompts, multi-turn, random), and for a model with sliding-window layers `scenarios.around_window`
(branch points before, at and after the smallest window): the same model runs the naive reference (each rollout
alone, unpadded, full HF forward) and `replay_backward`, with the GRPO loss (KL and entropy terms on, old logprobs
off-policy so the clipping is exercised), and the errors are compared with the bound for the dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine import EngineConfig, replay_backward, replay_logprobs
from .losses import GRPOLoss
from .numerics import keep_float64
from .reference import max_rel_grad_err, naive_backward
from .scenarios import SHAPES, around_window, make_rollouts
from .state import FAMILIES, layer_windows
from .tree import RolloutTree

GRAD_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}


@dataclass
class ShapeResult:
    shape: str
    rollouts: int
    logical_tokens: int
    physical_tokens: int
    max_rel_grad_err: float
    max_abs_logprob_err: float
    passed: bool


def verify_model(model, seed: int = 0, random_trees: int = 3, temperature: float = 0.8,
                 force: bool = False) -> list[ShapeResult]:
    """Naive vs replay on every shape (and `random_trees` random trees) for `model`; one result per tree.

    float64 models get `keep_float64` (HF's RMSNorm would otherwise round to float32, on both sides alike).
    `force` runs a family that is not in the registry (the engine then guesses it: `state.generic_family`).
    Raises: UnsupportedModelError for a family the engine does not know (unless `force`)."""
    dtype = next(model.parameters()).dtype
    if dtype == torch.float64:
        keep_float64(model)
    family = FAMILIES.get(model.config.model_type)
    float32_kernels = family is not None and family.float32_kernels  # SSM scans etc. in float32 (Family)
    tolerance = GRAD_TOLERANCE.get(torch.float32 if float32_kernels and dtype == torch.float64 else dtype, 1e-2)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    loss = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, beta=0.05, entropy_coef=0.01)
    cases = [(name, build) for name, build in SHAPES.items() if name != "random"]
    window = min((w for w in layer_windows(model.config) if w is not None), default=None)
    if window is not None:
        cases.append(("around-window", lambda vocab, g: around_window(window, vocab, g)))
    cases += [(f"random-{i}", SHAPES["random"]) for i in range(random_trees)]
    results = []
    for name, build in cases:
        rollouts = make_rollouts(build(vocab, g), g)
        tree = RolloutTree(rollouts)
        current = replay_logprobs(model, tree, temperature=temperature, force=force).logprobs
        for r, lp in zip(rollouts, current):  # off-policy: some ratios are clipped, and KL is non-zero
            noise = 0.3 * (torch.rand(len(r), generator=g, dtype=torch.float64) - 0.5)
            r.old_logprobs = (lp.double() + noise) * r.loss_mask
            r.ref_logprobs = (lp.double() - noise) * r.loss_mask
        model.zero_grad(set_to_none=True)
        naive = naive_backward(model, rollouts, loss, temperature=temperature)
        g_naive = [_grad(p) for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        engine = EngineConfig(max_pack_tokens=64, chunk_tokens=24, replay="replay" if len(results) % 2 else "keep")
        replay = replay_backward(model, tree, loss, temperature=temperature, engine=engine, force=force)
        g_replay = [_grad(p) for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        grad_err = max_rel_grad_err(g_replay, g_naive)
        lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive.logprobs))
        results.append(
            ShapeResult(
                name,
                len(rollouts),
                tree.stats.logical_tokens,
                tree.stats.physical_tokens,
                grad_err,
                lp_err,
                grad_err <= tolerance and lp_err <= max(tolerance, 1e-9) * 10,
            )
        )
    return results


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad.clone() if p.grad is not None else torch.zeros_like(p)
