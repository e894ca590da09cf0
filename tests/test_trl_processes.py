"""The TRL drop-ins on 2 processes, launched as a TRL user launches them: torchrun with `use_cpu=True` (accelerate's
MULTI_CPU state: DDP over gloo), accelerate's FSDP2 with `reshard_after_forward` true and false, and DeepSpeed
ZeRO-1, ZeRO-2 and ZeRO-3 (`DS_ACCELERATOR=cpu`; accelerate's FSDP2 and DeepSpeed states are built on the gloo
processes by tests/trl_ranks.py's shim). TRL's own class under the same launch is the reference: from one seed both
train 2 steps and must log the same metrics (TRL's are reduced over the processes), and the first step's gradient,
as the optimizer receives it, must agree within 1e-4 relative (float32); under DDP, GRPO's also in float64 with
the ranks' mean of the naive per-rollout gradients (each rollout alone, unpadded). The control hands the tree's
gradient to no reduction (`branchreplay.trl.processes`) and must fail (GRPO's launches). GRPO's 6 rows per process
with 4 generations split a group over both ranks; RLOO's 4 are whole groups, with 2 micro-batches per step.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from branchreplay.engine.parallel.distributed import free_port
from branchreplay.reference.naive import max_rel_grad_err
from branchreplay.tiny_models import tiny_model

pytest.importorskip("trl", reason="TRL is the trl extra (pip install -e '.[trl]')")

from helpers import float32_close  # noqa: E402
from test_trl_grpo import folder  # noqa: E402, F401 (fixture)

RANKS = Path(__file__).with_name("trl_ranks.py")
SIDES = ["trl", "tree", "unreduced"]
JOBS = [  # one launch trains the three trainers under one wrapper; GRPO's has the control too
    {"name": "grpo", "trainer": "grpo", "config": {"beta": 0.04}, "sides": SIDES},
    {"name": "rloo", "trainer": "rloo", "sides": SIDES[:2],
     "config": {"beta": 0.05, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}},
    {"name": "dpo", "trainer": "dpo", "config": {}, "sides": SIDES[:2]},
]
SPLIT = {"name": "grpo-context-parallel", "trainer": "grpo", "config": {"beta": 0.04}, "sides": SIDES[:2],
         "split_groups": "context-parallel"}  # the group on both ranks: its prompt once across them
ZERO3_JOBS = [  # as TRL's own distributed tests launch them (tests/distributed/test_distributed.py)
    # one micro-batch per step: RLOO's logprob forward through DeepSpeed's hooks, just before the tree's, leaves
    # ZeRO-3's parameter trace recording (the tree's forward must not fire the engine's hook on the root)
    {"name": "rloo-one-micro-batch", "trainer": "rloo", "sides": SIDES[:2], "config": {"beta": 0.05}},
    # TRL precomputes the reference logprobs through a second DeepSpeed engine on the policy, whose hooks stay
    {"name": "dpo-precomputed", "trainer": "dpo", "sides": SIDES[:2], "config": {"precompute_ref_log_probs": True}},
]


def zero(stage: int) -> dict:
    """DeepSpeed ZeRO at `stage`, its batch settings from the trainer's (transformers' "auto")."""
    auto = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping")
    return {"deepspeed": {"zero_optimization": {"stage": stage}, **dict.fromkeys(auto, "auto")}}


LAUNCHES = {
    "ddp": {},
    "fsdp2-resharded": {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True}},
    "fsdp2-kept": {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": False}},
    "zero1": zero(1),  # GRPO alone: ZeRO-1 and ZeRO-2 take one path here (zero.linear_surrogate)
    "zero2": zero(2),
    "zero3": zero(3),
}
SKIP = ("step_time", "epoch", "learning_rate", "tree/logical_tokens", "tree/physical_tokens", "tree/token_ratio")


def rounding_scale(trainer: str, key: str, step: dict) -> float:
    """The size of the terms a metric sums, where they cancel: on-policy RLOO's loss is about 0 (zero-mean
    advantages); DPO's rewards are beta (0.1) times differences of summed logprobs (`float32_close`)."""
    if trainer == "rloo" and key == "loss":
        return 0.1
    if trainer == "dpo" and key.startswith("rewards/") and key != "rewards/accuracies":
        return 0.1 * max(abs(step["logps/chosen"]), abs(step["logps/rejected"]))
    return 0.0


