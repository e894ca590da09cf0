"""Training tasks: reasoning-gym datasets or the user's own prompts, chat prompts and answer extraction.

A task is a procedurally generated reasoning-gym dataset (offline, deterministic given a seed). Each item is a dict
with ``question`` (str), ``answer`` (str, the gold answer) and ``metadata`` (dict); ``dataset.score_answer(answer,
item)`` grades an extracted answer in [0, 1] (see `branchreplay.rl.data.rewards`). Or ``task.dataset``: the user's
own prompts in a local JSONL / JSON / Parquet file (TRL's prompt-only format, `load_prompt_file`), every column of
which reaches the reward functions by name, as TRL's ``GRPOTrainer`` passes dataset columns. `prompt_messages` turns
any item into the chat messages the policy is prompted with. The default task is one on which SmolLM2-135M-Instruct
is neither always wrong (no reward signal) nor always right (nothing to learn): ``docs/default_task.md``.
Design notes and measurements: docs/default_task.md.
"""

from __future__ import annotations

import dataclasses
import difflib

import reasoning_gym
from reasoning_gym.dataset import ProceduralDataset
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import extract_answer as _rg_extract_answer

from ...models import chat_prompt_ids
from ..config.task import EVAL_SEED_OFFSET, SYSTEM_PROMPT, TaskConfig, reward_specs

FEW_SHOT: list[tuple[str, str]] = [
    ("What is 7 - 9?", "7 - 9 = -2. <answer>-2</answer>"),
    ("How many legs do 3 birds have?", "A bird has 2 legs, so 3 birds have 3 * 2 = 6 legs. <answer>6</answer>"),
]
"""(question, reply) demonstrations put before every question as earlier chat turns. The instruction alone does not
make SmolLM2-135M-Instruct write ``<answer>`` tags (docs/default_task.md); these two turns do. They are part of the
prompt, which every rollout of a group shares, so they cost one prefix forward."""

_SHOWN_TASKS = 30  # how many known task names an "unknown task" error lists


def known_tasks() -> list[str]:
    """Names of all datasets registered in reasoning-gym, sorted."""
    return sorted(DATASETS)


def load_task(cfg: TaskConfig, hold_out: bool = True) -> tuple[ProceduralDataset, ProceduralDataset]:
    """Build the (train, eval) datasets of ``cfg``. ``hold_out`` False (evaluation off): a ``task.dataset`` file
    holds no row out (`load_prompt_file`).

    Both splits come from the same generator with different seeds (``seed`` and ``seed + EVAL_SEED_OFFSET``), so
    they differ, but a small question space repeats: with the default task, 19 of the 64 held-out questions also
    occur among the 512 training ones (the 0..10 half has only 242 distinct questions).

    Raises:
        ValueError: unknown task name (the message lists known names and close matches); a ``config`` key the
            dataset's config class does not have, or ``size``/``seed`` given in ``config`` (the message names it);
            a config value the dataset's own validation rejects.
    """
    if cfg.dataset is not None:
        return load_prompt_file(cfg, hold_out)
    if cfg.name not in DATASETS:
        raise ValueError(_unknown_task_message(cfg.name))
    _check_config_keys(cfg.name, cfg.dataset_kwargs())
    return _create(cfg, cfg.size, cfg.seed), _create(cfg, cfg.held_out_size(), cfg.seed + EVAL_SEED_OFFSET)


