"""Context parallelism for a shared prefix (`engine/parallel/context_parallel.py`) and the sharding plan that chooses it
(`engine/parallel/sharding.py`).

The proof: on 2 and on 3 gloo processes, each rank runs its zigzag pieces of the prompt (K/V all-gathered per
layer) and its share of the branches; the ranks' gradients summed equal the naive reference (each rollout alone,
unpadded, in one process) to 1e-10 in float64, for a prompt with shared response prefixes below it, a forest where
one tree's prefix is context-parallel and the others run whole, a rank that has no branch at all, and, on 2
processes, FSDP2 over 3 AdamW steps. The control: the same run with the all-gather's backward cut (each rank keeps
only its own queries' dK, dV) is far off. The processes start once per world size (a module fixture); every case
runs inside them.
"""

import json
import os

import pytest
import torch

from branchreplay.engine.parallel.sharding import CostModel, shard, shared_prefix_length
from branchreplay.reference.shapes import branches_of_branches, make_rollouts, shared_prompt
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import RolloutTree
from helpers import spawn_ranks

RESHARDED = {"strategy": "fsdp2", "mode": "resharded"}  # FSDP2 per layer, the ranks' packs in lock-step
FREE_COMMUNICATION = CostModel(bytes_per_s=1e18, latency_s=0.0)  # so that the plan takes a context-parallel prefix


def _trees(case: str, vocab: int, seed: int = 0) -> list[RolloutTree]:
    g = torch.Generator().manual_seed(seed)
    if case == "prompt-and-shared-responses":  # a 24-token prompt, 3 response stems forking 2-3 ways
        return [RolloutTree(make_rollouts(branches_of_branches(vocab, g), g))]
    if case == "forest":  # one tree larger than a rank's share, three small ones
        return [RolloutTree(make_rollouts(shared_prompt(P, G, R, vocab, g), g))
                for P, G, R in [(60, 4, 5), (6, 2, 3), (7, 2, 4), (5, 3, 2)]]
    if case == "one-rollout":  # fewer rollouts than ranks: some rank has only its pieces of the prompt
        return [RolloutTree(make_rollouts(shared_prompt(12, 1, 5, vocab, g), g))]
    raise KeyError(case)


def _naive(model, trees, loss):
    from branchreplay.reference.naive import naive_backward

    model.zero_grad(set_to_none=True)
    result = naive_backward(model, [r for t in trees for r in t.rollouts], loss)
    return [p.grad.clone() for p in model.parameters()], result