def signs_of_rounding(trainer: str, key: str, step: dict) -> bool:
    """DPO's reward accuracy where every margin is 0 in exact arithmetic (the policy is still the reference, as at
    the first step with precomputed reference logprobs): the signs of rounding, which padding changes."""
    if trainer != "dpo" or key != "rewards/accuracies":
        return False
    return float32_close(step["rewards/margins"], 0.0, rounding_scale(trainer, "rewards/margins", step))


def launch(folder, tmp_path, jobs: list[dict], wrapper: dict | None = None) -> dict:  # noqa: F811
    """tests/trl_ranks.py on 2 processes under torchrun, each job's config on top of `wrapper`; rank 0's report."""
    out = tmp_path / "report.pt"
    jobs = [{**job, "config": {**(wrapper or {}), **job["config"]}} for job in jobs]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(RANKS), str(folder), str(out), json.dumps(jobs)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(RANKS.parent), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


def jobs_of(wrapper: str) -> list[dict]:
    """The jobs one launch under `wrapper` trains: ZeRO-1 GRPO alone (the same hand-over as ZeRO-2); ZeRO-3 TRL's own
    distributed tests' cases too; DDP and ZeRO-3 the prompt across ranks; DDP GRPO in float64 beside the naive
    per-rollout gradient."""
    if wrapper == "zero1":
        return JOBS[:1]
    if wrapper == "zero3":
        return JOBS + ZERO3_JOBS + [SPLIT]
    if wrapper == "ddp":
        return [{**JOBS[0], "sides": SIDES + ["float64"]}] + JOBS[1:] + [{**SPLIT, "sides": SIDES[:2] + ["float64"]}]
    return JOBS


@pytest.fixture(scope="module")
def reports(folder, tmp_path_factory):  # noqa: F811
    """{wrapper: its launch's report}, each launched at its first test (the cases run launch by launch)."""
    done = {}

    def report(wrapper: str) -> dict:
        if wrapper not in done:
            if "deepspeed" in LAUNCHES[wrapper]:
                pytest.importorskip("deepspeed", reason="DeepSpeed is in the dev extra (pip install -e '.[dev]')")
            done[wrapper] = launch(folder, tmp_path_factory.mktemp(wrapper), jobs_of(wrapper), LAUNCHES[wrapper])
        return done[wrapper]

    return report


@pytest.mark.slow
@pytest.mark.parametrize("wrapper, job", [(w, job) for w in LAUNCHES for job in jobs_of(w)],
                         ids=lambda x: x if isinstance(x, str) else x["name"])
def test_two_processes_train_as_trls_class_under_the_same_launch(reports, wrapper, job):
    """The tree's 2 logged steps equal TRL's (every metric TRL logs, within float32 rounding of the metric or of the
    terms it sums, at least 1e-2: `float32_close`); the first step's gradient
    within 1e-4 relative; the control (no reduction) fails both; each rank's tree shared prefixes."""
    launched = reports(wrapper)
    name, trainer = job["name"], job["trainer"]
    theirs, ours, control = (launched[name].get(side) for side in SIDES)
    assert len(theirs["logs"]) == len(ours["logs"]) == 2
    for step_theirs, step_ours in zip(theirs["logs"], ours["logs"], strict=True):
        for key, value in step_theirs.items():
            if key not in SKIP and not signs_of_rounding(trainer, key, step_theirs):
                scale = max(rounding_scale(trainer, key, step_theirs), 1e-2)
                assert float32_close(step_ours[key], value, scale), (key, step_ours[key], value)
    assert max_rel_grad_err(ours["grads"], theirs["grads"]) < 1e-4
    if control is not None:  # the control fails
        unreduced = [torch.zeros_like(t) if c is None else c for c, t in zip(control["grads"], theirs["grads"],
                                                                             strict=True)]
        assert max_rel_grad_err(unreduced, theirs["grads"]) > 1e-2
        assert control["logs"][0]["grad_norm"] != pytest.approx(theirs["logs"][0]["grad_norm"], rel=1e-3)
    for rank_ratios in ours["ratios"]:
        assert all(ratio > 1.0 for ratio in rank_ratios), ours["ratios"]
    if job.get("split_groups") == "context-parallel":  # each rank computes less than with the prompt recomputed
        recomputed = launched["grpo"]["tree"]["ratios"]  # (auto's choice for this tiny model: the cost model's)
        assert all(cp > whole for cps, wholes in zip(ours["ratios"], recomputed, strict=True) for cp,
                   whole in zip(cps, wholes, strict=True))
    if "float64" in launched[name]:  # the ranks' mean of the naive per-rollout gradients, float64
        exact = launched[name]["float64"]
        assert max_rel_grad_err(exact["grads"], exact["naive"]) < 1e-10


