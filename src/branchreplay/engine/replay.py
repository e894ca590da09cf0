"""One engine call: `replay_backward` and `replay_logprobs` over a list of trees, as the callers see them.

The call resolves the model's view once (`stack.model_view`), checks the trees against the model, runs the trees of
the call that share a start as one forest (`tree.forests`, `EngineConfig.forest`), runs each tree through the
execution stack (`stack.py`) as one sub-forest per regime of a length-dependent rotary encoding (`positions.py`), in
lock-step with the other ranks when asked (`parallel/lockstep.py`), and returns every rollout's results in the order
given. `replay_backward_sharded` runs a data-parallel rank's share of the trees (`parallel/distributed.py`,
`parallel/sharding.py`).
"""

from __future__ import annotations

import contextlib

import torch

from ..losses import LossFn
from ..models import base_of, max_positions
from ..tree import ReplayResult, RolloutTree, TreeStats, forests
from .config import EngineConfig
from .families import check_no_dropout
from .model_view import ModelView
from .options import ReplayOptions
from .parallel.context_parallel import ContextParallelTree
from .parallel.distributed import DataParallel, check_same_trees
from .parallel.lockstep import LockStep, drain
from .parallel.sharding import CostModel, shard
from .positions import held_at_length, regimes
from .router import RouterLoss
from .stack import _Run
from .vision import language_model


def replay_backward(
    model,
    trees: RolloutTree | list[RolloutTree],
    loss: LossFn,
    *,
    temperature: float = 1.0,
    engine: EngineConfig | None = None,
    trusted: bool = False,
    final_backward: contextlib.AbstractContextManager | None = None,
    lockstep: bool = False,
    router: RouterLoss | None = None,
) -> ReplayResult:
    """Forward and backward of `loss` over every rollout of `trees`, each unique position computed once.

    Gradients accumulate into `param.grad` as `sum(loss over rollouts).backward()` would (call
    `optimizer.zero_grad()` yourself).

    Args:
        model: a Hugging Face causal LM of a supported family (see `branchreplay.engine.FAMILIES`), with no active
            dropout; or a peft `PeftModel` of one (LoRA: the adapters' parameters get their gradients).
        trees: one tree or a list of them (e.g. one per prompt group). With `engine.forest` (the default)
            consecutive trees that share a start (a system prompt, a tool schema, few-shot turns) run as one forest
            (`tree.forests`: without images, with the same optional rollout fields), so the start runs once per
            call; results stay per rollout, in order.
        loss: maps a node's `LossInputs` to a scalar; e.g. `GRPOLoss()`.
        temperature: logprobs are of softmax(logits / temperature), as the sampler's.
        engine: packing, chunking and replay options (`EngineConfig`; None: its defaults).
        trusted: run a family that is not in the registry, as `families.generic_family` guesses it, unchecked:
            the caller checked it (the package's `branchreplay.replay_backward(force=True)` runs the self-check first;
            `branchreplay verify --force` and the trainer check it themselves).
        final_backward: a context entered around the call's LAST backward pass (the root pack of the last tree),
            which always runs, through every layer (with a zero loss if nothing else flows there). Data parallelism
            uses it to reduce gradients once per step instead of once per pack (`engine/parallel/distributed.py`).
        lockstep: run every decoder forward and backward in step with the other ranks of the default process group
            (`lockstep.LockStep`: FSDP2 with its parameters gathered per layer); every backward then runs through
            every layer. Every rank must make the same number of calls with it.
        router: the MoE router load-balancing loss's pass 2 (`router.RouterLoss`, after its pass 1 and
            `set_gradient`): its gradient is added to the loss's.
    A tree whose rollouts fall in different regimes of a length-dependent rotary encoding (longrope, dynamic NTK:
    `engine/positions.py`) runs as one sub-forest per regime; `stats` counts the positions actually computed.

    Raises:
        UnsupportedModelError: the model's family (unless `trusted`) or attention implementation is not supported, an
            unregistered family's attention the engine cannot carry (ALiBi, a cache of another layout). (The
            self-check of an unregistered family is the package's `branchreplay.replay_backward(force=True)`.)
        HeadMismatchError: the model's ForCausalLM transforms its logits in a way the engine's head does not know.
        ValueError: token ids outside the vocabulary, a rollout longer than the model's maximum positions, active
            dropout, or inconsistent old/ref logprobs.
    """
    engine = EngineConfig() if engine is None else engine
    return replay_with(model, trees, loss, ReplayOptions(temperature, engine, trusted, lockstep, final_backward,
                                                         router=router))


