"""Groups whose rows land on several processes: their prompt recomputed on each rank, or run once across the ranks.

TRL's sampler hands each process a slice of the global batch, a prompt's G rows consecutive, so when
`per_device_train_batch_size` is not a multiple of `num_generations` a group's rows land on two (or more) ranks.
Each rank's tree of that prompt then starts with the same prompt, which either

    recompute          every rank that holds rows of it computes it (forward and backward) in its own tree, or
    context-parallel   it runs once across all ranks as the engine's context-parallel prefix
                       (`engine.parallel.context_parallel`), each rank's rows below it as its branches.

"auto" takes, per prompt, the faster on the engine's cost model (`arranged`). The gradient is the same either way:
what the ranks' branches send back to the prompt's K/V is summed over the ranks in the backward.
"""

from __future__ import annotations

import itertools
import typing

import torch
import torch.distributed as dist

from ..engine.parallel.context_parallel import ContextParallelTree, zigzag_rounds
from ..engine.parallel.sharding import prefix_seconds, shared_prefix_length, supports_context_parallel
from .options import SplitGroups

CHOICES = typing.get_args(SplitGroups)


def split_groups_refusal(choice: str, config, vision_language: bool, router_loss: bool) -> str:
    """Why `split_groups=choice` cannot run for a model of `config` ("" when it can): an unknown choice, or
    "context-parallel" for a family whose prefix cannot run context-parallel (recurrent or sliding-window layers, a
    length-dependent rotary), a vision-language model, or the MoE router loss. Under "auto" those keep the prompt
    recomputed."""
    if choice not in CHOICES:
        return f"split_groups={choice!r}; use one of {', '.join(CHOICES)}"
    if choice != "context-parallel":
        return ""
    why = supports_context_parallel(config) or ("a vision-language model's images run on one process"
                                                if vision_language else "") \
        or ("the MoE router loss runs on one process" if router_loss else "")
    return f"split_groups='context-parallel' cannot run here: {why}; use 'auto' or 'recompute'" if why else ""


def arranged(trees: list, order: list[int], choice: str, config, element_bytes: int, router_loss: bool = False,
             forest: bool = True) -> tuple[list, list[int]]:
    """The micro-batch's trees (`rows.prompt_trees`, and the row of each of their rollouts) with the prompts held
    by several ranks that run across them (module docstring) as `ContextParallelTree`s after the whole trees (a
    rank without rows of such a prompt runs its pieces alone), and the rows in the new trees' order. A collective
    (an object all-gather): every rank calls it for every micro-batch. Unchanged on one process, under
    "recompute", and for trees that cannot run context-parallel (images, recurrent or sliding-window families, the
    MoE router loss, a prompt shorter than the number of ranks). `forest`: the engine runs the rank's trees as one
    prefix forest (`EngineConfig.forest`), so a prompt's start shared with another tree costs the rank nothing.

    "auto" takes, per prompt, the faster on the engine's cost model (`engine.parallel.sharding.prefix_seconds`): what
    each rank holding rows of it computes for it alone (its positions after the longest start it shares with the rank's
    other prompts, which the prefix forest computes once anyway) against its pieces of the whole prompt, the bytes moved
    and the collective calls; across the ranks only when that is faster on every rank holding it. The gradient is the
    same either way: what the ranks' branches send back to the prompt's K/V is summed over the ranks in the backward,
    and the wrapper's reduction then averages the parameters' gradients as before. Every rank decides alike from the
    same gathered prompts, and runs the context-parallel prompts after its whole trees, in the same order (the engine's
    rule)."""
    if (choice == "recompute" or not dist.is_initialized() or dist.get_world_size() == 1 or router_loss
            or supports_context_parallel(config)):  # the same on every rank
        return trees, order
    world, rank = dist.get_world_size(), dist.get_rank()
    prompts = [tuple(t.rollouts[0].token_ids[:shared_prefix_length(t)].tolist()) if t.images is None else None
               for t in trees]
    owns = [None if p is None else max(len(p) - (shared_start(t, trees) if forest else 0), 0)
            for p, t in zip(prompts, trees, strict=True)]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, list(zip(prompts, owns, strict=True)))
    holders: dict[tuple, list[int]] = {}  # a prompt -> what each rank holding it computes for it alone
    for theirs in everyone:
        for prompt, own in theirs:
            if prompt is not None:
                holders.setdefault(prompt, []).append(own)
    across = [p for p, own in holders.items() if len(own) > 1 and len(p) >= world
              and (choice == "context-parallel" or faster_across(len(p), world, config, element_bytes, min(own)))]
    if not across:
        return trees, order
    starts = [0]
    for tree in trees:
        starts.append(starts[-1] + len(tree.rollouts))
    rows = [order[a:b] for a, b in itertools.pairwise(starts)]
    mine = {prompts[i]: i for i in range(len(trees)) if prompts[i] in set(across)}
    whole = [i for i in range(len(trees)) if prompts[i] not in mine]
    out, out_order = [trees[i] for i in whole], [row for i in whole for row in rows[i]]
    for prompt in across:
        i = mine.get(prompt)
        out.append(ContextParallelTree(torch.tensor(prompt), trees[i] if i is not None else None,
                                       zigzag_rounds(len(prompt), world), rank))
        out_order += rows[i] if i is not None else []
    return out, out_order


def faster_across(P: int, world: int, config, element_bytes: int, own: int | None = None) -> bool:
    """Whether the cost model predicts a prompt of P positions faster once across `world` ranks than its last `own`
    positions (default all) computed on a rank (`engine.parallel.sharding.prefix_seconds`)."""
    whole, across = prefix_seconds(P, world, config, element_bytes=element_bytes, own=own)
    return across < whole


def shared_start(tree, trees: list) -> int:
    """The most positions `tree`'s first rollout shares from its start with the first rollout of another of
    `trees` (what a prefix forest of them computes once)."""
    ids = tree.rollouts[0].token_ids
    best = 0
    for other in trees:
        if other is not tree:
            theirs = other.rollouts[0].token_ids
            n = min(len(ids), len(theirs))
            differ = (ids[:n] != theirs[:n]).nonzero()
            best = max(best, int(differ[0]) if len(differ) else n)
    return best
