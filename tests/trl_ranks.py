"""One rank of tests/test_trl_processes.py, started by torchrun as a TRL user launches a script:

    python -m torch.distributed.run --nproc_per_node 2 tests/trl_ranks.py FOLDER OUT JOBS_JSON

FOLDER: a tiny model and its tokenizer. JOBS_JSON: a list of {"name", "trainer" (grpo, rloo or dpo), "config" (on
top of this file's TRL config: use_cpu=True, i.e. accelerate's MULTI_CPU state, DDP over gloo, unless the config
names FSDP or DeepSpeed), "sides", and optionally "die": rank 1 SIGKILLs itself after step 1, and
"split_groups": the tree trainer's}. Each side trains 2
steps from one seed: "trl" TRL's class, "tree" the tree's, "unreduced" the tree's with the gradient handed to no
reduction (the control), "float64" the tree's GRPO in float64 beside the naive per-rollout gradient. Rank 0
writes OUT (torch.save): {name: {side: {"logs": the logged steps, "grads": the first step's gradient as the
optimizer receives it, gathered whole, "ratios": each rank's tree/token_ratio per step, and for "float64" "naive":
the ranks' mean naive gradient} or {"died": the RankDied message}}}, or {name: {"refused": message}} for a trainer
that refused to be built.

accelerate selects FSDP or DeepSpeed only with an accelerator; `on_cpu_processes` builds that state over the gloo
processes (a test-side shim, as issue 51 allows: nothing in the package is changed).
"""

import contextlib
import json
import os
import sys
from unittest import mock

import torch

GROUP_PROMPTS = ["1 3 4 5 6", "5 6", "7 8 9"]
PAIRS = {  # prompt, chosen, rejected (the word tokenizer's ids; "2" ends)
    "prompt": ["1 3 4 5 6", "5 6", "7 8 9", "5 6"] * 2,
    "chosen": ["10 11 12 13 2", "20 21 2", "30 2", "40 41 42 43 44 2"] * 2,
    "rejected": ["10 11 14 2", "22 2", "31 32 33 34 2", "40 41 45 2"] * 2,
}


def length_reward(completions, **kwargs):
    """A reward with spread inside each group: the completion's length in characters, mod 7."""
    return [float(len(c) % 7) for c in completions]


def on_cpu_processes():
    """accelerate's state made FSDP (or DeepSpeed) when the trainer's config asks for it, over the MULTI_CPU
    processes that use_cpu=True gives: accelerate otherwise falls back to DDP without an accelerator."""
    import accelerate.state
    from accelerate.utils import DistributedType

    original = accelerate.state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, deepspeed_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, deepspeed_plugin=deepspeed_plugin, **kwargs)
        if self.distributed_type != DistributedType.MULTI_CPU:
            return
        fsdp_plugin = fsdp_plugin or getattr(self, "fsdp_plugin", None)
        deepspeed_plugin = deepspeed_plugin or getattr(self, "deepspeed_plugins", None)
        if fsdp_plugin is not None:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
        elif deepspeed_plugin is not None:  # what accelerate does for DeepSpeed with an accelerator
            self.distributed_type = DistributedType.DEEPSPEED
            if self.deepspeed_plugins is None:
                deepspeed_plugin.set_mixed_precision(self._mixed_precision)
                deepspeed_plugin.select(_from_accelerator_state=True)
                self.deepspeed_plugins = deepspeed_plugin

    return mock.patch.object(accelerate.state.AcceleratorState, "__init__", init)