def replay_backward_sharded(dp: DataParallel, trees, loss, *, temperature: float = 1.0, engine=None,
                            trusted: bool = False, layout: str = "auto", cost=None):
    """`replay_backward` of this rank's share of `trees` (`sharding.shard` with `layout` and `cost`, its
    `CostModel`, default `CostModel()`; the same plan on every rank), the gradient reduced once: afterwards
    every rank's gradient is the sum over all ranks, i.e. the single-process gradient of all `trees` (FSDP2 layers:
    this rank's shard of it). Returns (this rank's `ReplayResult`, the `ShardPlan`). Every rank must call it with the
    same trees: `distributed.check_same_trees` raises ValueError, naming the ranks, where they differ. `trusted`: as
    `replay_backward`'s (check an unregistered family before sharding, `self_check.ensure_supported`, since the
    check needs the whole model).
    """
    plan = shard(list(trees), dp.world_size, dp.model.config, layout=layout, cost=cost or CostModel())
    check_same_trees(list(trees), plan.layout)
    with dp.accumulate():
        result = replay_backward(dp.model, plan.parts[dp.rank], loss, temperature=temperature,
                                 engine=engine, trusted=trusted, final_backward=dp.final_sync(),
                                 lockstep=dp.lockstep)
    dp.reduce_replicated()
    return result, plan


@torch.no_grad()
def replay_logprobs(
    model,
    trees: RolloutTree | list[RolloutTree],
    *,
    temperature: float = 1.0,
    engine: EngineConfig | None = None,
    trusted: bool = False,
    lockstep: bool = False,
    head_stats: tuple[str, ...] = (),
    router: RouterLoss | None = None,
) -> ReplayResult:
    """Forward only, no autograd graph: per-rollout logprobs (old-policy or reference), equal to running each
    rollout alone. Same arguments and errors as `replay_backward`; `head_stats`: names of `head.HEAD_STATS` to
    return too (`ReplayResult.head_stats`; TRL's DPO metrics read them); `router`: a fresh `router.RouterLoss`
    that sums the MoE router load-balancing loss's statistics over the trees (its pass 1)."""
    engine = EngineConfig() if engine is None else engine
    return replay_with(model, trees, None, ReplayOptions(temperature, engine, trusted, lockstep,
                                                    head_stats=tuple(head_stats), router=router))


def replay_with(model, trees: RolloutTree | list[RolloutTree], loss: LossFn | None, options: ReplayOptions
                ) -> ReplayResult:
    """`replay_backward` (with a `loss`) or `replay_logprobs` (`loss` None: without an autograd graph) with their
    options in one object: what a caller that keeps its options (`rl.policy.Policy`) passes down. Same result and
    errors."""
    if loss is None:
        with torch.no_grad():
            return _replay(model, trees, None, options)
    return _replay(model, trees, loss, options)


def _replay(model, trees, loss, options: ReplayOptions) -> ReplayResult:
    trees = [trees] if isinstance(trees, RolloutTree) else list(trees)
    engine, lockstep, router = options.engine, options.lockstep, options.router
    final_backward = options.final_backward
    if options.temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {options.temperature}")
    model = base_of(model)  # a LoRA model runs as its base model with the adapter layers in place
    vision_language, model = model, language_model(model)  # a vision-language model's LM (vision.py)
    run = _Run(model, loss, options)
    view = run.view  # the model, resolved once for the call (`stack.model_view`)
    _check_context_parallel(trees, view.rotaries)
    if router is not None and (lockstep or any(isinstance(t, ContextParallelTree) for t in trees)):
        raise ValueError("the MoE router loss runs on one process: not with lockstep or context parallelism")
    for tree in trees:
        _check_rollouts(tree, view)
        images = getattr(tree, "images", None)
        if images is not None and images.model is not None and images.model is not vision_language:
            raise ValueError("a tree's images were made for another model (ImagePrompt.of(model, ...)): their "
                             "features would come from that model's vision tower; make the ImagePrompt with the "
                             "model the tree runs on")
        if images is not None and (lockstep or final_backward is not None or router is not None):
            raise ValueError("trees with images run on one process, without the MoE router loss")
        if images is not None and images.rope_positions is not None and view.rotaries:
            raise ValueError("a length-dependent rotary encoding (dynamic NTK, longrope) with rotary positions on "
                             "the image grid is not run over trees: its frequencies follow the largest position id, "
                             "which the images move; use the model's default rotary (rope_type='default')")
    if vision_language is not model and loss is not None:  # the vision tower's parameters get gradients too
        check_no_dropout(vision_language)
    run.lockstep = lockstep
    if engine.forest:
        trees = forests(trees)
    attached = router.attached() if router is not None else contextlib.nullcontext()
    with run.prefix_split, attached:  # split prefix attention until the last tree is done (attention.py)
        events = _trees(run, trees, final_backward)
        results = LockStep(run.dummy_forward, loss is not None).run(events) if lockstep else drain(events)
    if run.deferred is not None:  # what the packs left of the input embedding's gradient (embedding.py)
        with torch.autocast(view.device.type, enabled=False):
            run.deferred.apply()
    return ReplayResult.merge(results)


