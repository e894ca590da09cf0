"""TRL's class against the tree's on several processes: each rank's training time and peak memory per step
(docs/benchmarks.md, "The TRL drop-ins under torchrun, each rank against TRL's class").

Run under torchrun, as a TRL user launches (nothing else running):
    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 scripts/trl_processes_step.py \
        --trainer grpo --prompts 4 --num-generations 8 --max-completion-length 48 [--launch ddp]

Each rank trains `--steps` steps of SmolLM2-135M-Instruct (float32, 1 thread per rank) with TRL 1.16's class, then
with the tree's, from one seed, under `--launch`: ddp (use_cpu=True: accelerate's MULTI_CPU), fsdp2 or fsdp2-kept
(reshard_after_forward true / false), zero2 or zero3 (DeepSpeed, DS_ACCELERATOR=cpu); accelerate selects FSDP and
DeepSpeed only with an accelerator, so on a CPU the state is built by tests/trl_ranks.py's shim. GRPO and RLOO take
`--prompts` x G rows per step over all ranks (`--per-device` rows each: by default a whole number of groups; set it
to split groups over the ranks, and `--split-groups recompute auto` to train the tree's class once per choice of its
`split_groups`; a choice named twice runs twice, and `--tree-only` leaves TRL's class out), DPO one pair per prompt
after `--context-tokens` of shared context.
"Training" is each micro-batch's `compute_loss` and `accelerator.backward` (under DeepSpeed the optimizer step
runs inside the latter, for both classes), summed over the step; "peak" the most resident memory above the start of
that window (`bench.measure`'s sampler). Rank 0 prints, per rank, the median over the steps after the first (a
warm-up), the tree's token ratio, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import trl
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from trl_step_time import length_reward, train_dataset  # noqa: E402

from branchreplay.bench.measure import release_freed_memory, rss_bytes  # noqa: E402
from branchreplay.engine.parallel.distributed import end_spawned_rank  # noqa: E402
from branchreplay.models import default_model_dir  # noqa: E402
from branchreplay.trl import TreeDPOTrainer, TreeGRPOTrainer, TreeRLOOTrainer  # noqa: E402
from trl_ranks import on_cpu_processes  # noqa: E402 (the CPU shim for FSDP2 and DeepSpeed)

TRAINERS = {"grpo": (trl.GRPOTrainer, TreeGRPOTrainer, trl.GRPOConfig),
            "rloo": (trl.RLOOTrainer, TreeRLOOTrainer, trl.RLOOConfig),
            "dpo": (trl.DPOTrainer, TreeDPOTrainer, trl.DPOConfig)}
AUTO = dict.fromkeys(("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                      "gradient_clipping"), "auto")
LAUNCHES = {
    "ddp": {},
    "fsdp2": {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True}},
    "fsdp2-kept": {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": False}},
    "zero2": {"deepspeed": {"zero_optimization": {"stage": 2}, **AUTO}},
    "zero3": {"deepspeed": {"zero_optimization": {"stage": 3}, **AUTO}},
}


class StepMeter:
    """Times each micro-batch's compute_loss + accelerator.backward of `trainer` and samples its resident memory;
    `steps` holds (seconds, peak bytes above the window's start) per optimizer step."""

    def __init__(self, trainer):
        self.steps: list[tuple[float, int]] = []
        self.seconds, self.peak, self.base = 0.0, 0, 0
        self.sampling = threading.Event()
        compute_loss, backward = trainer.compute_loss, trainer.accelerator.backward

        def timed_compute_loss(*args, **kwargs):
            self._start()
            return compute_loss(*args, **kwargs)

        def timed_backward(*args, **kwargs):
            backward(*args, **kwargs)
            self._stop(trainer.accelerator.sync_gradients)

        trainer.compute_loss, trainer.accelerator.backward = timed_compute_loss, timed_backward

    def _start(self) -> None:
        release_freed_memory()
        self.base, self.t0 = rss_bytes(), time.perf_counter()
        self.window_peak = self.base
        self.sampling.clear()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _sample(self) -> None:
        while not self.sampling.is_set():
            self.window_peak = max(self.window_peak, rss_bytes())
            time.sleep(0.001)

    def _stop(self, step_ends: bool) -> None:
        self.seconds += time.perf_counter() - self.t0
        self.sampling.set()
        self.sampler.join()
        self.peak = max(self.peak, self.window_peak - self.base)
        if step_ends:
            self.steps.append((self.seconds, self.peak))
            self.seconds, self.peak = 0.0, 0


def build(cls, config_cls, a, out: str, split_groups: str | None = None):
    model_dir = str(default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = train_dataset(a.trainer, tokenizer, a.prompts * a.steps, a.context_tokens, a.max_completion_length,
                         a.context_after_question)
    common = dict(report_to=[], use_cpu=True, bf16=False, seed=0, save_strategy="no", max_steps=a.steps,
                  logging_steps=1, output_dir=out, **LAUNCHES[a.launch])
    if a.trainer == "dpo":
        longest = {"max_length": a.max_length} if a.max_length else {}  # DPOConfig's default: 1,024 tokens
        args = config_cls(per_device_train_batch_size=a.per_device or a.prompts // a.world, **longest, **common)
        return cls(model=model_dir, args=args, train_dataset=data, processing_class=tokenizer)
    rows = a.per_device or a.prompts * a.num_generations // a.world
    args = config_cls(per_device_train_batch_size=rows, num_generations=a.num_generations,
                      max_completion_length=a.max_completion_length, **common)
    tree_only = {} if split_groups is None else {"split_groups": split_groups}
    return cls(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=data, processing_class=tokenizer,
               **tree_only)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", choices=sorted(TRAINERS), default="grpo")
    ap.add_argument("--launch", choices=sorted(LAUNCHES), default="ddp")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step, over all ranks")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--per-device", type=int, default=0, help="rows per rank (default: the step's rows / ranks)")
    ap.add_argument("--max-completion-length", type=int, default=48, help="tokens")
    ap.add_argument("--context-tokens", type=int, default=0, help="shared context before every question")
    ap.add_argument("--max-length", type=int, default=0, help="DPO's max_length (default: DPOConfig's)")
    ap.add_argument("--context-after-question", action="store_true",
                    help="the context after each question instead (each prompt long and its own)")
    ap.add_argument("--steps", type=int, default=3, help="the first is a warm-up")
    ap.add_argument("--split-groups", nargs="+", default=["auto"], choices=["auto", "recompute", "context-parallel"],
                    help="the tree trainer's split_groups, one run each (GRPO and RLOO)")
    ap.add_argument("--tree-only", action="store_true", help="leave TRL's class out (ratios against the first run)")
    a = ap.parse_args()
    a.world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    if "deepspeed" in LAUNCHES[a.launch]:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    theirs_cls, tree_cls, config_cls = TRAINERS[a.trainer]
    results = {}
    with on_cpu_processes(), tempfile.TemporaryDirectory() as out:
        runs = [] if a.tree_only else [("TRL " + theirs_cls.__name__, theirs_cls, None)]
        if a.trainer == "dpo":
            runs.append((tree_cls.__name__, tree_cls, None))
        else:
            several = len(a.split_groups) > 1
            runs += [(f"{tree_cls.__name__}{f' {choice}' if several else ''}{f' ({k + 1})' if several else ''}",
                      tree_cls, choice) for k, choice in enumerate(a.split_groups)]
        for name, cls, split_groups in runs:
            trainer = build(cls, config_cls, a, f"{out}/{name}", split_groups)
            meter = StepMeter(trainer)
            trainer.train()
            ratios = [h["tree/token_ratio"] for h in trainer.state.log_history if "tree/token_ratio" in h]
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, (meter.steps[1:] or meter.steps, ratios))
            results[name] = every
    if dist.get_rank() == 0:
        print(f"{a.trainer}, {a.launch}, {a.world} processes x 1 thread, SmolLM2-135M-Instruct float32; "
              f"{a.prompts} prompts per step x {'a pair' if a.trainer == 'dpo' else f'G={a.num_generations}'}, "
              f"per rank {a.per_device or 'the step / ranks'}; median of steps 2-{a.steps}; load average "
              f"{os.getloadavg()[0]:.2f}")
        base = {r: statistics.median(s for s, _ in steps) for r, (steps, _) in enumerate(next(iter(results.values())))}
        against = "vs 1st" if a.tree_only else "vs TRL"
        print(f"{'':34s} {'rank':>4s} {'training s':>10s} {against:>7s} {'peak MB':>8s} {'token ratio':>12s}")
        for name, ranks in results.items():
            for rank, (steps, ratios) in enumerate(ranks):
                seconds = statistics.median(s for s, _ in steps)
                peak = max(p for _, p in steps) / 2**20
                ratio = ", ".join(f"{x:.2f}" for x in ratios) or "-"
                print(f"{name:34s} {rank:4d} {seconds:10.2f} {base[rank] / seconds:6.2f}x {peak:8.0f} {ratio:>12s}")
    end_spawned_rank()  # gloo's teardown at exit aborts a rank now and then (its docstring)


if __name__ == "__main__":
    main()