@pytest.mark.slow
def test_processes_that_would_train_apart_are_refused(folder, tmp_path):  # noqa: F811
    """torchrun's 2 processes without use_cpu=True on a machine without an accelerator: transformers gives each a
    one-process state (TRL's class then trains two copies); the tree's refuses when built, naming the setting."""
    if torch.cuda.is_available():
        pytest.skip("with an accelerator the processes train together")
    job = {"name": "apart", "trainer": "grpo", "sides": ["tree"],
           "config": {"use_cpu": False, "per_device_train_batch_size": 4}}
    refused = launch(folder, tmp_path, [job])["apart"]["refused"]
    assert "WORLD_SIZE=2" in refused and "GRPOConfig(use_cpu=True)" in refused


def _accelerator(kind: str, fsdp_version: int | None = None, zero_stage: int | None = None,
                 checkpointing: bool = False):
    """accelerate's state as launch_refusals reads it (FSDP1 cannot even be built on this CPU: its plugin refuses
    sync_module_states on cpu)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    return SimpleNamespace(distributed_type=DistributedType(kind), num_processes=2, state=SimpleNamespace(
        fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version, activation_checkpointing=checkpointing),
        deepspeed_plugin=SimpleNamespace(
            zero_stage=zero_stage)))


REFUSALS = [  # (launch, model, what the refusal names; None: runs)
    (("FSDP", 1, None), "llama", "fsdp_version: 2"),
    (("FSDP", 2, None), "llama", None),
    (("FSDP", 2, None, True), "llama", "activation_checkpointing wraps the decoder layers"),
    (("FSDP", 2, None), "gemma3-vision", "vision tower; use DDP or DeepSpeed ZeRO-1/2"),
    (("DEEPSPEED", None, 2), "gemma3-vision", None),
    (("DEEPSPEED", None, 3), "gemma3-vision", "vision tower"),
    (("DEEPSPEED", None, 3), "qwen3_moe", "routed experts; use ZeRO-2, FSDP2 or DDP"),
    (("DEEPSPEED", None, 2), "qwen3_moe", None),
    (("MULTI_CPU", None, None), "qwen3_moe", None),
]


@pytest.mark.parametrize("launch, arch, named", REFUSALS)
def test_launches_the_tree_cannot_hand_a_whole_gradient_to_are_refused_by_name(launch, arch, named):
    from branchreplay.tiny_models import tiny_vision_model
    from branchreplay.trl.processes import launch_refusals

    model = tiny_vision_model() if arch == "gemma3-vision" else tiny_model(arch)
    refused = [why for no, why in launch_refusals(_accelerator(*launch), model, "TreeRLOOTrainer", "RLOOConfig")
               if no]
    assert refused == [] if named is None else (len(refused) == 1 and named in refused[0]), refused


def test_zero3_gradient_injection_names_a_parameter_the_token_did_not_reach():
    """ZeRO-3's hand-over (`zero.GradientInjection`): every parameter's hook adds its gradient once and is removed;
    a parameter the zero-loss token does not use keeps its hook, and the next micro-batch's check names it."""
    from types import SimpleNamespace

    from branchreplay.trl.zero import GradientInjection

    class Engine(torch.nn.Module):  # stands in for DeepSpeed's engine: `engine.module`, called with input_ids
        def __init__(self):
            super().__init__()
            self.module = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 2), "unused": torch.nn.Linear(2, 2)})

        def forward(self, input_ids):
            return SimpleNamespace(logits=self.module["used"](torch.ones(1, 2)))

    engine = Engine()
    grads = {p: torch.full_like(p, 3.0) for p in engine.module.parameters()}
    injection = GradientInjection()
    loss = injection.loss(engine, 1.5, grads, torch.device("cpu"))
    assert float(loss) == 1.5
    loss.backward()
    assert all(bool((p.grad == 3.0).all()) for p in engine.module["used"].parameters())
    with pytest.raises(RuntimeError, match=r"unused\.bias, unused\.weight did not reach DeepSpeed"):
        injection.check()


