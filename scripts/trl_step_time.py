"""TRL's padded training step against the tree trainer's on the same batch (docs/trl_results.md, "Step time
against TRL's class"; docs/benchmarks.md, "End to end against TRL").

One tree trainer (`--trainer grpo`: TreeGRPOTrainer, `rloo`: TreeRLOOTrainer, `dpo`: TreeDPOTrainer) on
SmolLM2-135M-Instruct makes one batch with TRL's own `_prepare_inputs` (the default task's questions as
conversational prompts, optionally after a long shared context; GRPO and RLOO sample G completions of each, DPO
pairs a long worked answer with a short guess); then the SAME batch runs, alternately and `--repeats` times each,
through:
  - TRL's `compute_loss` + backward with gradient checkpointing on (the config's default),
  - the same with gradient checkpointing off,
  - the tree trainer's `compute_loss` (the execution stack over one tree per prompt).
`--set name=value` sets more config fields (e.g. importance_sampling_level=sequence, GSPO's two-pass path).
It prints the median wall time and the peak resident memory above the start (`bench.measure`) of each, their
ratios, and the largest relative gradient difference of the tree against TRL's (float32).

Run (nothing else running; ~2 min for the demo's shapes, ~6 min for the long prompt):
    .venv/bin/python scripts/trl_step_time.py --prompts 4 --num-generations 8 --max-completion-length 48
    .venv/bin/python scripts/trl_step_time.py --prompts 1 --num-generations 8 --max-completion-length 64 \
        --context-tokens 1000
    .venv/bin/python scripts/trl_step_time.py --trainer rloo --prompts 4 --num-generations 8 \
        --max-completion-length 48
    .venv/bin/python scripts/trl_step_time.py --trainer dpo --prompts 4 --max-completion-length 48 \
        --context-tokens 1000
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import tempfile

import torch
import trl
from datasets import Dataset
from transformers import AutoTokenizer

from branchreplay.bench.measure import measure
from branchreplay.models import default_model_dir
from branchreplay.reference.naive import max_rel_grad_err
from branchreplay.rl.data.tasks import TaskConfig, build_messages, load_task
from branchreplay.trl import TreeDPOTrainer, TreeGRPOTrainer, TreeRLOOTrainer

TRAINERS = {"grpo": (trl.GRPOTrainer, TreeGRPOTrainer, trl.GRPOConfig),
            "rloo": (trl.RLOOTrainer, TreeRLOOTrainer, trl.RLOOConfig),
            "dpo": (trl.DPOTrainer, TreeDPOTrainer, trl.DPOConfig)}

CONTEXT = ("The following notes are shared by every question of this batch. Arithmetic is done left to right, "
           "and every number is a whole number between zero and one hundred. ")


def length_reward(completions, **kwargs):
    """A reward with spread inside each group (the step's cost does not depend on it)."""
    return [float(len(str(c)) % 7) for c in completions]


def train_dataset(trainer: str, tokenizer, prompts: int, context_tokens: int, completion_tokens: int,
                  context_after_question: bool = False) -> Dataset:
    """The default task's first `prompts` questions as conversational prompts, after about `context_tokens` tokens
    of shared context (a system message) when not 0, or after each question in its message with
    `context_after_question` (each prompt's own from the question on); for DPO one pair per prompt: a worked answer
    of about `completion_tokens` tokens against a short guess."""
    questions = [item["question"] for item in list(load_task(TaskConfig())[0])[:prompts]]
    context = None
    if context_tokens:
        per = len(tokenizer(CONTEXT)["input_ids"])
        context = CONTEXT * max(1, context_tokens // per)
    if context and context_after_question:
        messages = [build_messages(f"{q}\n\n{context}") for q in questions]
    else:
        messages = [build_messages(q, context) if context else build_messages(q) for q in questions]
    if trainer != "dpo":
        return Dataset.from_dict({"prompt": messages})
    sentence = "Let me work this out step by step, one operation at a time. "  # about 14 tokens
    steps = sentence * max(1, completion_tokens // 14)
    return Dataset.from_dict({
        "prompt": messages,
        "chosen": [[{"role": "assistant", "content": steps + "The answer is 42."}] for _ in messages],
        "rejected": [[{"role": "assistant", "content": "I think it is 41."}] for _ in messages]})


def arguments() -> tuple[argparse.Namespace, dict]:
    """The command line, and the --set fields as {name: value}."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-completion-length", type=int, default=48, help="tokens")
    ap.add_argument("--context-tokens", type=int, default=0, help="about this many tokens of shared context "
                    "before every question (a system message)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trainer", choices=sorted(TRAINERS), default="grpo")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="another config field (a Python literal or a string), repeatable")
    a = ap.parse_args()
    extra = {}
    for item in a.set:
        name, _, value = item.partition("=")
        try:
            extra[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            extra[name] = value
    return a, extra


def one_batch(a: argparse.Namespace, extra: dict):
    """(the tree trainer of `a.trainer` on SmolLM2, its first prepared batch, mean prompt and completion tokens)."""
    _, tree_cls, config_cls = TRAINERS[a.trainer]
    model_dir = str(default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = train_dataset(a.trainer, tokenizer, a.prompts, a.context_tokens, a.max_completion_length)
    common = dict(report_to=[], use_cpu=True, bf16=False, seed=0, save_strategy="no", max_steps=1)
    with tempfile.TemporaryDirectory() as out:
        if a.trainer == "dpo":
            args = config_cls(output_dir=out, per_device_train_batch_size=a.prompts, **common, **extra)
            trainer = tree_cls(model=model_dir, args=args, train_dataset=data, processing_class=tokenizer)
        else:
            args = config_cls(output_dir=out, per_device_train_batch_size=a.prompts * a.num_generations,
                              num_generations=a.num_generations, max_completion_length=a.max_completion_length,
                              **common, **extra)
            trainer = tree_cls(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=data,
                               processing_class=tokenizer)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    if a.trainer == "dpo":
        R = inputs["completion_mask"].sum(1).float().mean().item()
        P = inputs["attention_mask"].sum(1).float().mean().item() - R
    else:
        P = inputs["prompt_mask"].sum(1).float().mean().item()
        R = inputs["completion_mask"].sum(1).float().mean().item()
    return trainer, inputs, P, R


def main() -> None:
    a, extra = arguments()
    theirs_cls, tree_cls, _ = TRAINERS[a.trainer]
    torch.set_num_threads(a.threads)
    trainer, inputs, P, R = one_batch(a, extra)
    model = trainer.model

    def trl_step(checkpointing: bool):
        def run():
            if checkpointing:
                model.activation_checkpointing_enable()
            model.zero_grad(set_to_none=True)
            theirs_cls.compute_loss(trainer, model, inputs).backward()
            if checkpointing:
                model.activation_checkpointing_disable()
        return run

    def tree_step():
        model.zero_grad(set_to_none=True)
        trainer.compute_loss(model, inputs)

    methods = {"TRL, gradient checkpointing (default)": trl_step(True), "TRL, no checkpointing": trl_step(False),
               tree_cls.__name__: tree_step}
    times, peaks = {m: [] for m in methods}, {m: [] for m in methods}
    for _ in range(a.repeats):
        for name, fn in methods.items():
            m = measure(fn, torch.device("cpu"))
            times[name].append(m.seconds)
            peaks[name].append(m.peak_bytes)
    trl_step(False)()
    theirs = [p.grad.clone() for p in model.parameters()]
    tree_step()
    error = max_rel_grad_err([p.grad for p in model.parameters()], theirs)
    print(f"{a.trainer} {extra or ''}: SmolLM2-135M-Instruct float32, {a.threads} threads, "
          f"load average {os.getloadavg()[0]:.2f}; "
          f"{a.prompts} prompts x {'a pair' if a.trainer == 'dpo' else f'G={a.num_generations}'}: prompt {P:.0f} "
          f"tokens, completion {R:.1f} tokens (means); "
          f"{a.repeats} repeats, median")
    base = statistics.median(times["TRL, gradient checkpointing (default)"])
    print(f"{'':40s} {'seconds':>8s} {'vs TRL':>7s} {'peak MB':>8s}")
    for name in methods:
        t = statistics.median(times[name])
        print(f"{name:40s} {t:8.2f} {base / t:6.2f}x {max(peaks[name]) / 2**20:8.0f}")
    print(f"tree's gradient against TRL's: max relative difference {error:.2e}")


if __name__ == "__main__":
    main()
