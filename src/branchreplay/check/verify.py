"""`branchreplay verify`: the execution stack against the naive per-rollout reference, on trees of every shape.

For each shape in `shapes.SHAPES`, and for every length at which the model or the engine changes how it computes
(`length_thresholds`: the engine's chunk, a sliding window, an attention chunk, a length-dependent rotary), a tree
whose rollouts straddle it runs the naive reference (each rollout alone, unpadded, full HF forward) and
`replay_backward` on the same model, with the GRPO loss (KL, entropy and off-policy clipping exercised). The bound:
    float64: max relative gradient error against naive float64 <= 1e-6 (1e-4 for `Family.float32_kernels`),
        logprobs within 10x that bound in nats;
    float32, bfloat16: the engine and naive both against a float64 copy (`keep_float64`): the engine's error at most
        `VS_FLOAT64_FACTOR` x the model's rounding level, the naive computation's largest error over the check's trees
        (`judge_against_float64`; gradients: max over parameters of the relative error; logprobs: nats, plus 1e-5).
A level, not the same tree's error: which order of the same sums rounds more varies tree by tree.
Why these bounds: docs/support.md#what-exact-means-in-each-dtype, docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..engine import EngineConfig, replay_backward, replay_logprobs
from ..engine.config import EVERY_SHARED_NODE
from ..engine.families import FAMILIES, layer_windows
from ..engine.positions import rope_thresholds
from ..engine.sequence import replay_sequence_backward, sequence_sums
from ..losses import DPO_LOSS_TYPES, GRPOLoss, ValueLoss, dpo_loss, rloo_loss
from ..models import autocast, max_positions
from ..reference.float64 import keep_float64
from ..reference.naive import max_rel_grad_err, naive_backward, naive_sequence_backward
from ..reference.shapes import SHAPES, around_length, around_window, make_rollouts
from ..tree import Rollout, RolloutTree
from ..value import ValueModel

FLOAT64_TOLERANCE = 1e-6  # max relative gradient error against naive, float64 model and kernels
FLOAT32_KERNELS_TOLERANCE = 1e-4  # the same for a float64 model whose family computes parts in float32
VS_FLOAT64_FACTOR = 2.0  # float32 / bfloat16: the engine's error vs float64 <= this x the naive computation's
# (CUDA orders its float32 sums differently from the CPU: docs/gpu.md)
ENGINE = dict(max_pack_tokens=64, chunk_tokens=24, **EVERY_SHARED_NODE)  # small, so that the trees cross packs
# and chunks; every shared node kept, so that the small trees run as trees (engine/schedule.py)


@dataclass
class ShapeResult:
    """One tree of `verify_model`. Errors: max over parameters of max|g - g_ref| / max|g_ref| (gradients) and
    max |logp - logp_ref| in nats (logprobs). `*_vs_f64` fields are None for a float64 model."""

    shape: str
    rollouts: int
    logical_tokens: int
    physical_tokens: int
    max_rel_grad_err: float  # engine against naive, both in the model's dtype
    max_abs_logprob_err: float
    passed: bool
    threshold: str | None = None  # the length threshold the tree straddles, "name=tokens"
    max_rel_grad_err_vs_f64: float | None = None  # engine against the float64 naive computation
    naive_rel_grad_err_vs_f64: float | None = None  # the naive computation in the model's dtype, against float64
    logprob_err_vs_f64: float | None = None  # the same for the logprobs (a critic's values, DPO's sums), nats
    naive_logprob_err_vs_f64: float | None = None
    bound_vs_f64: float | None = None  # the engine's gradient error may be this much (`judge_against_float64`)


def length_thresholds(model, engine: EngineConfig) -> dict[str, int]:
    """Lengths in tokens at which the computation changes, read from the model's config and the engine's options:
    `engine.chunk_tokens`, the smallest `sliding_window`, `attention_chunk_size` (Llama 4), and the rotary
    thresholds of `positions.rope_thresholds` (longrope's original_max_position_embeddings, dynamic NTK's
    max_position_embeddings)."""
    out = {"engine.chunk_tokens": engine.chunk_tokens}
    window = min((w for w in layer_windows(model.config) if w is not None), default=None)
    if window is not None:
        out["sliding_window"] = window
    chunk = getattr(model.config, "attention_chunk_size", None)
    if chunk:
        out["attention_chunk_size"] = chunk
    out.update(rope_thresholds(model))
    return out


def _threshold_cases(model, engine: EngineConfig) -> tuple[list, dict[str, str]]:
    """(name, builder, threshold) per threshold whose tree fits the model's positions, and why the others do not."""
    cases, skipped = [], {}
    limit = max_positions(model.config)
    for name, n in length_thresholds(model, engine).items():
        if name == "sliding_window":
            shape, build, longest = "around-window", (lambda vocab, g, n=n: around_window(n, vocab, g)), 4 * n + 3
        else:
            n = max(n, 6)
            shape = f"around-{name.split()[0]}-{n}"
            build, longest = (lambda vocab, g, n=n: around_length(n, vocab, g)), n + 4
        if limit is not None and longest > limit:
            skipped[name] = f"its tree needs {longest} positions, more than the model's {limit}"
            continue
        cases.append((shape, build, f"{name}={n}"))
    return cases, skipped