@pytest.mark.slow
def test_a_rank_that_dies_stops_the_other_with_one_line_naming_it(folder, tmp_path):  # noqa: F811
    """Two processes started as srun or mpirun start them (no torchrun agent to stop the survivor): rank 1 is
    SIGKILLed after step 1; rank 0's next collective fails at once (gloo) and it stops with `RankDied` naming rank 1
    and the step, well before any collective timeout."""
    import time

    out, port = tmp_path / "report.pt", str(free_port())
    job = {"name": "died", "trainer": "grpo", "sides": ["tree"], "die": True, "config": {"max_steps": 4}}
    processes = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        processes.append(subprocess.Popen([sys.executable, str(RANKS), str(folder), str(out), json.dumps([job])],
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    start = time.monotonic()
    assert processes[0].wait(timeout=300) == 0, processes[0].stderr.read()[-3000:]
    waited = time.monotonic() - start
    assert processes[1].wait(timeout=60) == -9
    said = torch.load(out, weights_only=False)["died"]["tree"]["died"]
    assert said.startswith("TreeGRPOTrainer: rank 1 of 2 died during step 2") and "\n" not in said, said
    assert waited < 120


def test_a_prompt_on_several_ranks_runs_across_them_when_the_cost_model_predicts_it_faster():
    """`split_groups` on SmolLM2-135M's shape (30 layers, 3 K/V heads of 64), 2 ranks: an 80-token prompt computed
    whole runs across them (half the FLOPs each against the K/V moved); the demo's 121-token prompt, of which each
    rank computes only the 11 after the start its other prompts share (`shared_start`, the prefix forest), stays
    recomputed, and a 1,081-token one with 971 of its own runs across (docs/benchmarks.md measures both); the tiny
    test model's prompts are cheaper than the collective calls. A family the context-parallel prefix cannot run is
    refused by name when it is asked for, and kept recomputed under "auto"."""
    from transformers import LlamaConfig

    from branchreplay.tree import Rollout, RolloutTree
    from branchreplay.trl.split_groups import faster_across, shared_start, split_groups_refusal

    smollm2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49152)
    assert faster_across(80, 2, smollm2, element_bytes=4)
    assert not faster_across(121, 2, smollm2, element_bytes=4, own=11)
    assert faster_across(1081, 2, smollm2, element_bytes=4, own=971)
    assert not faster_across(80, 2, tiny_model("llama").config, element_bytes=4)
    trees = [RolloutTree([Rollout(torch.tensor(ids), loss_mask=torch.zeros(len(ids)))])
             for ids in ([1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 7])]
    assert [shared_start(t, trees) for t in trees] == [3, 3, 1]
    mamba = tiny_model("mamba2").config
    assert "recurrent layers" in split_groups_refusal("context-parallel", mamba, False, False)
    assert split_groups_refusal("auto", mamba, False, False) == ""
    assert "router loss" in split_groups_refusal("context-parallel", smollm2, False, True)
    assert "images" in split_groups_refusal("context-parallel", smollm2, True, False)
    assert "use one of auto, recompute, context-parallel" in split_groups_refusal("always", smollm2, False, False)


BUILD = """\
import sys
from accelerate import PartialState
from datasets import Dataset
from trl import GRPOConfig
from branchreplay.trl import TreeGRPOTrainer

state = PartialState(cpu=True)
args = GRPOConfig(output_dir=sys.argv[2], use_cpu=True, bf16=False, per_device_train_batch_size=4,
                  num_generations=4, max_completion_length=4, max_steps=1, report_to=[], save_strategy="no")
try:
    TreeGRPOTrainer(model=sys.argv[1], reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                    train_dataset=Dataset.from_dict({"prompt": ["3 4 5"] * 8}))
    print(f"built on {state.num_processes} processes", flush=True)
except ValueError as e:
    print(f"refused: {e}", flush=True)
"""


def _accelerate_launch(options: list[str], model, tmp_path) -> str:
    script = tmp_path / "build.py"
    script.write_text(BUILD)
    accelerate = Path(sys.executable).with_name("accelerate")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(accelerate), "launch", *options, "--main_process_port", str(free_port()),
                           str(script), str(model), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, env=env, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_cpu_recipe_starts_two_processes_and_accelerates_cpu_flag_is_refused(folder, tmp_path):  # noqa: F811
    """`accelerate launch --cpu --num_processes 2` silently ran one process (accelerate's --cpu launcher starts one):
    the drop-in now refuses that launch by name, and configs/accelerate/cpu.yaml really starts 2 processes that the
    trainer is built on together."""
    if torch.cuda.is_available():
        pytest.skip("the CPU recipe is for a machine without an accelerator")
    out = _accelerate_launch(["--config_file", "configs/accelerate/cpu.yaml"], folder, tmp_path)
    assert out.count("built on 2 processes") == 2, out
    out = _accelerate_launch(["--cpu", "--num_processes", "2"], folder, tmp_path)
    assert "refused: TreeGRPOTrainer: accelerate launch was asked for several processes but started one" in out, out
    assert "configs/accelerate/cpu.yaml" in out


@pytest.mark.parametrize("name", ["cpu", "ddp", "fsdp2", "zero2", "zero3"])
def test_the_accelerate_configs_load_and_never_ask_for_fp16(name):
    """configs/accelerate/: accelerate reads each; none asks for fp16, which the drop-ins refuse (TRL's own ZeRO-3
    example config does); FSDP is version 2 without its activation checkpointing."""
    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(Path(__file__).resolve().parents[1] / "configs/accelerate" / f"{name}.yaml")
    assert config.mixed_precision in ("no", "bf16") and config.num_machines == 1
    if config.distributed_type.value == "FSDP":
        assert config.fsdp_config["fsdp_version"] == 2 and not config.fsdp_config["fsdp_activation_checkpointing"]


HUNG = """\
import os
import sys
import time
from datasets import Dataset
from trl import GRPOConfig
from branchreplay.trl import TreeGRPOTrainer

def patient_grader(completions, **kwargs):  # hangs on rank 1, as a stuck remote grader would
    if os.environ["RANK"] == "1":
        time.sleep(3600)
    return [0.0] * len(completions)

args = GRPOConfig(output_dir=sys.argv[2], use_cpu=True, bf16=False, per_device_train_batch_size=4,
                  num_generations=4, max_completion_length=4, max_steps=1, report_to=[], save_strategy="no")
TreeGRPOTrainer(model=sys.argv[1], reward_funcs=patient_grader, args=args, reward_timeout_s=5,
                train_dataset=Dataset.from_dict({"prompt": ["3 4 5"] * 8})).train()
"""


@pytest.mark.slow
def test_a_reward_hung_on_one_rank_ends_the_job_naming_the_rank_and_the_reward(folder, tmp_path):  # noqa: F811
    """A reward that hung on one of torchrun's 2 processes hung the whole job until the process group's 30-minute
    timeout, with no message (TRL's class and ours alike). With reward_timeout_s=5 the job ends within a minute:
    the hung rank raises naming the reward and the setting, the other names the rank that stopped."""
    import time

    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    torchrun = Path(sys.executable).with_name("torchrun")
    start = time.monotonic()
    done = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()), str(script),
                           str(folder), str(tmp_path / "out")], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.monotonic() - start
    said = done.stdout + done.stderr
    assert done.returncode != 0 and took < 90, (took, said[-3000:])
    assert "reward function 'patient_grader' did not return within reward_timeout_s=5 s on rank 1" in said, said[-3000:]
