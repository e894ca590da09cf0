"""End to end against the peer: the demo's settings trained by TRL's GRPOTrainer, by TreeGRPOTrainer (our drop-in)
and by `branchreplay train`, one after the other on SmolLM2-135M-Instruct (docs/benchmarks.md, "End to end against
TRL").

The demo's settings (configs/demo.yaml): the default task, 4 prompts x G=8 per step, completions of at most 48
tokens sampled at temperature 1, loss_type dapo, learning rate 1e-5, beta 0, float32. TRL samples with
`model.generate` on its padded batch (no vLLM) and trains with gradient checkpointing (GRPOConfig's default);
TreeGRPOTrainer samples the same way and trains over the prefix trees; `branchreplay train` samples every group in
one decoding loop (`decode.loop.sample_groups`) and trains over the trees. Time per step split into generation
(sampling and rewards: TRL's `_generate_and_score_completions`, our `time/sample_s`) and training (the rest of the
step: logprobs, loss, backward, optimizer). TRL draws its prompts with its own sampler, so the three runs see
different prompts of the same task (the sizes are alike; the completion lengths are printed).

    .venv/bin/python scripts/trl_wall_clock.py --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import trl
from datasets import Dataset
from transformers import AutoTokenizer

from branchreplay.models import default_model_dir
from branchreplay.rl.data.rewards import reasoning_gym_reward
from branchreplay.rl.data.tasks import TaskConfig, build_messages, load_task
from branchreplay.trl import TreeGRPOTrainer

ROOT = Path(__file__).resolve().parents[1]


def timed(cls):
    """`cls` recording, per optimizer step, the seconds of generation and of the whole training step."""

    class Timed(cls):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.generation_s.append(time.perf_counter() - t0)
            self.completion_tokens.append(out["completion_mask"].sum(1).float().mean().item())
            return out

        def training_step(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super().training_step(*args, **kwargs)
            self.step_s.append(time.perf_counter() - t0)
            return out

    return Timed


def trl_run(cls, steps: int, out: str) -> dict:
    model_dir = str(default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train = load_task(TaskConfig())[0]
    items = [train[i] for i in range(len(train))]
    data = Dataset.from_dict({"prompt": [build_messages(x["question"]) for x in items],
                              "answer": [x["answer"] for x in items],
                              "metadata": [json.dumps(x["metadata"]) for x in items]})
    task_reward = reasoning_gym_reward(train)

    def reasoning_gym(completions, answer, metadata, **kwargs):
        return task_reward(completions, answer, [json.loads(m) for m in metadata])

    args = trl.GRPOConfig(output_dir=out, per_device_train_batch_size=32, num_generations=8,
                          max_completion_length=48, temperature=1.0, learning_rate=1e-5, loss_type="dapo", beta=0.0,
                          max_steps=steps, report_to=[], use_cpu=True, bf16=False, seed=0, save_strategy="no",
                          logging_steps=1, disable_tqdm=True)
    trainer = timed(cls)(model=model_dir, reward_funcs=reasoning_gym, args=args, train_dataset=data,
                         processing_class=tokenizer)
    trainer.generation_s, trainer.step_s, trainer.completion_tokens = [], [], []
    trainer.train()
    sample = trainer.generation_s
    return {"sample_s": sample, "train_s": [s - g for s, g in zip(trainer.step_s, sample, strict=True)],
            "completion_tokens": trainer.completion_tokens}


def branchreplay_run(steps: int, out: str) -> dict:
    run = Path(out) / "run"
    subprocess.run([str(Path(sys.executable).parent / "branchreplay"), "train", "--config",
                    str(ROOT / "configs/demo.yaml"), "--train.steps", str(steps), "--train.eval_steps", "-1",
                    "--train.output_dir", str(run)], check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) > 0]
    return {"sample_s": [r["time/sample_s"] for r in rows], "train_s": [r["time/train_s"] for r in rows],
            "completion_tokens": [r["completions/mean_length"] for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    results = {}
    for name, run in (("TRL GRPOTrainer", lambda out: trl_run(trl.GRPOTrainer, a.steps, out)),
                      ("TreeGRPOTrainer", lambda out: trl_run(TreeGRPOTrainer, a.steps, out)),
                      ("branchreplay train", lambda out: branchreplay_run(a.steps, out))):
        with tempfile.TemporaryDirectory() as out:
            results[name] = run(out)
        print(name, json.dumps(results[name]), flush=True)
    print(f"\nSmolLM2-135M-Instruct float32, {a.threads} threads, {a.steps} steps each, load average "
          f"{os.getloadavg()[0]:.2f}; median per step")
    base = statistics.median(s + t for s, t in zip(results["TRL GRPOTrainer"]["sample_s"],
                                                   results["TRL GRPOTrainer"]["train_s"], strict=True))
    print(f"{'':22s} {'generation':>11s} {'training':>9s} {'step':>7s} {'vs TRL':>7s} {'completion tokens':>18s}")
    for name, r in results.items():
        step = statistics.median(s + t for s, t in zip(r["sample_s"], r["train_s"], strict=True))
        print(f"{name:22s} {statistics.median(r['sample_s']):10.1f}s {statistics.median(r['train_s']):8.1f}s "
              f"{step:6.1f}s {base / step:6.2f}x {statistics.mean(r['completion_tokens']):18.1f}")


if __name__ == "__main__":
    main()