def verify_model(model, seed: int = 0, random_trees: int = 3, temperature: float = 0.8,
                 force: bool = False, mixed_precision: str | None = None, loss: str = "grpo",
                 shapes: tuple[str, ...] | None = None) -> tuple[list[ShapeResult], dict[str, str]]:
    """Naive vs replay on every shape, every length threshold and `random_trees` random trees for `model`; with
    `shapes` (names in `shapes.SHAPES`), on those shapes alone.

    float64 models run under `keep_float64` (HF's RMSNorm would otherwise round to float32, on both sides alike);
    a float32 or bfloat16 model is also compared with a float64 copy of itself (the module docstring's bound).
    `mixed_precision` ("bfloat16"): a float32 model whose engine and naive computations both run under
    `models.autocast` (what `train --model.dtype bfloat16` runs), against its float64 copy by the same bound.
    `loss`: "grpo" (GRPOLoss with its KL and entropy terms), "ppo" (PPO's clipped policy loss with per-token
    advantages, and a critic made from the model, `value.ValueModel.from_policy`, with `ValueLoss`: two results per
    tree, the critic's named "<shape>/critic", its "logprob err" that of the values), "rloo" (`losses.rloo_loss`,
    RLOO's sequence-level ratio, through `engine.sequence`; "logprob err" that of the summed logprobs).
    `force` runs a family that is not in the registry (the engine then guesses it: `families.generic_family`),
    without the engine's own self-check: this comparison is that check, on more trees.
    Returns (one result per tree, {threshold name: why it has no tree} for thresholds past the model's positions).
    Raises: UnsupportedModelError for a family the engine does not know (unless `force`); ValueError for
    `mixed_precision` on a model whose parameters are not float32, an unknown `loss` or an unknown shape."""
    if loss not in ("grpo", "ppo", "rloo"):
        raise ValueError(f"verify loss={loss!r} is not valid; accepted values: grpo, ppo, rloo (dpo: verify_dpo)")
    if shapes is not None and (not shapes or set(shapes) - set(SHAPES)):
        raise ValueError(f"verify shapes {list(shapes)}: name one or more of {', '.join(SHAPES)}")
    float64 = next(model.parameters()).dtype == torch.float64
    if mixed_precision is not None and next(model.parameters()).dtype != torch.float32:
        raise ValueError(f"mixed precision runs float32 parameters under autocast; the model is "
                         f"{next(model.parameters()).dtype}")
    compute = lambda: autocast(mixed_precision or "float32", model.device.type)  # noqa: E731
    with contextlib.ExitStack() as stack:
        reference64 = None if float64 else stack.enter_context(float64_copy(model))
        models = [(model, reference64)]
        if loss == "ppo":  # the critic, and its float64 copy: the same decoder and head
            critic = ValueModel.from_policy(model, seed=seed).eval()
            models.append((critic, None if float64 else stack.enter_context(float64_copy(critic))))
        for m, _ in models:
            if float64:
                stack.enter_context(keep_float64(m))
        return _verify(models, seed, random_trees, temperature, force, compute, loss, shapes)


