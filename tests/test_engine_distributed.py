"""Data parallelism on 2 CPU processes with gloo (`engine/parallel/distributed.py`, `engine/parallel/sharding.py`):
under FSDP2 and DDP semantics the reduced gradient of a step equals the single-process gradient of the same trees, for
whole groups, uneven groups, one group split over both ranks, and a recurrent family; parameters after 3 AdamW steps
too."""

import json
import os

import pytest
import torch

from branchreplay.engine import EngineConfig
from branchreplay.engine.parallel.distributed import free_port
from branchreplay.engine.parallel.sharding import shard
from branchreplay.models import autocast
from branchreplay.reference.shapes import make_rollouts, shared_prompt
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import RolloutTree
from helpers import RANK_TIMEOUT, spawn_ranks

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


STRATEGIES = ["fsdp2", "fsdp2-resharded", "ddp"]


def _strategy(name: str) -> dict:
    """DataParallel's strategy and FSDP2 mode of a test parameter: "fsdp2" gathers once per step,
    "fsdp2-resharded" per layer."""
    return {"strategy": "fsdp2", "mode": "resharded"} if name == "fsdp2-resharded" else {"strategy": name}


def _trees(case: str, vocab: int, seed: int = 0) -> list[RolloutTree]:
    g = torch.Generator().manual_seed(seed)
    sizes = {"four-groups": [(24, 3, 6)] * 4, "one-group-split": [(40, 6, 8)],
             "uneven-groups": [(60, 4, 10), (10, 2, 4), (20, 3, 5)], "recurrent": [(16, 3, 5)] * 2}[case]
    return [RolloutTree(make_rollouts(shared_prompt(P, G, R, vocab, g), g)) for P, G, R in sizes]


CASES = [("llama", "four-groups", torch.float64), ("llama", "one-group-split", torch.float64),
         ("llama", "uneven-groups", torch.float32), ("lfm2", "recurrent", torch.float64)]


def _worker(rank: int, world: int, out: str) -> None:
    from branchreplay.engine import replay_backward
    from branchreplay.engine.parallel.distributed import DataParallel
    from branchreplay.engine.replay import replay_backward_sharded
    from branchreplay.losses import GRPOLoss
    from branchreplay.reference.float64 import keep_float64
    from branchreplay.reference.naive import max_rel_grad_err

    reports = {}
    for strategy in STRATEGIES:  # one spawn for the three: the processes' start-up is most of a run
        report = reports[strategy] = {}
        for arch, case, dtype in CASES:
            single, model = tiny_model(arch, dtype=dtype, seed=0), tiny_model(arch, dtype=dtype, seed=0)
            trees = _trees(case, single.config.vocab_size)
            loss = GRPOLoss(entropy_coef=0.01)
            with keep_float64(single), keep_float64(model):
                replay_backward(single, trees, loss)
                expected = [p.grad.clone() for p in single.parameters()]
                dp = DataParallel(model, **_strategy(strategy))
                _, plan = replay_backward_sharded(dp, trees, loss)
                report[case] = {"err": max_rel_grad_err(dp.full_grads(), expected), "tol": TOL[dtype],
                                "physical": plan.physical_tokens, "recomputed": plan.recomputed_positions}
        # bfloat16 mixed precision (float32 parameters under autocast, models.autocast): whole groups per rank run
        # the same bfloat16 ops as in one process, so only the float32 sums of the ranks' gradients differ (each
        # group its own tree on both sides: a forest of a rank's groups packs them otherwise than one of all four)
        single, model = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
        trees = _trees("four-groups", single.config.vocab_size)
        loss, per_group = GRPOLoss(entropy_coef=0.01), EngineConfig(forest=False)
        with autocast("bfloat16", "cpu"):
            replay_backward(single, trees, loss, engine=per_group)
            expected = [p.grad.clone() for p in single.parameters()]
            dp = DataParallel(model, **_strategy(strategy))
            replay_backward_sharded(dp, trees, loss, engine=per_group)
        full = dp.full_grads()
        report["four-groups-bfloat16-autocast"] = {"err": max_rel_grad_err(full, expected), "tol": 1e-5,
                                                   "dtype": str(full[0].dtype)}
        # three AdamW steps on 4 groups, against the same steps in one process
        single, model = (tiny_model("llama", dtype=torch.float64, seed=0) for _ in range(2))
        dp = DataParallel(model, **_strategy(strategy))
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (single, model)]
        loss = GRPOLoss()
        with keep_float64(single), keep_float64(model):
            for step in range(3):
                trees = _trees("four-groups", 256, seed=step)
                for opt in opts:
                    opt.zero_grad(set_to_none=True)
                replay_backward(single, trees, loss)
                replay_backward_sharded(dp, trees, loss)
                for opt in opts:
                    opt.step()
        params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
        report["adamw-3-steps"] = {"err": max_rel_grad_err(params, [p.detach() for p in single.parameters()]),
                                   "tol": 1e-10}
    # rank 1 passes other trees than rank 0's: every rank refuses, naming rank 1, before any gradient
    dp = DataParallel(tiny_model("llama", dtype=torch.float64, seed=0), **_strategy("ddp"))
    try:
        replay_backward_sharded(dp, _trees("four-groups", 256, seed=rank), GRPOLoss())
        reports["other-trees-on-rank-1"] = None
    except ValueError as e:
        reports["other-trees-on-rank-1"] = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(reports, f)


