"""Every algorithm and feature under data parallelism, on 2 gloo processes started once for the module.

1. The first update's gradient (`rl.run.step.first_update_gradient`, the trainer's own: the algorithm's part, its
   passes gathered over the ranks, its engine calls on each rank's trees) of GRPO (and GSPO), RLOO, REINFORCE++, PPO
   (the critic sharded like the policy) and DPO (pairs sharded by tree cost) equals the same part's in one process,
   float64, within 1e-10, under FSDP2 gathered once, FSDP2 resharded (the ranks' packs in lock-step) and DDP.
2. Two training steps of the trainer on 2 ranks log the same metrics as one process (loss, gradient norm, the
   algorithm's own, within 1e-9 relative) for: GSPO, top_entropy_quantile (resharded), RLOO (resharded), REINFORCE++,
   PPO (resharded), DPO, multi-turn agents (items sampled per rank), LoRA (adapters replicated: DDP) and the vLLM
   backend (rank 0 talks to a stand-in server and every rank gets the batch).
"""

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import spawn_ranks

pytestmark = pytest.mark.slow  # 2 processes, every algorithm: `make test` runs it, `make test-fast` does not

GRADIENT_CASES = [("grpo", None), ("grpo-gspo", {"grpo": {"importance_sampling_level": "sequence", "beta": 0.05,
                                                         "num_iterations": 2}}),
                  ("rloo", None), ("reinforce_pp", {"grpo": {"beta": 0.05, "num_iterations": 2}}), ("ppo", None),
                  ("dpo", None)]
STRATEGIES = {"fsdp2": ("fsdp2", "gather-once"), "fsdp2-resharded": ("fsdp2", "resharded"), "ddp": ("ddp", None)}
LAYOUTS = {"split": ("whole-or-split", 1), "context-parallel": ("context-parallel", 3)}  # (layout, groups)

PPS = {"prompts_per_step": 3}  # 3 groups on 2 ranks: uneven
RUNS = {  # name: (algorithm, config sections, the metrics that must match)
    "gspo": ("grpo", {"grpo": {**PPS, "importance_sampling_level": "sequence", "num_iterations": 2, "beta": 0.05}},
             ["kl", "entropy", "clip_ratio/region_mean"]),
    "entropy-quantile": ("grpo", {"grpo": {**PPS, "top_entropy_quantile": 0.5, "num_iterations": 2},
                                  "parallel": {"fsdp_mode": "resharded"}}, ["entropy_mask/kept", "entropy"]),
    "rloo": ("rloo", {"grpo": {**PPS, "beta": 0.05, "num_generations": 4}, "parallel": {"fsdp_mode": "resharded"}},
             ["kl", "entropy", "clip_ratio/region_mean"]),
    "reinforce_pp": ("reinforce_pp", {"grpo": {**PPS, "beta": 0.05}}, ["kl", "entropy", "clip_ratio/region_mean"]),
    "ppo": ("ppo", {"grpo": PPS, "ppo": {"num_ppo_epochs": 2}, "parallel": {"fsdp_mode": "resharded"}},
            ["objective/kl", "policy/approxkl_avg", "loss/value_avg", "val/clipfrac_avg", "loss/policy_avg"]),
    "dpo": ("dpo", {"dpo": {"pairs_per_step": 3}}, ["rewards/margins", "rewards/accuracies", "logps/chosen"]),
    "lora": ("grpo", {"grpo": {**PPS, "beta": 0.05}, "model": {"lora_r": 4, "lora_target_modules": "q_proj,v_proj"}},
             ["kl", "entropy"]),
    "multi-turn": ("grpo", {}, ["turns/mean", "tool_calls/mean", "entropy"]),
    "vllm": ("grpo", {"grpo": {**PPS, "num_iterations": 2}}, ["sampling/logprob_diff_mean", "entropy"]),
}
COMMON = ["reward", "loss", "grad_norm", "tree/physical_tokens"]


