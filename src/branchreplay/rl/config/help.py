"""What `train --help` and `eval --help` print: a short view of the options people use (TRL's names first, one
line each), and with `--help-all` every option the command reads, with its full text.

Each field's full text is its metadata (`fields.help_of`); the short view says what it is in a few words.
"""

from __future__ import annotations

import dataclasses
import shutil
import textwrap

from ..algorithms import ALGORITHMS
from .sections import SECTIONS
from .trl_names import BATCH_NAMES, TRL_NAMES, help_lines
from .values import field_types, kind, plain

COMMON: dict[str, tuple[tuple[str, str], ...]] = {
    "train": (
        ("model.spec", "the model: smollm2, a model folder, a .gguf file or a hub id"),
        ("algorithm", "grpo, ppo, rloo, reinforce_pp, dpo, or package.module:Class"),
        ("grpo.learning_rate", "peak AdamW learning rate"),
        ("grpo.num_generations", "completions per prompt (the group)"),
        ("grpo.prompts_per_step", "prompts per step (TRL's per_device_train_batch_size / num_generations)"),
        ("sampling.max_new_tokens", "tokens per completion, at most"),
        ("sampling.temperature", "sampling temperature"),
        ("grpo.beta", "KL coefficient against the reference model (0: no reference)"),
        ("grpo.loss_type", "TRL's loss types: grpo, dr_grpo, dapo, bnpo, ..."),
        ("grpo.num_iterations", "optimizer updates per batch of rollouts"),
        ("train.steps", "training steps"),
        ("train.save_steps", "checkpoint every this many steps"),
        ("train.eval_steps", "held-out evaluation every this many steps (-1: never)"),
        ("train.output_dir", "the run folder"),
        ("train.seed", "seed of the prompt order and the sampling"),
        ("train.report_to", "tensorboard, wandb, all or none"),
        ("model.dtype", "float32, bfloat16 (mixed precision) or float64"),
        ("model.lora_r", "LoRA rank (0: full fine-tuning)"),
        ("task.name", "a reasoning-gym task"),
        ("task.dataset", "your own JSONL, JSON or Parquet file of prompts instead"),
        ("task.prompt_column", "its prompt column"),
        ("task.answer_column", "its answer column (the built-in rewards grade with it)"),
        ("task.eval_dataset", "its held-out file (default: its last rows)"),
        ("task.system_prompt", "a system message before each prompt"),
        ("task.reward", "task, math_verify or package.module:function (a comma list)"),
        ("task.reward_weights", "one weight per reward function, e.g. [1.0, 0.2]"),
        ("grpo.max_staleness", "draw the next steps' rollouts this many steps ahead, in a process of their own"),
        ("parallel.strategy", "under torchrun: fsdp2, ddp or auto"),
    ),
    "eval": (
        ("model.spec", "the model: smollm2, a model folder, a .gguf file or a hub id"),
        ("model.dtype", "float32, bfloat16 or float64"),
        ("task.name", "a reasoning-gym task"),
        ("task.dataset", "your own file of prompts instead"),
        ("task.eval_dataset", "its held-out file (default: its last rows)"),
        ("task.eval_size", "held-out examples (default: 64, or one row in ten of a file, at most 64)"),
        ("task.reward", "task, math_verify or package.module:function"),
        ("sampling.max_new_tokens", "tokens per answer, at most"),
        ("agent.environment", "a multi-turn environment instead of a task"),
    ),
    "estimate": (
        ("model.spec", "the model whose tokenizer and sizes count (no weights are loaded)"),
        ("task.name", "a reasoning-gym task"),
        ("task.dataset", "your own file of prompts instead"),
        ("task.prompt_column", "its prompt column"),
        ("grpo.num_generations", "completions per prompt (the group)"),
        ("grpo.prompts_per_step", "prompts per step"),
        ("sampling.max_new_tokens", "tokens per completion, at most (--completion-tokens: an expected length)"),
    ),
}
"""Each command's short view: the field and what it is, in a few words."""

READS: dict[str, tuple[str, ...] | None] = {
    "train": None,  # every field
    "eval": ("model.*", "task.*", "agent.*", "sampling.max_new_tokens", "sampling.pack_weights"),
    "estimate": ("model.spec", "task.*", "grpo.num_generations", "grpo.prompts_per_step", "sampling.max_new_tokens",
                 "engine.max_pack_tokens"),
}
"""The fields each command reads (`section.*`: the whole section), what its `--help-all` lists."""

OPTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "train": (("--config FILE.yaml", "a run config: our sections, or TRL's flat GRPOConfig names"),
              ("--resume RUN_DIR", "continue a run from its latest complete checkpoint"),
              ("--dry-run", "sample a few completions, print each reward function's value for each, and exit: "
                            "nothing is trained or written"),
              ("--threads N", "torch's CPU threads")),
    "eval": (("--checkpoint DIR", "a run folder (its latest checkpoint and its config) or a checkpoint"),
             ("--config FILE.yaml", "a run config (default: the checkpoint's run's own)"),
             ("--threads N", "torch's CPU threads")),
    "estimate": (("--config FILE.yaml", "a run config (default: the default run's)"),
                 ("--dataset FILE", "a JSONL, JSON or Parquet file of your prompts (default: the run's task)"),
                 ("--completion-tokens N", "the completions' expected length (default: sampling.max_new_tokens)"),
                 ("--prompts N", "how many of the prompts to count (default 64)")),
}

ALGORITHM_HELP = ("what the advantages and the loss are: GRPO's group baseline, PPO's critic and GAE, RLOO's "
                  "leave-one-out baseline, REINFORCE++'s global normalisation, DPO on preference pairs; an algorithm "
                  "of your own (rl/algorithms/base.py, docs/algorithms.md)")


def short_help(command: str) -> str:
    """The options of `command` ("train", "eval" or "estimate") people use, as argparse prints them: TRL's name
    where it has one, ours and the default on one line, what it is below (`COMMON`); then how to see every option."""
    trl = {target: name for name, target in TRL_NAMES.items() if name not in (*BATCH_NAMES, "use_peft", "bf16")}
    lines = []
    for option, text in OPTIONS[command]:
        lines += [f"  {option}", f"      {text}"]
    for name, text in COMMON[command]:
        default = _default(name)
        names = " | ".join(f"--{n}" for n in (trl.get(name), name) if n)
        lines += [f"  {names}" + (f"  (default {plain(default)!r})" if default is not None else ""), f"      {text}"]
    return "\n".join(lines + ["", f"{len(_fields(command))} options in all, each with its full text: branchreplay "
                                   f"{command} --help-all"])


def full_help(command: str, width: int | None = None) -> str:
    """Every field `command` reads: `--section.field  (type, default)`, its help below, indented, wrapped to `width`
    columns (the terminal's by default, at least 60); for train, TRL's flat names after them. The config reference
    page (`reference.py`) shows the same fields and help."""
    width = max(60, width or shutil.get_terminal_size((120, 24)).columns)
    entries = [(f"--algorithm  (one of {', '.join(map(repr, ALGORITHMS))}, or package.module:Class; default "
                "'grpo')", ALGORITHM_HELP)] if command == "train" else []
    for name in _fields(command):
        if name == "algorithm":
            continue
        cls, f = _field(name)
        entries.append((f"--{name}  ({kind(field_types(cls)[f.name])}, default {plain(_default(name))!r})",
                        f.metadata.get("help", "")))
    lines = []
    for head, text in entries:
        lines += textwrap.wrap(head, width, subsequent_indent="      ")
        lines += textwrap.wrap(" ".join(text.split()), width, initial_indent="      ", subsequent_indent="      ")
    if command == "train":
        lines += textwrap.wrap("TRL's flat GRPOConfig names are accepted too, in a YAML file or as --name VALUE "
                               "(rl/config/trl_names.py):", width)
        lines += help_lines()
    return "\n".join(lines)


def _fields(command: str) -> list[str]:
    """Every `section.field` that `command` reads (`READS`), "algorithm" first for train."""
    wanted = READS[command]
    names = [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    if wanted is None:
        return ["algorithm", *names]
    return [n for n in names if n in wanted or f"{n.split('.')[0]}.*" in wanted]


def _default(name: str):
    """The default of `section.field` (or of "algorithm")."""
    if name == "algorithm":
        return "grpo"
    _, f = _field(name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _field(name: str):
    """(the section's class, the dataclass field) of `section.field`."""
    section, field_name = name.split(".")
    cls = SECTIONS[section]
    return cls, next(f for f in dataclasses.fields(cls) if f.name == field_name)
