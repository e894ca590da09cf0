"""`branchreplay train --dry-run`: the run's data, reward functions and model, a few completions sampled in-process
and each scored by each reward function, printed; nothing is trained and no run folder is written. What a user runs
before a long job to see that their rewards read the right columns and spread inside a group."""

from __future__ import annotations

import sys

import torch
from rich.table import Table

from ...decode.loop import eos_token_ids, sample_groups
from ..config import Config
from ..data.rewards import RewardFunctionError, score_columns
from ..data.tasks import prompt_token_ids
from .trainer import load_data, load_model

PROMPTS, SAMPLES = 2, 4
"""At most this many prompts of the training data, and completions of each (grpo.num_generations when fewer)."""


def dry_run(config: Config, console) -> int:
    """Sample and score (module docstring); print one row per completion: its prompt and text (cut short), each
    reward function's value and the weighted total. Returns 0, or 1 after printing a reward's error and traceback.

    Raises:
        ValueError: a multi-turn run (its environment scores whole trajectories: `branchreplay eval` shows them), and
            what loading the data, the rewards or the model raises.
    """
    env, train_data, _, rewards = load_data(config, None, None, None, None)
    if env is not None:
        raise ValueError("--dry-run scores a task's reward functions; agent.environment scores its own trajectories: "
                         "`branchreplay eval --config ...` shows them")
    model, tokenizer = load_model(config)
    items = [train_data[i] for i in range(min(PROMPTS, len(train_data)))]
    prompt_ids = [prompt_token_ids(tokenizer, item, config.task) for item in items]
    per_prompt = min(SAMPLES, config.grpo.num_generations)
    generators = [torch.Generator().manual_seed(config.train.seed + k) for k in range(len(items))]
    with torch.no_grad():
        samples = sample_groups(model.eval(), prompt_ids, per_prompt, config.sampling,
                                eos_token_ids(model, tokenizer), generators)
    try:
        total, columns = score_columns(rewards, tokenizer, items, samples, config.task)
    except RewardFunctionError as e:
        print(f"error: {e}", file=sys.stderr)
        print(e.traceback, file=sys.stderr, end="")
        return 1
    table = Table(title=f"{len(items)} prompts x {per_prompt} completions, nothing trained")
    for column in ("prompt", "completion", *rewards.names, "reward"):
        table.add_column(column, overflow="fold")
    flat = [(item, s) for item, group in zip(items, samples, strict=True) for s in group]
    for (item, s), row, value in zip(flat, columns.tolist(), total.tolist(), strict=True):
        text = tokenizer.decode(s.completion_ids, skip_special_tokens=True)
        table.add_row(_short(item["question"]), _short(text), *(f"{v:.3f}" for v in row), f"{value:.3f}")
    console.print(table)
    return 0


def _short(value, limit: int = 60) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