def _config(tmp: Path, name: str, strategy: str, url: str | None = None):
    """The run `name` of `RUNS` in tmp/name-strategy, as `test_rl_run_trainer.make_config` (or the multi-turn one)."""
    from branchreplay.rl.config import Config

    algorithm, sections, _ = RUNS[name]
    if name == "multi-turn":
        from test_rl_agent import make_config
    else:
        from test_rl_run_trainer import make_config
    data = make_config(tmp, **sections).to_dict()
    data["algorithm"] = algorithm
    data["train"].update(steps=2, output_dir=str(tmp / f"{name}-{strategy}"), eval_steps=-1)
    data["parallel"].update(strategy=strategy, timeout_s=120)
    data["model"]["dtype"] = "float64"
    if name == "dpo":
        data["dpo"]["dataset"] = str(tmp / "prefs.jsonl")
    if name == "vllm":
        data["sampling"].update(backend="vllm", vllm_url=url)
    return Config.from_dict(data)


def _trainer(config, name: str):
    if name == "multi-turn":
        from test_rl_agent import make_trainer

        return make_trainer(config, dtype=torch.float64)
    from test_rl_run_trainer import make_trainer

    return make_trainer(config, dtype=torch.float64)


def _failed_sync(tmp: Path, rank: int, url: str) -> None:
    """A run whose vLLM server fails its second weight sync (after step 1): every rank must stop with the vLLM
    error (TrainingFailed) after writing the step-1 checkpoint together; rank{rank}-sync.txt says how it ended."""
    from branchreplay.rl.run.stops import TrainingFailed

    config = _config(tmp, "vllm", "auto", url)
    config.train.output_dir = str(tmp / "vllm-sync-fails")
    try:
        _trainer(config, "vllm").fit()
        outcome = "no error"
    except TrainingFailed as e:
        outcome = f"{type(e).__name__}: {e}"
    (tmp / f"rank{rank}-sync.txt").write_text(outcome)


def _one_rank_fails(tmp: Path, rank: int) -> None:
    """Failures on one rank that every rank must see at once: vLLM unreachable (rank 0 alone connects) and a
    multi-turn sampling error that is not an item's (out of memory on rank 1); rank{rank}-fails.txt says how each
    ended."""
    import branchreplay.rl.rollouts.sampler as sampler
    from branchreplay.rl.rollouts.vllm.client import VLLMError

    outcomes = []
    config = _config(tmp, "vllm", "auto", "http://127.0.0.1:9")
    try:
        _trainer(config, "vllm")
        outcomes.append("no error")
    except VLLMError as e:
        outcomes.append(f"{type(e).__name__}: {e}")
    original = sampler.sample_trajectories_turnwise
    if rank == 1:
        sampler.sample_trajectories_turnwise = lambda *args, **kwargs: (_ for _ in ()).throw(
            MemoryError("out of memory"))
    config = _config(tmp, "multi-turn", "auto")
    config.train.output_dir = str(tmp / "multi-turn-fails")
    try:
        _trainer(config, "multi-turn").fit()
        outcomes.append("no error")
    except Exception as e:  # noqa: BLE001
        outcomes.append(f"{type(e).__name__}: {e}")
    sampler.sample_trajectories_turnwise = original
    (tmp / f"rank{rank}-fails.txt").write_text("\n".join(outcomes))