def _worker(rank: int, world: int, out: str) -> None:
    import branchreplay.engine.parallel.context_parallel as cp
    from branchreplay.engine import replay_logprobs
    from branchreplay.engine.parallel.distributed import DataParallel
    from branchreplay.engine.replay import replay_backward_sharded
    from branchreplay.losses import GRPOLoss
    from branchreplay.reference.float64 import keep_float64
    from branchreplay.reference.naive import max_rel_grad_err

    loss, report = GRPOLoss(entropy_coef=0.01), {}
    single = tiny_model("llama", dtype=torch.float64, seed=0)
    with keep_float64(single):
        for name, layout, cost, strategy in [("prompt-and-shared-responses", "context-parallel", None, {}),
                                             ("forest", "auto", FREE_COMMUNICATION, {}),
                                             ("one-rollout", "context-parallel", None, {}),
                                             ("forest-fsdp2-resharded", "auto", FREE_COMMUNICATION, RESHARDED)]:
            trees = _trees(name.removesuffix("-fsdp2-resharded"), single.config.vocab_size)
            expected, naive = _naive(single, trees, loss)
            model = tiny_model("llama", dtype=torch.float64, seed=0)
            with keep_float64(model):
                dp = DataParallel(model, **(strategy or {"strategy": "ddp"}))
                result, plan = replay_backward_sharded(dp, trees, loss, layout=layout, cost=cost)
                mine = [r for part in plan.parts[rank] for r in part.rollouts]
                index = {id(r): i for i, r in enumerate(r for t in trees for r in t.rollouts)}
                logprobs = replay_logprobs(model, plan.parts[rank], lockstep=dp.lockstep).logprobs
                lp_err = max((float((a - naive.logprobs[index[id(r)]]).abs().max()) for a, r in zip(logprobs, mine,
                                                                                                    strict=True)),
                             default=0.0)
            report[name] = {"err": max_rel_grad_err(dp.full_grads(), expected), "layout": plan.layout,
                            "context_parallel": plan.context_parallel, "logprob_err": lp_err,
                            "train_logprob_err": max((float((a - naive.logprobs[index[id(r)]]).abs().max())
                                                      for a, r in zip(result.logprobs, mine,
                                                                      strict=True)), default=0.0),
                            "rollouts": len(mine), "physical": plan.physical_tokens}
        report["forest-resharded-micro-batches"] = _micro_batched_forest(rank, world, single, loss)
        # the control: each rank's piece keeps only its own queries' gradients (the reduce-scatter left out)
        trees = _trees("prompt-and-shared-responses", single.config.vocab_size)
        expected, _ = _naive(single, trees, loss)
        gather = cp._gather  # the same all-gather without autograd, this rank's own piece in place of its copy
        cp._gather = lambda x, lengths, dim=0: [x if r == rank else p
                                                for r, p in enumerate(gather(x.detach(), lengths, dim))]
        try:
            model = tiny_model("llama", dtype=torch.float64, seed=0)
            with keep_float64(model):
                dp = DataParallel(model, "ddp")
                replay_backward_sharded(dp, trees, loss, layout="context-parallel")
            report["control-no-reduce"] = {"err": max_rel_grad_err(dp.full_grads(), expected)}
        finally:
            cp._gather = gather
    for mode in ("gather-once", "resharded") if world == 2 else ():  # FSDP2, 3 AdamW steps against one process
        single, model = (tiny_model("llama", dtype=torch.float64, seed=0) for _ in range(2))
        with keep_float64(single), keep_float64(model):
            dp = DataParallel(model, "fsdp2", mode=mode)
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (single, model)]
            for step in range(3):
                trees = _trees("prompt-and-shared-responses", single.config.vocab_size, seed=step)
                _naive(single, trees, loss)
                opts[1].zero_grad(set_to_none=True)
                _, plan = replay_backward_sharded(dp, trees, loss, layout="context-parallel")
                for opt in opts:
                    opt.step()
            params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
            report[f"fsdp2-{mode}-adamw-3-steps"] = {"err": max_rel_grad_err(params, [p.detach() for p in
                                                                                  single.parameters()]),
                                                     "layout": plan.layout}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def _micro_batched_forest(rank: int, world: int, single, loss) -> dict:
    """The trainer's micro-batches of one tree in lock-step (FSDP2 resharded): the ranks hold different numbers of
    whole trees before their context-parallel part, which every rank must still run in the same call. The
    gradient's error against `single`'s naive one, the layout and each rank's number of whole trees."""
    from branchreplay.engine.parallel.context_parallel import ContextParallelTree
    from branchreplay.engine.parallel.distributed import DataParallel
    from branchreplay.reference.float64 import keep_float64
    from branchreplay.reference.naive import max_rel_grad_err
    from branchreplay.rl.policy import Policy

    trees = _trees("forest", single.config.vocab_size)
    expected, _ = _naive(single, trees, loss)
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    with keep_float64(model):
        dp = DataParallel(model, **RESHARDED)
        plan = shard(trees, world, model.config, cost=FREE_COMMUNICATION)
        with dp.accumulate():
            Policy(model, micro_batch=1, dp=dp).accumulate(plan.parts[rank], loss, final_backward=dp.final_sync())
        dp.reduce_replicated()
    return {"err": max_rel_grad_err(dp.full_grads(), expected), "layout": plan.layout,
            "whole": [sum(not isinstance(t, ContextParallelTree) for t in part) for part in plan.parts]}