def build(trainer: str, side: str, folder: str, out: str, config: dict, model=None, split_groups: str = "auto"):
    """`side`'s trainer (module docstring) on `model`, or on the folder's when None."""
    import trl
    from datasets import Dataset, load_from_disk
    from transformers import AutoTokenizer

    from branchreplay import trl as tree

    model = folder if model is None else model

    settings = dict(report_to=[], use_cpu=True, bf16=False, max_steps=2, logging_steps=1, seed=0,
                    save_strategy="no", max_grad_norm=1e9, output_dir=f"{out}.{side}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if trainer == "dpo":
        cls = trl.DPOTrainer if side == "trl" else tree.TreeDPOTrainer
        args = trl.DPOConfig(**{**settings, "per_device_train_batch_size": 2, "learning_rate": 1e-3, **config})
        pairs = Dataset.from_dict(PAIRS)
        if args.precompute_ref_log_probs:  # TRL caches them beside the dataset's files, which the ranks must share
            with args.main_process_first():
                if args.process_index == 0:
                    pairs.save_to_disk(f"{out}.{side}.pairs")
                pairs = load_from_disk(f"{out}.{side}.pairs")
        run = cls(model=folder, args=args, train_dataset=pairs, processing_class=tokenizer)
        g = torch.Generator().manual_seed(4)  # the policy moved off the reference: margins clear of 0 (issue 50)
        with torch.no_grad():
            for p in run.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        return run
    cls = {"grpo": (trl.GRPOTrainer, tree.TreeGRPOTrainer), "rloo": (trl.RLOOTrainer, tree.TreeRLOOTrainer)}[trainer]
    make_config = trl.GRPOConfig if trainer == "grpo" else trl.RLOOConfig
    args = make_config(**{**settings, "per_device_train_batch_size": 6, "num_generations": 4,
                          "max_completion_length": 8, **config})
    tree_only = {} if side == "trl" else {"split_groups": split_groups}
    return cls[side != "trl"](model=model, reward_funcs=length_reward, args=args, **tree_only,
                              train_dataset=Dataset.from_dict({"prompt": GROUP_PROMPTS * 4}),
                              processing_class=tokenizer)


def full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient whole: FSDP2's DTensor gathered (a collective: every rank calls it)."""
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def first_gradient(trainer, stack: contextlib.ExitStack) -> list:
    """A list that receives the first step's gradients as the optimizer sees them (after clipping, which
    max_grad_norm=1e9 leaves out): through a callback, or under DeepSpeed, whose step runs inside accelerate's
    backward, from its engine before its first step (a collective under ZeRO-3: every rank takes it)."""
    from transformers import TrainerCallback

    seen = []
    if trainer.accelerator.distributed_type.value == "DEEPSPEED":
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.utils import safe_get_full_grad

        step = DeepSpeedEngine.step

        def grabbing_step(engine, *args, **kwargs):
            if not seen and engine.is_gradient_accumulation_boundary():
                seen.append([safe_get_full_grad(p) for p in engine.module.parameters()])
            return step(engine, *args, **kwargs)

        stack.enter_context(mock.patch.object(DeepSpeedEngine, "step", grabbing_step))
        return seen

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if not seen:
                seen.append([None if p.grad is None else full(p.grad).detach().clone()
                             for p in trainer.model.parameters()])

    trainer.add_callback(Grab())
    return seen


def unreduced():
    """The control: the tree's gradient handed to no reduction (`branchreplay.trl.processes`): DDP's average and
    FSDP2's reduce-scatter left out; under DeepSpeed, which must see each parameter's gradient once, zeros handed
    in its place."""
    from branchreplay.trl import fsdp2, processes, zero

    def zeros(grads: dict) -> dict:
        return {p: torch.zeros_like(g) for p, g in grads.items()}

    surrogate, inject = processes.linear_surrogate, zero.GradientInjection.loss
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(processes, "average_gradients", lambda *args: None))
    stack.enter_context(mock.patch.object(fsdp2, "fsdp2_reduce", lambda *args: None))
    stack.enter_context(mock.patch.object(
        processes, "linear_surrogate", lambda value, grads, *args: surrogate(value, zeros(grads), *args)))
    stack.enter_context(mock.patch.object(
        zero.GradientInjection, "loss",
        lambda self, engine, value, grads, *args: inject(self, engine, value, zeros(grads), *args)))
    return stack


