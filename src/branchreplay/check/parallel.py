"""`branchreplay verify --nproc N --loss grpo|ppo|rloo|dpo`: the data-parallel step on N local gloo processes against
the same step in one process, on a tiny random config or a user's model.

grpo: the sharded engine step (`engine.replay.replay_backward_sharded`) with the GRPO loss, on two steps: every
non-random shape of `shapes.SHAPES` as its own tree (groups go to ranks whole) and the shared-prompt tree alone
(split across the ranks). ppo, rloo, dpo: the trainer's own first update of that algorithm
(`rl.run.step.first_update_gradient`, FSDP2 or DDP) on a synthetic batch (`algorithm_batch`). The one-process
computation is checked against the naive per-rollout one by `verify --loss` itself. Bound: float64 as
`verify_model`'s (1e-6, 1e-4 for the families that compute in float32), float32 1e-4 (the tiny configs'
engine-vs-naive bound).
Design notes: docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile

import torch

from ..engine.families import FAMILIES
from ..losses import GRPOLoss
from ..reference.float64 import keep_float64
from ..reference.naive import max_rel_grad_err
from ..reference.shapes import SHAPES, make_rollouts, random_ids
from ..tree import RolloutTree
from .verify import FLOAT32_KERNELS_TOLERANCE, FLOAT64_TOLERANCE

ALGORITHM_SETTINGS = {
    "ppo": {"ppo": {"num_ppo_epochs": 2, "kl_coef": 0.05}},
    "rloo": {"grpo": {"beta": 0.05, "num_generations": 4}},
    "dpo": {"dpo": {"dataset": "synthetic pairs (verify)", "loss_type": "sigmoid"}},
    "grpo": {"grpo": {"beta": 0.05, "entropy_coef": 0.01, "num_iterations": 2}},
}
"""The run config of each checked algorithm: a KL term and a second update where the algorithm has them, so that
the reference and old-policy passes are exercised."""


def verify_data_parallel(spec: str, dtype: torch.dtype, nproc: int, strategy: str, seed: int = 0,
                         force: bool = False, loss: str = "grpo") -> dict:
    """The check of the module docstring on `nproc` local processes; `spec`: a tiny arch ("tiny:llama") or a model
    path. Returns {"passed", "max_rel_grad_err", "world_size", "strategy", "trees", "tolerance", "imbalance",
    "recomputed_positions"}."""
    import torch.multiprocessing as mp

    from ..engine.parallel.distributed import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(nproc, port, spec, dtype, strategy, seed, force, tmp, loss), nprocs=nproc, join=True)
        reports = [json.loads(open(f"{tmp}/rank{r}.json").read()) for r in range(nproc)]
    err = max(r["max_rel_grad_err"] for r in reports)
    tolerance = reports[0]["tolerance"]
    return {"passed": err <= tolerance, "max_rel_grad_err": err, "world_size": nproc, "strategy": strategy,
            "trees": reports[0]["trees"], "tolerance": tolerance, "imbalance": reports[0]["imbalance"],
            "recomputed_positions": reports[0]["recomputed_positions"]}


def _worker(rank, world, port, spec, dtype, strategy, seed, force, out, loss):
    import torch.distributed as dist

    from ..engine.parallel.distributed import end_spawned_rank
    from ..models import load_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    single, _ = load_model(spec, dtype=dtype)
    model, _ = load_model(spec, dtype=dtype)
    numerics = (lambda m: keep_float64(m)) if dtype == torch.float64 else (lambda m: contextlib.nullcontext())
    with numerics(single), numerics(model):
        if loss == "grpo":
            report = _grpo_step(single, model, strategy, seed, force)
        else:
            report = algorithm_gradients(single, model, loss, strategy, seed, force)
    family = FAMILIES.get(model.config.model_type)
    report["tolerance"] = (FLOAT32_KERNELS_TOLERANCE if family is not None and family.float32_kernels
                           else FLOAT64_TOLERANCE) if dtype == torch.float64 else 1e-4
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    end_spawned_rank()  # on success only, after its results are written (engine.parallel.distributed)


def _grpo_step(single, model, strategy: str, seed: int, force: bool) -> dict:
    """The sharded engine step with the GRPO loss on two steps of trees (module docstring)."""
    from ..engine import replay_backward, replay_logprobs
    from ..engine.parallel.distributed import DataParallel
    from ..engine.replay import replay_backward_sharded

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    loss = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, beta=0.05, entropy_coef=0.01)
    forest = [RolloutTree(make_rollouts(build(vocab, g), g)) for name, build in SHAPES.items() if name != "random"]
    steps = [forest, [RolloutTree(make_rollouts(SHAPES["shared-prompt"](vocab, g), g))]]
    errors, imbalance, recomputed = [], [], 0
    dp = DataParallel(model, strategy)
    for trees in steps:
        for tree in trees:  # off-policy, with reference logprobs: clipping and KL are exercised
            current = replay_logprobs(single, tree, trusted=force).logprobs
            for r, lp in zip(tree.rollouts, current, strict=True):
                noise = 0.3 * (torch.rand(len(r), generator=g, dtype=torch.float64) - 0.5)
                r.old_logprobs = (lp.double() + noise) * r.loss_mask
                r.ref_logprobs = (lp.double() - noise) * r.loss_mask
        single.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        replay_backward(single, trees, loss, trusted=force)
        expected = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in single.parameters()]
        _, plan = replay_backward_sharded(dp, trees, loss, trusted=force)
        errors.append(max_rel_grad_err(dp.full_grads(), expected))
        imbalance.append(plan.imbalance)
        recomputed += plan.recomputed_positions
    return {"max_rel_grad_err": max(errors), "trees": len(forest) + 1, "imbalance": max(imbalance),
            "recomputed_positions": recomputed}


def algorithm_gradients(single, model, algorithm: str, strategy: str, seed: int = 0, force: bool = False,
                        mode: str = "gather-once", settings: dict | None = None, layout: str = "auto",
                        groups: int = 3) -> dict:
    """On every rank of the default process group: the first update's gradient of `algorithm` ("grpo", "ppo",
    "rloo", "reinforce_pp", "dpo") on one synthetic batch of `groups` groups (`algorithm_batch`), with `model`
    data-parallel (`strategy` "fsdp2" in FSDP2 `mode`, or "ddp"; trees shared out by parallel.layout `layout`)
    against `single`, a copy of it in one process; `settings`: config sections instead of `ALGORITHM_SETTINGS`'.
    Returns {"max_rel_grad_err", "trees", "imbalance", "recomputed_positions", "layout"}."""
    from ..engine.parallel.sharding import shard
    from ..rl.run.parallel import Ranks
    from ..rl.run.step import first_update_gradient

    ranks = Ranks(torch.distributed.get_rank(), torch.distributed.get_world_size())
    grads = []
    for m, r in ((single, None), (model, ranks)):
        part = _part(m, algorithm, r, force, settings)
        if r is not None:
            part.policy.distribute(strategy, mode)
            if part.critic is not None:
                part.critic.distribute(strategy, mode)
        batch = algorithm_batch(algorithm, part.config, m.config.vocab_size, seed, groups)
        grads.append(first_update_gradient(part, batch, r, layout))
    plan = shard(batch.trees, ranks.world_size, model.config, allow_empty=True, layout=layout)
    return {"max_rel_grad_err": max_rel_grad_err(grads[1], grads[0]), "trees": len(batch.trees),
            "imbalance": plan.imbalance, "recomputed_positions": plan.recomputed_positions, "layout": plan.layout}


def _part(model, algorithm: str, ranks, force: bool, settings: dict | None = None):
    """The algorithm's part for `model` with `settings` (default `ALGORITHM_SETTINGS`'), as the trainer builds it
    (its policy, a frozen reference where it has one: a copy of the model with its weights moved by 10%, the same
    on every rank)."""
    from ..rl.algorithms import algorithm_class
    from ..rl.config import Config
    from ..rl.policy import Policy

    sections = ALGORITHM_SETTINGS.get(algorithm, {}) if settings is None else settings
    config = Config.from_dict({"algorithm": algorithm, **sections})
    part = algorithm_class(algorithm)
    policy = Policy(model, 1.0 if algorithm == "dpo" else 0.8, trusted=force, ranks=ranks)
    reference = None
    if part.needs_reference(config):  # moved off the policy, so that the KL terms and DPO's margins are not zero
        frozen = copy.deepcopy(model).requires_grad_(False)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in frozen.parameters():
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        reference = policy.sibling(frozen)
    return part(config, policy, reference)


def algorithm_batch(algorithm: str, config, vocab: int, seed: int = 0, groups: int = 3):
    """A synthetic batch of `algorithm`: `groups` (1 to 3) groups of shared prompts (12, 7 and 20 tokens) with 4, 3
    and 2 completions of 2-9 tokens, the first two of a group sharing their first two, random rewards, every second
    completion truncated (a `rollouts.batch.Batch`); for DPO five pairs over `groups` prompts, every second pair's
    responses sharing a prefix (a `PairBatch`). The same on every rank for a `seed`."""
    from ..rl.data.preferences import PairBatch, PreferencePair, pair_trees
    from ..rl.rollouts.batch import Batch, group_rollouts, group_std

    g = torch.Generator().manual_seed(seed)
    if algorithm == "dpo":
        prompts = [random_ids(n, vocab, g) for n in (12, 7, 20)[:groups]]
        pairs = []
        for row in range(5):
            common = random_ids(2, vocab, g) if row % 2 else []
            chosen, rejected = (common + random_ids(int(torch.randint(1, 7, (), generator=g)), vocab, g)
                                for _ in range(2))
            pairs.append(PreferencePair(prompts[row % groups], chosen, rejected, row))
        return PairBatch(*pair_trees(pairs))
    sequences = []
    for P, G in ((12, 4), (7, 3), (20, 2))[:groups]:
        prompt, head = random_ids(P, vocab, g), random_ids(2, vocab, g)  # the first two completions share a head
        group = []
        for k in range(G):
            tail = random_ids(int(torch.randint(2, 8, (), generator=g)), vocab, g)
            completion = head + tail if k < 2 else tail
            group.append((prompt + completion, [0] * P + [1] * len(completion), k % 2 == 1))
        sequences.append(group)
    rewards = torch.rand(sum(map(len, sequences)), generator=g)
    rollouts = group_rollouts(sequences, config.grpo, 9)
    std = group_std(rewards, [r.group for group in rollouts for r in group], config.grpo.scale_rewards)
    flat = [s for group in sequences for s in group]
    return Batch(rollouts, rewards, std, [int(sum(m)) for _, m, _ in flat], [c for _, _, c in flat])