def _verify(models, seed, random_trees, temperature, force, compute, objective, shapes=None):
    model = models[0][0]
    family = FAMILIES.get(model.config.model_type)
    float32_kernels = family is not None and family.float32_kernels  # SSM scans etc. in float32 (Family)
    tolerance = FLOAT32_KERNELS_TOLERANCE if float32_kernels else FLOAT64_TOLERANCE
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    if objective == "ppo":
        losses = [GRPOLoss(epsilon_low=0.2, epsilon_high=0.2), ValueLoss(cliprange_value=0.2, coef=0.1)]
    else:
        losses = [GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, beta=0.05, entropy_coef=0.01)]
    if shapes is not None:
        cases, skipped = [(name, SHAPES[name], None) for name in shapes], {}
    else:
        cases = [(name, build, None) for name, build in SHAPES.items() if name != "random"]
        threshold_cases, skipped = _threshold_cases(model, EngineConfig(**ENGINE))
        cases += threshold_cases + [(f"random-{i}", SHAPES["random"], None) for i in range(random_trees)]
    results = []
    for name, build, threshold in cases:
        rollouts = make_rollouts(build(vocab, g), g)
        tree = RolloutTree(rollouts)
        with compute():
            current = replay_logprobs(model, tree, temperature=temperature, trusted=force).logprobs
        for r, lp in zip(rollouts, current, strict=True):  # off-policy: some ratios are clipped, and KL is non-zero
            noise = 0.3 * (torch.rand(len(r), generator=g, dtype=torch.float64) - 0.5)
            r.old_logprobs = (lp.double() + noise) * r.loss_mask
            r.ref_logprobs = (lp.double() - noise) * r.loss_mask
        engine = EngineConfig(**ENGINE, replay="replay" if len(results) % 2 else "keep")
        if objective == "rloo":
            results.append(_check_rloo(models[0], rollouts, tree, name, threshold, temperature, engine, force,
                                       compute, tolerance, g))
            continue
        if objective == "ppo":  # per-token advantages (GAE's), value targets, values at sampling moved (clipping)
            with compute():
                values = replay_logprobs(models[1][0], tree, engine=engine, trusted=force).values
            for r, v in zip(rollouts, values, strict=True):
                r.advantages = torch.randn(len(r), generator=g, dtype=torch.float64) * r.loss_mask
                r.returns = (v.double() + torch.randn(len(r), generator=g, dtype=torch.float64)) * r.loss_mask
                r.old_values = (v.double() + 0.3 * torch.randn(len(r), generator=g, dtype=torch.float64)) \
                    * r.loss_mask
        for (m, m64), loss, suffix in zip(models, losses, ("", "/critic")[: len(models)], strict=True):
            results.append(_check(m, m64, rollouts, tree, loss, f"{name}{suffix}", threshold, temperature, engine,
                                  force, compute, tolerance))
    if results and results[0].naive_rel_grad_err_vs_f64 is not None:  # float32 / bfloat16: against float64
        judge_against_float64(results)
    return results, skipped