@pytest.fixture(scope="module", params=[2, 3], ids=["2-processes", "3-processes"])
def reports(request, tmp_path_factory):
    """Every rank's report of one run of `_worker` on 2, then 3 processes."""
    world = request.param
    out = tmp_path_factory.mktemp(f"cp{world}")
    spawn_ranks(_worker, world, str(out))
    return world, [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_a_context_parallel_prefix_gives_the_naive_gradient(reports):
    world, ranks = reports
    for rank, report in enumerate(ranks):
        for case in ("prompt-and-shared-responses", "forest", "one-rollout", "forest-fsdp2-resharded"):
            r = report[case]
            assert r["layout"] == "context-parallel", (case, r)
            assert r["err"] <= 1e-10, f"{world} ranks, rank {rank}, {case}: max relative error {r['err']:.2e}"
            assert r["logprob_err"] <= 1e-10 and r["train_logprob_err"] <= 1e-10, (case, r)  # forward only too
        r = report["forest-resharded-micro-batches"]  # the trainer's micro-batches (grpo.micro_batch_prompts=1)
        assert r["err"] <= 1e-10 and r["layout"] == "context-parallel", r
        assert world == 3 or len(set(r["whole"])) > 1, r  # on 2 ranks the ranks make different numbers of calls
        for mode in ("gather-once", "resharded") if world == 2 else ():
            r = report[f"fsdp2-{mode}-adamw-3-steps"]
            assert r["err"] <= 1e-10 and r["layout"] == "context-parallel", (mode, r)


@pytest.mark.slow
def test_the_forest_runs_one_prefix_across_the_ranks_and_the_other_trees_whole(reports):
    world, ranks = reports
    for report in ranks:
        assert report["forest"]["context_parallel"] == [0]  # only the tree larger than a rank's share
    assert sum(report["forest"]["rollouts"] for report in ranks) == 4 + 2 + 2 + 3  # every rollout once


@pytest.mark.slow
def test_a_rank_without_branches_still_runs_its_pieces(reports):
    world, ranks = reports
    assert sorted(report["one-rollout"]["rollouts"] for report in ranks) == [0] * (world - 1) + [1]
    assert all(min(report["one-rollout"]["physical"]) > 0 for report in ranks)  # every rank computes pieces


@pytest.mark.slow
def test_the_control_without_the_gradient_reduce_fails(reports):
    world, ranks = reports
    for report in ranks:
        assert report["control-no-reduce"]["err"] > 1e-3, report["control-no-reduce"]


# -- the plan (no processes) --------------------------------------------------------------------------------------

def test_the_headline_plan_on_8_ranks_is_within_1_25x_of_the_ideal():
    """P=32,000, G=64, R=768 on the bench's tiny Llama: today's split ran 38,144 positions per rank (3.8x the
    ideal, the prompt on every rank); the context-parallel prefix gives every rank about unique / 8."""
    from transformers import LlamaConfig

    from branchreplay.bench.runner import BENCH_MODEL

    config = LlamaConfig(**BENCH_MODEL)
    g = torch.Generator().manual_seed(0)
    tree = RolloutTree(make_rollouts(shared_prompt(32000, 64, 768, config.vocab_size, g), g))
    ideal = tree.stats.physical_tokens / 8
    plan = shard([tree], 8, config)
    assert plan.layout == "context-parallel" and plan.context_parallel == [0]
    assert max(plan.physical_tokens) <= 1.25 * ideal, (plan.physical_tokens, ideal)
    split = shard([tree], 8, config, layout="whole-or-split")
    assert split.layout == "split branches" and max(split.physical_tokens) > 3.7 * ideal
    assert plan.predicted_step_seconds < split.predicted_step_seconds
    kv = 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 KV heads of 64, float32: bytes per position
    assert plan.bytes_moved[0] == pytest.approx(2 * 7 * 32000 / 8 * kv, rel=0.01)  # forward and backward
    for rank, parts in enumerate(plan.parts):
        assert [p.rank for p in parts] == [rank] and len(parts[0].rollouts) == 8


def test_a_prefix_too_short_for_the_ranks_falls_back_to_whole_trees():
    """A 1-token shared node, or more ranks than prefix positions: no error, the old layouts."""
    config = tiny_model("llama").config
    g = torch.Generator().manual_seed(0)
    short = RolloutTree(make_rollouts(shared_prompt(1, 4, 6, 256, g), g))
    assert shared_prefix_length(short) == 1
    plan = shard([short], 2, config, cost=FREE_COMMUNICATION)
    assert plan.layout == "split branches" and "at least 2 positions" in plan.why
    three = RolloutTree(make_rollouts(shared_prompt(3, 8, 4, 256, g), g))
    assert shard([three], 4, config, cost=FREE_COMMUNICATION).layout == "split branches"
    assert shard([three], 3, config, cost=FREE_COMMUNICATION).layout == "context-parallel"
    with pytest.raises(ValueError, match="no tree can run context-parallel"):
        shard([short], 2, config, layout="context-parallel")


@pytest.mark.parametrize("arch, reason", [("lfm2", "recurrent layers"), ("mistral", "sliding-window layers")])
def test_families_that_carry_state_or_windows_keep_the_split_by_name(arch, reason):
    config = tiny_model(arch).config
    g = torch.Generator().manual_seed(0)
    tree = RolloutTree(make_rollouts(shared_prompt(40, 4, 6, 256, g), g))
    plan = shard([tree], 2, config, cost=FREE_COMMUNICATION)
    assert plan.layout == "split branches" and reason in plan.why, plan.why


def test_a_trained_prefix_position_is_refused_by_name():
    from branchreplay.engine.parallel.context_parallel import ContextParallelTree, zigzag_rounds

    g = torch.Generator().manual_seed(0)
    tree = RolloutTree(make_rollouts(shared_prompt(8, 2, 3, 256, g), g))
    with pytest.raises(ValueError, match="trains a position of the context-parallel prefix"):
        ContextParallelTree(tree.rollouts[0].token_ids[:10], tree, zigzag_rounds(10, 2), 0)
    assert zigzag_rounds(10, 2) == [[(0, 2, 0), (2, 5, 1)], [(5, 8, 1), (8, 10, 0)]]
    assert zigzag_rounds(3, 2) == [[(0, 2, 0), (2, 3, 1)]]


# -- the trainer under torchrun's environment ---------------------------------------------------------------------

def _train_config(tmp_path, run: str, layout: str = "auto"):
    from test_rl_run_trainer import make_config

    return make_config(tmp_path, grpo={"prompts_per_step": 1}, train={"steps": 2, "output_dir": str(tmp_path / run)},
                       parallel={"layout": layout, "timeout_s": 120, "fsdp_mode": "resharded"})


def _train_worker(rank: int, world: int, tmp: str) -> None:
    from pathlib import Path

    from test_rl_run_trainer import make_trainer

    make_trainer(_train_config(Path(tmp), "two", "context-parallel"), dtype=torch.float64).fit()


@pytest.mark.slow
def test_two_ranks_train_one_group_with_its_prompt_across_them_as_one_process(tmp_path):
    """`--parallel.layout context-parallel --parallel.fsdp_mode resharded`, one prompt group per step on 2 ranks: each
    rank runs half of the prompt and half of the group, FSDP2 gathering each layer per pack; every step's reward,
    loss and grad norm equal the single-process run's."""
    from test_rl_run_trainer import make_trainer

    single = make_trainer(_train_config(tmp_path, "single"), dtype=torch.float64).fit()
    spawn_ranks(_train_worker, 2, str(tmp_path), group=False)
    records = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
               for run in (single, tmp_path / "two")]
    assert len(records[1]) == 2 and all(r["dist/layout"] == "context-parallel" for r in records[1])
    assert all(r["dist/bytes_moved"] > 0 and r["dist/fsdp_mode"] == "resharded" for r in records[1])
    for theirs, ours in zip(*records, strict=True):
        for key in ("reward", "loss", "grad_norm", "tree/physical_tokens"):
            assert abs(ours[key] - theirs[key]) <= 1e-9 * max(1.0, abs(theirs[key])), (key, ours, theirs)