def _two_ranks(worker, out) -> list[dict]:
    """`worker(rank, world, out)` on 2 gloo processes; each rank's JSON report (out/rank{r}.json)."""
    spawn_ranks(worker, 2, str(out))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def sharded_reports(tmp_path_factory):
    """Every rank's reports of one run of `_worker` (every strategy) on 2 processes."""
    return _two_ranks(_worker, tmp_path_factory.mktemp("sharded"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_step_equals_single_process(strategy, sharded_reports):
    for rank in range(2):
        report = sharded_reports[rank][strategy]
        assert set(report) == {case for _, case, _ in CASES} | {"adamw-3-steps", "four-groups-bfloat16-autocast"}
        assert report["four-groups-bfloat16-autocast"]["dtype"] == "torch.float32"  # float32 master gradients
        for case, r in report.items():
            assert r["err"] <= r["tol"], f"{strategy} rank {rank} {case}: max relative error {r['err']:.2e}"
        assert report["one-group-split"]["recomputed"] > 0  # both ranks ran the shared prompt


@pytest.mark.slow
def test_ranks_that_pass_other_trees_are_refused_naming_the_rank(sharded_reports):
    """The documented requirement, the same trees on every rank, is checked: each rank would otherwise run its share
    of another plan (a far-off gradient without an error)."""
    for rank in range(2):
        said = sharded_reports[rank]["other-trees-on-rank-1"]
        assert said is not None and "the trees of rank 1 differ from rank 0's" in said, said


def test_plan_keeps_groups_whole_and_balances_largest_first():
    config = tiny_model("llama").config
    trees = _trees("uneven-groups", 256)
    plan = shard(trees, 2, config)
    assert sorted(sum(plan.sources, [])) == [0, 1, 2] and plan.recomputed_positions == 0
    assert plan.sources[0] == [0] and sorted(plan.sources[1]) == [1, 2]  # the largest alone, the two small together
    split = shard(_trees("one-group-split", 256), 2, config)
    assert [len(p) for p in split.parts] == [1, 1] and split.recomputed_positions == 40  # the prompt, once more
    assert sum(len(t.rollouts) for p in split.parts for t in p) == 6
    with pytest.raises(ValueError, match="rollouts for 8 ranks"):  # a family whose prefix cannot be shared
        shard(_trees("recurrent", 256)[:1], 8, tiny_model("lfm2").config)
    assert shard(_trees("recurrent", 256)[:1], 8, config).layout == "context-parallel"  # every rank: its pieces


# -- the trainer under torchrun's environment ---------------------------------------------------------------------

def _train_config(tmp_path, steps: int, strategy: str = "auto", run: str = "run"):
    from test_rl_run_trainer import make_config

    return make_config(tmp_path, grpo={"prompts_per_step": 3}, parallel={"strategy": strategy, "timeout_s": 120},
                       train={"steps": steps, "output_dir": str(tmp_path / run), "save_steps": 2})


def _train_worker(rank: int, world: int, tmp: str, steps: int, strategy: str, run: str, resume: bool) -> None:
    from pathlib import Path

    from test_rl_run_trainer import make_trainer

    trainer = make_trainer(_train_config(Path(tmp), steps, strategy, run), dtype=torch.float64)
    trainer.fit(resume=Path(tmp) / run if resume else None)
    metrics = trainer.evaluate()  # sharded: each rank decodes half of the held-out items
    if rank == 0:
        (Path(tmp) / f"{run}-eval.json").write_text(json.dumps(metrics))


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_two_ranks_train_as_one_process_and_resume_on_any_world_size(strategy, tmp_path):
    """3 groups on 2 ranks (uneven: one rank runs two): every step's reward, loss and grad norm equal the
    single-process run's; a checkpoint written at step 2 by 2 ranks (its optimizer state sharded by DCP) resumes on
    1 and on 2 processes, and the single-process run's on 2, to the same step-3 metrics as the uninterrupted run."""
    from test_rl_run_trainer import make_trainer

    single_trainer = make_trainer(_train_config(tmp_path, 3, run="single"), dtype=torch.float64)
    single = single_trainer.fit()
    expected = _records(single)
    spawn_ranks(_train_worker, 2, str(tmp_path), 2, strategy, "two", False, group=False)
    two = _records(tmp_path / "two")
    assert two[-1]["dist/world_size"] == 2 and len(two) == 2
    for ours, theirs in zip(two, expected[: len(two)], strict=True):  # its first 2 of 3 steps
        for key in ("reward", "loss", "grad_norm", "tree/physical_tokens"):
            assert abs(ours[key] - theirs[key]) <= 1e-9 * max(1.0, abs(theirs[key])), (key, ours, theirs)
    import shutil

    optimizer = tmp_path / "two" / "checkpoints" / "step-000002" / "optimizer"  # DCP: sharded by the ranks
    assert (optimizer / ".metadata").is_file()
    assert {p.name for p in optimizer.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}  # each rank writes
    shutil.copytree(tmp_path / "two", tmp_path / "again")
    shutil.copytree(single, tmp_path / "from-one")  # the single-process run's step-2 checkpoint, resumed on 2
    shutil.rmtree(tmp_path / "from-one" / "checkpoints" / "step-000003")
    (tmp_path / "from-one" / "checkpoints" / "latest").write_text("step-000002")
    make_trainer(_train_config(tmp_path, 3, run="two"), dtype=torch.float64).fit(resume=tmp_path / "two")  # on 1
    spawn_ranks(_train_worker, 2, str(tmp_path), 3, strategy, "again", True, group=False)
    spawn_ranks(_train_worker, 2, str(tmp_path), 3, strategy, "from-one", True, group=False)
    held_out = json.loads((tmp_path / "again-eval.json").read_text())
    for key in ("eval/accuracy", "eval/frac_correct", "eval/mean_length"):
        assert held_out[key] == single_trainer.evaluate()[key], key  # the sharded eval of the same weights
    for run in ("two", "again", "from-one"):  # 2 -> 1, 2 -> 2, 1 -> 2
        last = _records(tmp_path / run)[-1]
        assert last["step"] == 3
        for key in ("reward", "loss", "grad_norm"):
            assert abs(last[key] - expected[-1][key]) <= 1e-9 * max(1.0, abs(expected[-1][key])), (run, key)


def _config_worker(rank: int, world: int, tmp: str) -> None:
    from branchreplay.rl.run.parallel import launch

    try:
        launch("auto", {"train": {"seed": rank}})  # rank 1 was started with another seed
    except ValueError as e:  # on every rank alike: both may close the group
        with open(os.path.join(tmp, f"rank{rank}.txt"), "w") as f:
            f.write(str(e))  # then ended as a rank that succeeded: the expected error caught


@pytest.mark.slow
def test_bad_launches_are_refused_by_name(tmp_path, monkeypatch):
    """--parallel.strategy fsdp2 without torchrun, and ranks started with different configurations."""
    from branchreplay.rl.run.parallel import launch

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launch("auto", {}) is None
    with pytest.raises(ValueError, match="parallel.strategy='fsdp2' needs torchrun"):
        launch("fsdp2", {})
    spawn_ranks(_config_worker, 2, str(tmp_path), group=False)
    for rank in range(2):
        assert "ranks [1] were started with a configuration different" in (tmp_path / f"rank{rank}.txt").read_text()


@pytest.mark.slow
def test_cli_verify_on_two_processes(capsys):
    """`branchreplay verify --nproc 2 --parallel fsdp2 --arch llama --json`: one JSON object, passed, exit 0."""
    from branchreplay.cli import main

    assert main(["verify", "--nproc", "2", "--parallel", "fsdp2", "--arch", "llama", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True and out["world_size"] == 2 and out["max_rel_grad_err"] <= 1e-6
    assert out["recomputed_positions"] > 0  # the second step split one tree over both ranks


@pytest.mark.slow
def test_cli_bench_on_two_processes(capsys):
    """`branchreplay bench --nproc 2`: naive data parallelism, prompt sharing and branchreplay on 2 processes, with
    the plans."""
    from branchreplay.cli import main

    assert main(["bench", "--nproc", "2", "--prompt-tokens", "64", "--generations", "8", "--response-tokens", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 2 and [r["method"] for r in out["rows"]] == ["naive", "prompt-sharing", "branchreplay"]
    assert not any(r["estimated"] for r in out["rows"])  # small enough to run in full
    assert all(r["seconds"] > 0 and len(r["per_rank_seconds"]) == 2 for r in out["rows"])
    assert set(out["plan"]) == {"2", "8"} and len(out["plan"]["8"]["physical_tokens"]) == 8
    assert out["plan"]["2"]["recomputed_positions"] == 64  # one tree, split: the prompt once more


def _neox_worker(rank: int, world: int, tmp: str) -> None:
    from pathlib import Path

    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from test_rl_run_trainer import EOS, make_trainer

    cfg = GPTNeoXConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(cfg)
    model.generation_config.eos_token_id = EOS
    make_trainer(_train_config(Path(tmp), 1, "fsdp2", "neox"), model=model).fit()


@pytest.mark.slow
def test_an_unregistered_family_is_self_checked_before_sharding(tmp_path):
    """GPT-NeoX under torchrun: every rank runs the self-check before fully_shard, rank 0 keeps the verdict, and the
    run trains it trusted."""
    spawn_ranks(_neox_worker, 2, str(tmp_path), group=False)
    (verdict,) = json.loads((tmp_path / "neox" / "self_check.json").read_text()).values()
    assert verdict["passed"] and verdict["model_class"] == "GPTNeoXForCausalLM"
    assert _records(tmp_path / "neox")[-1]["dist/world_size"] == 2


def _idle_worker(rank: int, world: int, out: str) -> None:
    from branchreplay.engine import replay_backward
    from branchreplay.engine.head import check_head
    from branchreplay.engine.parallel.distributed import DataParallel
    from branchreplay.losses import GRPOLoss
    from branchreplay.reference.naive import max_rel_grad_err
    from branchreplay.rl.policy import Policy, idle_tree

    single = tiny_model("llama", dtype=torch.float64, seed=0)
    tree = _trees("four-groups", 256)[0]
    loss = GRPOLoss(beta=0.04)  # the idle tree carries reference logprobs too
    for r in tree.rollouts:
        r.ref_logprobs = torch.zeros(len(r), dtype=torch.float64)
    replay_backward(single, tree, loss)
    errs = {}
    for strategy in STRATEGIES:  # one spawn for the three
        model = tiny_model("llama", dtype=torch.float64, seed=0)
        if rank == 0:  # the engine's head check cached on rank 0 only, as after the trainer's self-check there
            check_head(model)
        dp = DataParallel(model, **_strategy(strategy))
        idle = [] if dp.lockstep else [idle_tree()]  # in lock-step a rank with zero packs runs dummies only
        with dp.accumulate():  # rank 0 trains the tree, rank 1 has nothing this step
            Policy(model, dp=dp).accumulate([tree] if rank == 0 else idle, loss, final_backward=dp.final_sync())
        dp.reduce_replicated()
        errs[strategy] = max_rel_grad_err(dp.full_grads(), [p.grad for p in single.parameters()])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(errs, f)


@pytest.fixture(scope="module")
def idle_errors(tmp_path_factory):
    """Every rank's gradient errors, by strategy, of one run of `_idle_worker` on 2 processes."""
    return _two_ranks(_idle_worker, tmp_path_factory.mktemp("idle"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_idle_rank_joins_the_reduction_with_zeros(strategy, idle_errors):
    """A rank without trained rollouts in a step (fewer than ranks) runs the trainer's zero-weight idle tree, or in
    FSDP2's resharded mode no tree at all (zero packs: the lock-step's dummies): the reductions still happen on every
    rank and the gradient is the other rank's alone. The engine's head check has run on rank 0 only (the trainer's
    self-check): its forwards must not gather layers on rank 1 alone."""
    for rank in range(2):
        err = idle_errors[rank][strategy]
        assert err <= 1e-10, f"{strategy} rank {rank}: {err:.2e}"


def _memory_worker(rank: int, world: int, out: str) -> None:
    from branchreplay.bench.fsdp_memory import HeldBytes
    from branchreplay.engine.parallel.distributed import DataParallel, fsdp_mode
    from branchreplay.engine.replay import replay_backward_sharded
    from branchreplay.losses import GRPOLoss

    # "auto" on ranks of different memory: rank 0's would hold the model 10 times over, rank 1's not: both resharded
    need = 2 * sum(p.numel() * p.element_size() for p in tiny_model("llama", seed=0).parameters())
    report = {"auto": fsdp_mode(tiny_model("llama", seed=0), "auto", memory_bytes=need * (40 if rank == 0 else 2))}
    for mode in ("gather-once", "resharded"):
        model = tiny_model("llama", seed=0, num_hidden_layers=6)
        dp = DataParallel(model, "fsdp2", mode=mode)
        with HeldBytes(dp) as held:
            replay_backward_sharded(dp, _trees("uneven-groups", 256), GRPOLoss())
        report[mode] = held.peak
    single = tiny_model("llama", seed=0, num_hidden_layers=6)
    layers = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in single.model.layers]
    report["layer_bytes"], report["model_bytes"] = layers[0], sum(p.numel() * 4 for p in single.parameters())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


@pytest.mark.slow
def test_resharded_fsdp2_holds_a_layer_at_a_time_and_gather_once_the_whole_model(tmp_path):
    """Peak parameter + gradient bytes per rank during a step of uneven groups (the ranks run different numbers of
    packs), 6 layers on 2 ranks: gather-once holds every layer's full parameters and gradients; resharded holds
    its shards and gradient shards, the replicated parameters, and at most three layers in full (the running one,
    the prefetched one, the gradient of one)."""
    spawn_ranks(_memory_worker, 2, str(tmp_path))
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        layer, model = r["layer_bytes"], r["model_bytes"]
        replicated = model - 6 * layer
        assert r["gather-once"] >= 2 * 6 * layer + replicated, r
        assert r["resharded"] <= 2 * 6 * layer / 2 + 2 * replicated + 3 * layer, r
        assert r["auto"] == "resharded", r  # the smallest rank's memory decides, for every rank


def test_fsdp2_of_experts_needs_unused_parameter_reduction(monkeypatch):
    """torch 2.11's FSDP2 has no `set_reduce_scatter_unused_params` (seen on the GPU machine): a dense model shards
    without it, a mixture-of-experts model (an expert no token of a rank reached) is refused by name."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from branchreplay.engine.parallel.distributed import DataParallel

    monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=RANK_TIMEOUT)
    try:
        DataParallel(tiny_model("llama"), "fsdp2")
        with pytest.raises(RuntimeError, match="mixture-of-experts.*upgrade torch, or use --parallel.strategy ddp"):
            DataParallel(tiny_model("qwen3_moe"), "fsdp2")
    finally:
        dist.destroy_process_group()