def _check(model, reference64, rollouts, tree, loss, name, threshold, temperature, engine, force, compute,
           tolerance) -> ShapeResult:
    """One tree of `verify_model`: the engine against naive (and both against float64), by the module's bound."""
    with compute():
        naive, g_naive = _naive(model, rollouts, loss, temperature)
        model.zero_grad(set_to_none=True)
        replay = replay_backward(model, tree, loss, temperature=temperature, engine=engine, trusted=force)
    g_replay = [_grad(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    result = ShapeResult(name, len(rollouts), tree.stats.logical_tokens, tree.stats.physical_tokens,
                         max_rel_grad_err(g_replay, g_naive), _logprob_err(replay, naive), False, threshold)
    if reference64 is None:
        result.passed = result.max_rel_grad_err <= tolerance and result.max_abs_logprob_err <= 10 * tolerance
    else:
        naive64, g64 = _naive(reference64, rollouts, loss, temperature)
        _judge_vs_f64(result, g_replay, g_naive, g64, _logprob_err(replay, naive64), _logprob_err(naive, naive64))
    return result


def _check_rloo(models, rollouts, tree, name, threshold, temperature, engine, force, compute, tolerance,
                g) -> ShapeResult:
    """One tree of `verify_model(loss="rloo")`: leave-one-out advantages over the tree's rollouts (one group),
    old sums moved off-policy so that some ratios clip, `rloo_loss` through `replay_sequence_backward` against
    `naive_sequence_backward`."""
    model, reference64 = models
    rewards = torch.rand(len(rollouts), generator=g, dtype=torch.float64)
    n = max(len(rollouts) - 1, 1)
    advantages = rewards - (rewards.sum() - rewards) / n  # leave-one-out, the tree one group
    with compute():
        sums = sequence_sums(replay_logprobs(model, tree, temperature=temperature, trusted=force).logprobs, rollouts)
    # ratios well inside the clip range or well outside it (|log ratio| 0.05 or 0.8, margins of 0.15 nats or more):
    # a summed bfloat16 logprob is off by ~0.05 nats, so no rounding can flip a clipping decision between the engine
    # and naive, and both branches of the clip are exercised
    offsets = torch.tensor([0.05, -0.8, -0.05, 0.8], dtype=torch.float64)
    old = sums + offsets[torch.arange(len(rollouts)) % 4]

    def loss(s):
        return rloo_loss(s, old, advantages, epsilon_low=0.2, epsilon_high=0.28)

    trees = [tree]
    result = _sequence_check(model, reference64, rollouts, trees, loss, name, engine, force, compute, tolerance,
                             temperature)
    result.threshold = threshold
    return result


def verify_dpo(model, seed: int = 0, pairs: int = 3, force: bool = False) -> list[ShapeResult]:
    """DPO over pair trees (`engine.sequence.replay_sequence_backward` with `losses.dpo_loss`) against the naive
    per-sequence computation (`reference.naive_sequence_backward`), for every DPO loss type: `pairs` pairs of one
    tree each, the prompt a node and the two responses branches, sharing a response prefix in every other pair.
    The bound is `verify_model`'s for the model's dtype; "logprob err" is the largest error of a summed logprob.
    Raises UnsupportedModelError for a family the engine does not know (unless `force`: run unchecked, as
    `verify_model`)."""
    float64 = next(model.parameters()).dtype == torch.float64
    vocab = model.config.vocab_size
    with keep_float64(model) if float64 else float64_copy(model) as numerics:
        reference64 = None if float64 else numerics
        results = []
        for loss_type in DPO_LOSS_TYPES:
            g = torch.Generator().manual_seed(seed)
            trees = [RolloutTree(_pair(vocab, g, shared=k % 2 == 0)) for k in range(pairs)]
            rollouts = [r for t in trees for r in t.rollouts]
            ref = -20.0 - 20.0 * torch.rand(len(rollouts), generator=g, dtype=torch.float64)
            lengths = torch.stack([r.loss_mask.sum() for r in rollouts]).double()

            def loss(s, ref=ref, lengths=lengths, loss_type=loss_type):
                return dpo_loss(s[0::2], s[1::2], ref[0::2], ref[1::2], beta=0.3, loss_type=loss_type,
                                label_smoothing=0.1, chosen_tokens=lengths[0::2],
                                rejected_tokens=lengths[1::2]).mean()

            results.append(_sequence_check(model, reference64, rollouts, trees, loss, f"dpo-{loss_type}",
                                           EngineConfig(**ENGINE), force, contextlib.nullcontext,
                                           FLOAT64_TOLERANCE))
    return results if float64 else judge_against_float64(results)


def _sequence_check(model, reference64, rollouts, trees, loss, name, engine, force, compute, tolerance,
                    temperature: float = 1.0) -> ShapeResult:
    """A loss of summed logprobs over `trees` against the naive per-sequence computation (and float64)."""
    with compute():
        model.zero_grad(set_to_none=True)
        _, naive_sums = naive_sequence_backward(model, rollouts, loss, temperature=temperature)
        g_naive = [_grad(p) for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        _, sums, _ = replay_sequence_backward(model, trees, loss, temperature=temperature, engine=engine,
                                              trusted=force)
    g_tree = [_grad(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    stats = sum((t.stats for t in trees[1:]), trees[0].stats)
    result = ShapeResult(name, len(rollouts), stats.logical_tokens, stats.physical_tokens,
                         max_rel_grad_err(g_tree, g_naive), (sums - naive_sums).abs().max().item(), False)
    if reference64 is None:
        result.passed = result.max_rel_grad_err <= tolerance
    else:
        reference64.zero_grad(set_to_none=True)
        _, sums64 = naive_sequence_backward(reference64, rollouts, loss, temperature=temperature)
        g64 = [_grad(p) for p in reference64.parameters()]
        reference64.zero_grad(set_to_none=True)
        _judge_vs_f64(result, g_tree, g_naive, g64, (sums - sums64).abs().max().item(),
                      (naive_sums - sums64).abs().max().item())
    return result


def _judge_vs_f64(result: ShapeResult, g_tree, g_naive, g64, tree_logprob_err: float,
                  naive_logprob_err: float) -> None:
    """Fill `result`'s float64 errors; `judge_against_float64` gives the verdict, once every tree's are in."""
    result.max_rel_grad_err_vs_f64 = max_rel_grad_err(g_tree, g64)
    result.naive_rel_grad_err_vs_f64 = max_rel_grad_err(g_naive, g64)
    result.logprob_err_vs_f64, result.naive_logprob_err_vs_f64 = tree_logprob_err, naive_logprob_err


def judge_against_float64(results: list[ShapeResult]) -> list[ShapeResult]:
    """The verdict of float32 / bfloat16 results (module docstring): the engine's error against float64 at most
    `VS_FLOAT64_FACTOR` x the largest of the naive computation's over the results of the same kind (a critic's rows,
    "<shape>/critic", apart: values have another scale); logprobs likewise, plus 1e-5 nats. Returns `results`,
    their `passed` and `bound_vs_f64` set."""
    for critic in (False, True):
        rows = [r for r in results if r.shape.endswith("/critic") == critic]
        if not rows:
            continue
        level = max(r.naive_rel_grad_err_vs_f64 for r in rows)
        logprob_level = max(r.naive_logprob_err_vs_f64 for r in rows)
        for r in rows:
            r.bound_vs_f64 = VS_FLOAT64_FACTOR * level
            r.passed = (r.max_rel_grad_err_vs_f64 <= r.bound_vs_f64
                        and r.logprob_err_vs_f64 <= VS_FLOAT64_FACTOR * logprob_level + 1e-5)
    return results


def _pair(vocab: int, g: torch.Generator, shared: bool) -> list[Rollout]:
    """[chosen, rejected]: a prompt of 8-40 tokens, responses of 1-12 tokens after a shared 1-6 (or none)."""
    def ids(lo, hi):
        return torch.randint(0, vocab, (int(torch.randint(lo, hi + 1, (), generator=g)),), generator=g).tolist()

    prompt, common = ids(8, 40), ids(1, 6) if shared else []
    return [Rollout(prompt + common + tail, loss_mask=[0] * len(prompt) + [1] * (len(common) + len(tail)))
            for tail in (ids(1, 12), ids(1, 12))]


@contextlib.contextmanager
def float64_copy(model) -> Iterator[torch.nn.Module]:
    """A float64 copy of `model` under `keep_float64` while inside (the truth that float32 / bfloat16 errors are
    taken from)."""
    reference = copy.deepcopy(model).double()
    with keep_float64(reference):
        yield reference


def _naive(model, rollouts, loss, temperature):
    model.zero_grad(set_to_none=True)
    result = naive_backward(model, rollouts, loss, temperature=temperature)
    grads = [_grad(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return result, grads


def _logprob_err(a, b) -> float:
    """Largest |difference| of two results' logprobs (a critic's: values)."""
    if a.values is not None:
        return max((x - y).abs().max().item() for x, y in zip(a.values, b.values, strict=True))
    return max((x - y).abs().max().item() for x, y in zip(a.logprobs, b.logprobs, strict=True))


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad.clone() if p.grad is not None else torch.zeros_like(p)
