"""Training tasks: reasoning-gym datasets, chat prompts and answer extraction.

A task is a procedurally generated reasoning-gym dataset (offline, deterministic given a seed). Each item is a dict
with ``question`` (str), ``answer`` (str, the gold answer) and ``metadata`` (dict); ``dataset.score_answer(answer,
item)`` grades an extracted answer in [0, 1] (see `branchreplay.rl.rewards`).

The default task and its configuration were chosen by measuring SmolLM2-135M-Instruct's base accuracy
(``scripts/measure_base_accuracy.py``, results in ``docs/default_task.md``): the base model must be neither always
wrong (no reward signal) nor always right (nothing to learn).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field

import reasoning_gym
from reasoning_gym.dataset import ProceduralDataset
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import extract_answer as _rg_extract_answer

from ..fields import help_of

SYSTEM_PROMPT = "Think briefly, then give the final answer inside <answer></answer> tags."

FEW_SHOT: list[tuple[str, str]] = [
    ("What is 7 - 9?", "7 - 9 = -2. <answer>-2</answer>"),
    ("How many legs do 3 birds have?", "A bird has 2 legs, so 3 birds have 3 * 2 = 6 legs. <answer>6</answer>"),
]
"""(question, reply) demonstrations put before every question as earlier chat turns. Measured on
SmolLM2-135M-Instruct (docs/default_task.md), the instruction alone never made it write ``<answer>`` tags; these two
turns do. They are part of the prompt, which every rollout of a group shares, so they cost one prefix forward."""

EVAL_SEED_OFFSET = 10_000
"""The held-out split uses seed ``TaskConfig.seed + EVAL_SEED_OFFSET``."""

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
0..100 for the other half. SmolLM2-135M-Instruct answers about 0.44 of them right greedily (docs/default_task.md);
its completions need about 48 new tokens."""

_SHOWN_TASKS = 30  # how many known task names an "unknown task" error lists


@dataclass
class TaskConfig:
    """Which reasoning-gym dataset to train on, how big the splits are, and how completions are scored."""

    name: str = field(default=DEFAULT_TASK, metadata=help_of(
        "a reasoning-gym dataset name (`known_tasks()` lists them)"))
    size: int = field(default=512, metadata=help_of("number of training examples"))
    eval_size: int = field(default=64, metadata=help_of("number of held-out examples"))
    seed: int = field(default=0, metadata=help_of(
        f"seed of the training split; the held-out split uses seed + {EVAL_SEED_OFFSET}"))
    config: dict | None = field(default=None, metadata=help_of(
        "keyword arguments for the dataset's config class, passed as reasoning_gym.create_dataset(name, size=, "
        "seed=, **config). None (the default) means DEFAULT_TASK_CONFIG for the default task and reasoning-gym's "
        "own defaults ({}) for any other, so that changing only name never carries the default task's keys over to "
        "another dataset."))
    reward: str = field(default="task", metadata=help_of(
        "the reward of a completion: 'task' (the dataset's own score_answer on the <answer> content), "
        "'math_verify' (math-verify equivalence with the item's answer), or 'package.module:function', a function "
        "with TRL's reward signature (keyword arguments prompts, completions, completion_ids and the dataset "
        "columns; returns one float or None per completion). Training and evaluation both use it"))

    def dataset_kwargs(self) -> dict:
        """The keyword arguments for the dataset's config class (``config`` with None resolved)."""
        if self.config is not None:
            return dict(self.config)
        return dict(DEFAULT_TASK_CONFIG) if self.name == DEFAULT_TASK else {}


def known_tasks() -> list[str]:
    """Names of all datasets registered in reasoning-gym, sorted."""
    return sorted(DATASETS)


def load_task(cfg: TaskConfig) -> tuple[ProceduralDataset, ProceduralDataset]:
    """Build the (train, eval) datasets of ``cfg``.

    Both splits come from the same generator with different seeds (``seed`` and ``seed + EVAL_SEED_OFFSET``), so
    they differ, but a small question space repeats: with the default task, 19 of the 64 held-out questions also
    occur among the 512 training ones (the 0..10 half has only 242 distinct questions).

    Raises:
        ValueError: unknown task name (the message lists known names and close matches); a ``config`` key the
            dataset's config class does not have, or ``size``/``seed`` given in ``config`` (the message names it);
            a config value the dataset's own validation rejects.
    """
    if cfg.name not in DATASETS:
        raise ValueError(_unknown_task_message(cfg.name))
    _check_config_keys(cfg.name, cfg.dataset_kwargs())
    return _create(cfg, cfg.size, cfg.seed), _create(cfg, cfg.eval_size, cfg.seed + EVAL_SEED_OFFSET)


def build_messages(question: str) -> list[dict]:
    """Chat messages for one question: system (SYSTEM_PROMPT), the FEW_SHOT turns (user, assistant), then user."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for demo_question, demo_reply in FEW_SHOT:
        messages += [{"role": "user", "content": demo_question}, {"role": "assistant", "content": demo_reply}]
    return messages + [{"role": "user", "content": question}]


def extract_answer(completion: str) -> str | None:
    """The stripped text inside the last ``<answer>...</answer>`` pair of ``completion``; None if there is none."""
    return _rg_extract_answer(completion)


def _create(cfg: TaskConfig, size: int, seed: int) -> ProceduralDataset:
    kwargs = cfg.dataset_kwargs()
    try:
        return reasoning_gym.create_dataset(cfg.name, size=size, seed=seed, **kwargs)
    except AssertionError as e:  # reasoning-gym validates configs with assert
        raise ValueError(f"invalid config for task {cfg.name!r} {kwargs}: {e}") from e


def _check_config_keys(name: str, config: dict) -> None:
    allowed = {f.name for f in dataclasses.fields(DATASETS[name][1])} - {"size", "seed"}
    for key in config:
        if key in ("size", "seed"):
            raise ValueError(f"config key {key!r} for task {name!r}: set TaskConfig.{key} instead")
        if key not in allowed:
            raise ValueError(f"unknown config key {key!r} for task {name!r}; allowed keys: {sorted(allowed)}")


def _unknown_task_message(name: str) -> str:
    names = known_tasks()
    close = difflib.get_close_matches(name, names, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    shown = ", ".join(names[:_SHOWN_TASKS])
    more = f", ... ({len(names) - _SHOWN_TASKS} more)" if len(names) > _SHOWN_TASKS else ""
    return (
        f"unknown task {name!r}.{hint} Known tasks ({len(names)}): {shown}{more}. "
        "The full list: python -c 'import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))'."
    )
