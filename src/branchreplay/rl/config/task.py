"""The `task` section of the run config: `TaskConfig`, the default task, the system prompt and the held-out seed.

Torch-free (and reasoning-gym-free), so that the run config parses (and `--help` prints) before they load;
`rl/data/tasks.py` builds the datasets and prompts from it.
Measurements: docs/default_task.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...fields import check, help_of

SYSTEM_PROMPT = "Think briefly, then give the final answer inside <answer></answer> tags."

EVAL_SEED_OFFSET = 10_000
"""The held-out split uses seed ``TaskConfig.seed + EVAL_SEED_OFFSET``."""

DEFAULT_EVAL_SIZE = 64
"""Held-out items of a generated task (reasoning-gym, an environment's items) when task.eval_size is null."""

DEFAULT_TASK = "basic_arithmetic"
DEFAULT_TASK_CONFIG = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 2,
    "operators": ["+", "-"],
    "allow_parentheses": False,
    "allow_negation": False,
}
"""Default task: "Calculate a + b." / "Calculate a - b." with a, b drawn from 0..10 for half the questions and from
0..100 for the other half: SmolLM2-135M-Instruct answers some of them right greedily, in short completions, so there
is a reward signal and something to learn (figures: docs/default_task.md)."""

@dataclass
class TaskConfig:
    """Which reasoning-gym dataset to train on, how big the splits are, and how completions are scored."""

    name: str = field(default=DEFAULT_TASK, metadata=help_of(
        "a reasoning-gym dataset name (`known_tasks()` lists them)"))
    size: int = field(default=512, metadata=help_of("number of training examples"))
    eval_size: int | None = field(default=None, metadata=help_of(
        f"number of held-out examples; null = {DEFAULT_EVAL_SIZE} of a reasoning-gym task or an environment, and of "
        f"task.dataset one row in ten, at most {DEFAULT_EVAL_SIZE}. With evaluation off (train.eval_steps -1) no row "
        "of task.dataset is held out"))
    seed: int = field(default=0, metadata=help_of(
        f"seed of the training split; the held-out split uses seed + {EVAL_SEED_OFFSET}"))
    config: dict | None = field(default=None, metadata=help_of(
        "keyword arguments for the dataset's config class, passed as reasoning_gym.create_dataset(name, size=, "
        "seed=, **config). None (the default) means DEFAULT_TASK_CONFIG for the default task and reasoning-gym's "
        "own defaults ({}) for any other, so that changing only name never carries the default task's keys over to "
        "another dataset."))
    dataset: str | None = field(default=None, metadata=help_of(
        "a local JSONL, JSON or Parquet file of prompts (TRL's prompt-only format) instead of the reasoning-gym task "
        "(name, size, seed and config are then unused); read offline with Hugging Face datasets"))
    eval_dataset: str | None = field(default=None, metadata=help_of(
        "the held-out file of task.dataset, same columns; null = its last task.eval_size rows are held out"))
    prompt_column: str = field(default="prompt", metadata=help_of(
        "task.dataset's prompt column: a string, or a list of {role, content} messages (conversational)"))
    answer_column: str | None = field(default="answer", metadata=help_of(
        "task.dataset's gold-answer column, passed to the rewards as `answer` (math_verify needs it); null = none"))
    system_prompt: str | None = field(default=None, metadata=help_of(
        "a system message before every prompt (a conversational prompt with its own system message keeps it; a plain "
        "prompt of task.dataset then goes through the chat template, which otherwise it does not, as in TRL); null = "
        f"none for task.dataset, {SYSTEM_PROMPT!r} for a reasoning-gym task"))
    reward: str = field(default="task", metadata=help_of(
        "the reward of a completion: 'task' (the dataset's own score_answer on the <answer> content), "
        "'math_verify' (math-verify equivalence with the item's answer), or 'package.module:function', a function "
        "with TRL's reward signature (keyword arguments prompts, completions, completion_ids and the dataset "
        "columns; returns one float or None per completion), or a comma list of them, summed (with "
        "task.reward_weights) and each logged as rewards/<name>/mean (TRL's reward_funcs). Training and evaluation "
        "both use it"))
    reward_weights: list[float] | None = field(default=None, metadata=help_of(
        "one weight per function of task.reward (TRL's reward_weights); the reward is their weighted sum; null = "
        "all 1.0"))
    reward_timeout_s: float = field(default=300.0, metadata=help_of(
        "seconds a reward function of your own ('package.module:function') may take for one call (one step's "
        "completions, or a batch of held-out answers); past it the call is interrupted and counts as a reward that "
        "raised (the step is skipped with a warning; train.max_failed_steps in a row stop the run). Enforced by a "
        "SIGUSR1 to the main thread (rl/data/rewards.py, with_timeout)"))

    def __post_init__(self):
        check("task.eval_size", self.eval_size is None or self.eval_size >= 0, ">= 0 or null", self.eval_size)
        check("task.reward_timeout_s", self.reward_timeout_s > 0, "> 0 seconds", self.reward_timeout_s)
        if self.dataset is not None and "task" in reward_specs(self.reward):
            raise ValueError("task.reward='task' grades with the reasoning-gym dataset's score_answer; with "
                             "task.dataset use 'math_verify' or 'package.module:function'")
        if self.reward_weights is not None and not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) for w in self.reward_weights):
            raise ValueError(f"task.reward_weights={self.reward_weights!r} must be numbers, one per reward function")
        count = len(reward_specs(self.reward))
        if count == 0:
            raise ValueError("task.reward is empty; use 'task', 'math_verify', 'package.module:function' or a comma "
                             "list of them")
        if self.reward_weights is not None and len(self.reward_weights) != count:
            raise ValueError(f"task.reward_weights has {len(self.reward_weights)} weights for {count} reward "
                             f"function(s) in task.reward={self.reward!r}: give one weight per function")

    def held_out_size(self, rows: int | None = None) -> int:
        """task.eval_size, or when null its default: `DEFAULT_EVAL_SIZE` items of a generated task (`rows` None),
        one row in ten of a file of `rows` rows, at most `DEFAULT_EVAL_SIZE`."""
        if self.eval_size is not None:
            return self.eval_size
        return DEFAULT_EVAL_SIZE if rows is None else min(DEFAULT_EVAL_SIZE, rows // 10)

    def dataset_kwargs(self) -> dict:
        """The keyword arguments for the dataset's config class (``config`` with None resolved)."""
        if self.config is not None:
            return dict(self.config)
        return dict(DEFAULT_TASK_CONFIG) if self.name == DEFAULT_TASK else {}


def reward_specs(reward: str) -> list[str]:
    """The function specs of a `TaskConfig.reward` comma list."""
    return [part.strip() for part in reward.split(",") if part.strip()]