def killed_after_first_step(trainer) -> None:
    """Rank 1 SIGKILLs itself at the end of step 1 (a rank that dies mid-run)."""
    import signal

    from transformers import TrainerCallback

    class Die(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1 and os.environ["RANK"] == "1":
                os.kill(os.getpid(), signal.SIGKILL)

    trainer.add_callback(Die())


def against_naive(stack: contextlib.ExitStack, folder: str) -> list:
    """A list that receives, on GRPO's first micro-batch, the naive per-rollout gradient of the same loss
    (`reference.naive.naive_backward`: each rollout alone through the folder's model in float64, the trainer's
    weights before its first update) beside the tree's (`trl.grpo.replay_backward`)."""
    from transformers import AutoModelForCausalLM

    from branchreplay.reference.float64 import keep_float64
    from branchreplay.reference.naive import naive_backward
    from branchreplay.trl import grpo

    naive, replay_backward = [], grpo.replay_backward

    def replay_and_naive(model, trees, loss, **kwargs):
        if not naive:
            reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
            rollouts = [r for tree in trees for r in tree.rollouts]
            with keep_float64(reference):
                naive_backward(reference, rollouts, loss, temperature=kwargs.get("temperature", 1.0))
            naive.append([torch.zeros_like(p) if p.grad is None else p.grad for p in reference.parameters()])
        return replay_backward(model, trees, loss, **kwargs)

    stack.enter_context(mock.patch.object(grpo, "replay_backward", replay_and_naive))
    return naive


def run_side(trainer: str, side: str, folder: str, out: str, config: dict, die: bool = False,
             split_groups: str = "auto") -> dict:
    """One side of a job (module docstring). "float64": the tree's GRPO on a float64 model, and the naive
    per-rollout gradient of each rank's first micro-batch, averaged over the ranks."""
    import torch.distributed as dist

    from branchreplay.trl.processes import RankDied

    with unreduced() if side == "unreduced" else contextlib.nullcontext(), contextlib.ExitStack() as stack:
        model = None
        if side == "float64":  # TRL's model_init_kwargs take no float64: the model is handed in
            from transformers import AutoModelForCausalLM

            from branchreplay.reference.float64 import keep_float64

            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
            stack.enter_context(keep_float64(model))  # HF's RMSNorm otherwise rounds to float32
        try:
            run = build(trainer, side, folder, out, config, model, split_groups)
        except ValueError as e:
            return {"refused": str(e)}
        grads = first_gradient(run, stack)
        naive = against_naive(stack, folder) if side == "float64" else None
        if die:
            killed_after_first_step(run)
        try:
            run.train()
        except RankDied as e:
            return {"died": str(e)}
    logs = [h for h in run.state.log_history if "loss" in h and "train_runtime" not in h]
    ratios = [None] * dist.get_world_size()  # this rank's tree/token_ratio per step (TRL's metrics are global)
    dist.all_gather_object(ratios, [h.get("tree/token_ratio") for h in logs])
    result = {"logs": logs, "grads": grads[0], "ratios": ratios}
    if naive is not None:  # the ranks' mean, as DDP reduces
        for g in naive[0]:
            dist.all_reduce(g)
            g /= dist.get_world_size()
        result["naive"] = naive[0]
    return result


def main(folder: str, out: str, jobs: list[dict]) -> None:
    from branchreplay.engine.parallel.distributed import end_spawned_rank

    if any("deepspeed" in job.get("config", {}) for job in jobs):  # what accelerate's state does with accelerators
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    report = {}
    with on_cpu_processes():
        for job in jobs:
            report[job["name"]] = {}
            for side in job["sides"]:
                result = run_side(job["trainer"], side, folder, out, job.get("config", {}), job.get("die", False),
                                  job.get("split_groups", "auto"))
                if "refused" in result:
                    report[job["name"]] = result
                    break
                report[job["name"]][side] = result
    if os.environ.get("RANK", "0") == "0":
        torch.save(report, out)
    if any("died" in side for job in report.values() for side in job.values() if isinstance(side, dict)):
        sys.stdout.flush()  # the process group is broken: no teardown
        os._exit(0)
    end_spawned_rank()  # gloo's teardown at exit aborts a rank now and then (its docstring)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