def load_prompt_file(cfg: TaskConfig, hold_out: bool = True) -> tuple[list[dict], list[dict]]:
    """(train items, held-out items) of cfg.dataset (and cfg.eval_dataset; without one, the last
    `cfg.held_out_size(rows)` rows are held out, none when `hold_out` is False). Each item: every column of its row,
    `question` = the prompt column, `answer` = the answer column. The file is read offline with Hugging Face
    ``datasets``; a row's ``task.prompt_column`` is a plain prompt (str) or a conversation (a list of {"role",
    "content"} messages), and every other column is kept and reaches the reward functions by name.

    Raises FileNotFoundError (no such file), ValueError: an unknown format, a missing column (naming the columns
    found; the answer column is required only when set away from its default, or by a reward that needs it), a
    prompt that is empty or not text, a conversational prompt whose messages are not {role, content} dicts, an
    answer that is neither a string nor a number (`cells.check_columns`: naming the file, row and column), or
    nothing to train on."""
    graded = any(spec in ("task", "math_verify") for spec in reward_specs(cfg.reward))
    needs_answer = cfg.answer_column is not None and (cfg.answer_column != "answer" or graded)
    required = (cfg.prompt_column, *((cfg.answer_column,) if needs_answer else ()))
    hint = "set --task.prompt_column / --task.answer_column to the file's column names"
    answers = (cfg.answer_column,) if needs_answer and graded else ()  # a user's reward takes any column type
    rows = [_item(row, cfg) for row in checked_rows(cfg.dataset, "task.dataset", required, hint, answers)]
    if cfg.eval_dataset is not None:
        held_out = [_item(row, cfg) for row in checked_rows(cfg.eval_dataset, "task.eval_dataset", required, hint,
                                                            answers)]
        train = rows
    else:
        cut = max(len(rows) - cfg.held_out_size(len(rows)), 0) if hold_out else len(rows)
        train, held_out = rows[:cut], rows[cut:]
        if hold_out and cfg.eval_size is None and not held_out:
            raise ValueError(f"task.dataset {cfg.dataset} has {len(rows)} rows, too few to hold one in ten out for "
                             "evaluation (task.eval_size null): set task.eval_size, give task.eval_dataset, or turn "
                             "evaluation off (train.eval_steps -1)")
        if not train:
            raise ValueError(f"task.dataset {cfg.dataset} has {len(rows)} rows, all held out (task.eval_size="
                             f"{cfg.eval_size}): lower task.eval_size, give task.eval_dataset, or turn evaluation off "
                             "(train.eval_steps -1)")
    return train, held_out


def checked_rows(path, field: str, required: tuple[str, ...], hint: str, answers: tuple[str, ...]) -> list[dict]:
    """The rows of a prompt file (`datafiles.read_rows`), the prompt column text and the answer columns strings or
    numbers (`cells.check_columns`)."""
    from .cells import check_columns
    from .datafiles import read_rows

    rows = read_rows(path, field, required, hint)
    check_columns(rows, f"{field} {path}", text=required[:1], answers=answers)
    return [row for _, row in rows]


def _item(row: dict, cfg: TaskConfig) -> dict:
    item = dict(row)
    item["question"] = item[cfg.prompt_column]
    if cfg.answer_column is not None and cfg.answer_column in item:
        item["answer"] = item[cfg.answer_column]
    return item


def is_conversational(item: dict) -> bool:
    """Whether the item's prompt is a list of messages (TRL's conversational format)."""
    return isinstance(item["question"], list)


def prompt_token_ids(tokenizer, item: dict, cfg: TaskConfig) -> list[int]:
    """The prompt's token ids, as TRL's GRPOTrainer makes them (`_tokenize_prompts`): a plain prompt of task.dataset
    is tokenized as text, no chat template (`tokenizer(text).input_ids`); a conversational one, a plain one with
    task.system_prompt set (our option: it makes a conversation), and a reasoning-gym question go through the chat
    template (`models.chat_prompt_ids` of `prompt_messages`)."""
    if cfg.dataset is not None and not is_conversational(item) and not cfg.system_prompt:
        return list(tokenizer(item["question"]).input_ids)
    return chat_prompt_ids(tokenizer, prompt_messages(item, cfg))


def prompt_messages(item: dict, cfg: TaskConfig) -> list[dict]:
    """The chat messages that prompt the policy for `item`: a conversational prompt as it is (after
    cfg.system_prompt unless it opens with its own system message); a plain prompt of task.dataset as the user's
    message (after cfg.system_prompt when set); a reasoning-gym question through `build_messages`."""
    question = item["question"]
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    if isinstance(question, list):
        return (system if question[0]["role"] != "system" else []) + list(question)
    if cfg.dataset is not None:
        return system + [{"role": "user", "content": question}]
    return build_messages(question, cfg.system_prompt)


def build_messages(question: str, system_prompt: str | None = None) -> list[dict]:
    """Chat messages for one question: system (`system_prompt`, default SYSTEM_PROMPT), the FEW_SHOT turns (user,
    assistant), then user."""
    messages = [{"role": "system", "content": system_prompt or SYSTEM_PROMPT}]
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