def _worker(rank: int, world: int, tmp: str, url: str, failing_url: str) -> None:
    from branchreplay.check.parallel import algorithm_gradients
    from branchreplay.reference.float64 import keep_float64
    from branchreplay.tiny_models import tiny_model

    for name in RUNS:  # the first one initialises the process group (rl.run.parallel.launch)
        _trainer(_config(Path(tmp), name, "auto", url), name).fit()
    _failed_sync(Path(tmp), rank, failing_url)
    _one_rank_fails(Path(tmp), rank)
    errors = {}
    for strategy, (kind, mode) in STRATEGIES.items():
        for name, settings in GRADIENT_CASES:
            single, model = (tiny_model("llama", dtype=torch.float64, seed=0) for _ in range(2))
            with keep_float64(single), keep_float64(model):
                report = algorithm_gradients(single, model, name.split("-")[0], kind, mode=mode or "gather-once",
                                             settings=settings)
            errors[f"{name}/{strategy}"] = report["max_rel_grad_err"]
    for shape, (layout, groups) in LAYOUTS.items():  # one tree split over the ranks; prompts across them
        for name, settings in GRADIENT_CASES:
            single, model = (tiny_model("llama", dtype=torch.float64, seed=0) for _ in range(2))
            with keep_float64(single), keep_float64(model):
                report = algorithm_gradients(single, model, name.split("-")[0], "fsdp2", settings=settings,
                                             layout=layout, groups=groups)
            errors[f"{name}/{shape}"] = report["max_rel_grad_err"]
            errors[f"{name}/{shape}/layout"] = report["layout"]
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(errors))


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of `RUNS` in one process and on 2 ranks (one spawn), and every rank's gradient errors."""
    from test_engine_sequence import _preference_file
    from test_rl_rollouts_vllm import StandIn

    tmp = tmp_path_factory.mktemp("dp-algorithms")
    _preference_file(tmp)
    servers = [StandIn(), StandIn(), StandIn(fail_sync_on=2)]  # one per run: each loads the weights it syncs
    try:
        for name in RUNS:
            _trainer(_config(tmp, name, "auto", servers[0].url), name).fit()
            os.rename(tmp / f"{name}-auto", tmp / f"{name}-single")
        spawn_ranks(_worker, 2, str(tmp), servers[1].url, servers[2].url, group=False)
    finally:
        for s in servers:
            s.close()
    return tmp, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("strategy", [*STRATEGIES, *LAYOUTS])
@pytest.mark.parametrize("case", [name for name, _ in GRADIENT_CASES])
def test_two_ranks_give_the_single_process_gradient(runs, case, strategy):
    """Under each strategy (whole trees), and under FSDP2 with one tree split over the ranks (a DPO pair's chosen
    and rejected apart) and with the prompts run context-parallel."""
    for rank, errors in enumerate(runs[1]):
        err = errors[f"{case}/{strategy}"]
        assert err <= 1e-10, f"{case} under {strategy}, rank {rank}: max relative gradient error {err:.2e}"
        if strategy in LAYOUTS:
            assert errors[f"{case}/{strategy}/layout"] == {"split": "split branches"}.get(strategy, strategy)


@pytest.mark.parametrize("name", RUNS)
def test_two_ranks_log_what_one_process_logs(runs, name):
    tmp = runs[0]
    single, two = _records(tmp / f"{name}-single"), _records(tmp / f"{name}-auto")
    assert [r["step"] for r in two] == [r["step"] for r in single] == [1, 2]
    assert two[-1]["dist/world_size"] == 2
    for ours, theirs in zip(two, single, strict=True):
        for key in COMMON + RUNS[name][2]:
            if key == "reward" and name == "dpo":
                continue
            assert key in theirs and key in ours, (name, key)
            assert abs(ours[key] - theirs[key]) <= 1e-9 * max(1.0, abs(theirs[key])), (name, key, ours[key],
                                                                                        theirs[key])


def test_a_failed_weight_sync_stops_every_rank_with_a_checkpoint(runs):
    """The vLLM server fails the sync after step 1 under torchrun: every rank stops with the vLLM error after the
    step-1 checkpoint, written by both together (rank 0 alone used to raise it, the others left, and its save
    waited for them: RankDied and no checkpoint)."""
    tmp = runs[0]
    for rank in range(2):
        said = (tmp / f"rank{rank}-sync.txt").read_text()
        assert said.startswith("TrainingFailed: step 2: the vLLM sampler failed") and "--resume" in said, said
    assert (tmp / "vllm-sync-fails" / "checkpoints" / "latest").read_text().strip() == "step-000001"


def test_a_failure_on_one_rank_reaches_every_rank(runs):
    """vLLM unreachable (rank 0 alone connects) is a VLLMError on every rank at construction (the others waited in
    a broadcast); a sampling error that is not an item's on rank 1 (out of memory) is raised on both ranks (the
    other one used to report the rank dead)."""
    tmp = runs[0]
    for rank in range(2):
        connect, sampling = (tmp / f"rank{rank}-fails.txt").read_text().split("\n")
        assert connect.startswith("VLLMError: ") and "no vLLM server answers" in connect, connect
        assert "out of memory" in sampling and ("MemoryError" in sampling or "failed on rank 1" in sampling), sampling