def _trees(run: _Run, trees: list, final_backward):
    """The trees one after another, as the generator of their collective events (`lockstep.py`); returns their
    results."""
    results = [ReplayResult([], [], 0.0, TreeStats(0, 0, 0, 0, 0))] if not trees else []
    train = run.loss is not None
    for t, tree in enumerate(trees):
        if isinstance(tree, ContextParallelTree):  # its prefix once across the ranks (context_parallel.py)
            run.final_backward = final_backward if t == len(trees) - 1 and train else None
            results.append((yield from run.run_tree(tree)))
            continue
        # rollouts whose full forwards pick other rotary frequencies run as separate sub-forests (positions.py)
        parts, order = [], []
        groups = regimes(run.view.rotaries, [len(r) for r in tree.rollouts])
        for k, (length, members) in enumerate(groups):
            sub = tree if len(members) == len(tree.rollouts) else \
                RolloutTree([tree.rollouts[i] for i in members], images=tree.images)
            last = t == len(trees) - 1 and k == len(groups) - 1
            run.final_backward = final_backward if last and train else None
            with held_at_length(run.view.model, length, run.view.rotaries):
                parts.append((yield from run.run_tree(sub)))
            order += members
        results.append(_in_order(ReplayResult.merge(parts), order))
    return results


def _check_rollouts(tree: RolloutTree, view: ModelView) -> None:
    """Raises ValueError for a rollout of `tree` that the model cannot run (a token id outside its vocabulary, more
    tokens than its maximum positions), or for old/ref logprobs that some rollouts carry and others not."""
    max_pos = max_positions(view.model.config)
    for i, r in enumerate(tree.rollouts):
        ids = r.token_ids
        if ids.min() < 0 or ids.max() >= view.vocab_size:
            bad = ids[(ids < 0) | (ids >= view.vocab_size)][0].item()
            raise ValueError(f"rollout {i} holds token id {bad}, outside the vocabulary [0, {view.vocab_size})")
        if max_pos is not None and len(r) > max_pos:
            raise ValueError(
                f"rollout {i} has {len(r)} tokens, more than the model's max_position_embeddings ({max_pos}); "
                "shorten the prompt or the completion (SamplingConfig.max_new_tokens)"
            )
    for name in ("old_logprobs", "ref_logprobs"):
        given = {getattr(r, name) is not None for r in tree.rollouts}
        if len(given) > 1:
            raise ValueError(f"some rollouts carry {name} and others do not: give it for all or none")


def _check_context_parallel(trees: list, rotaries) -> None:
    """Context-parallel parts run after every whole tree (so that the step's last backward, which may hold the
    gradient's reduce-scatter, is a context-parallel round on every rank alike), and not under a length-dependent
    rotary encoding (its frequencies follow each rollout's length, which the prefix's pieces do not know)."""
    parts = [isinstance(t, ContextParallelTree) for t in trees]
    if True in parts and not all(parts[parts.index(True):]):
        raise ValueError("context-parallel parts (ContextParallelTree) must come after every whole tree "
                         "(engine/parallel/sharding.py orders a rank's trees so)")
    if any(parts) and rotaries:
        raise ValueError("context parallelism does not run a length-dependent rotary encoding (longrope, dynamic "
                         "NTK): run the tree whole or split by its branches")


def _in_order(result: ReplayResult, order: list[int]) -> ReplayResult:
    """`result` of rollouts `order` (sub-forests one after another) with its per-rollout lists in rollout order."""
    position = {i: k for k, i in enumerate(order)}
    def reordered(values: list) -> list:
        return [values[position[i]] for i in range(len(order))]

    for name in ("logprobs", "entropy", "values"):
        if getattr(result, name):
            setattr(result, name, reordered(getattr(result, name)))
    result.head_stats = {name: reordered(values) for name, values in result.head_stats.items()}
    return result
