"""Reward functions and their combination, with TRL's conventions.

A reward function is called with keyword arguments only (TRL ``GRPOTrainer``): ``prompts`` (list, B),
``completions`` (list[str], B), ``completion_ids`` (list[list[int]], B) and every dataset column as a list of B
values (e.g. ``answer``, ``metadata``). It returns a list of B rewards (float), where ``None`` means "this function
gives no reward for that sample". Functions should accept ``**kwargs`` so that unused columns are ignored.

:func:`compute_rewards` combines several functions exactly as TRL's ``GRPOTrainer._calculate_rewards`` does: one
column per function in a [B, n_funcs] float32 tensor with None -> NaN, then ``nansum(per_func * weights, dim=1)``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import numbers
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from reasoning_gym.dataset import ProceduralDataset

from .tasks import TaskConfig, extract_answer, is_conversational, prompt_messages, reward_specs


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something other than a list with one reward per completion.
    `traceback`: the raised exception's formatted traceback ("" when the function returned something wrong), kept
    as text so that it crosses processes (the sampler process, the ranks) with the message."""

    def __init__(self, message: str, traceback: str = ""):
        super().__init__(message)
        self.traceback = traceback


@dataclass
class RewardFunctions:
    """The reward functions of a run and their weights (TRL's `reward_funcs` and `reward_weights`): a completion's
    reward is the weighted sum (`compute_rewards`), and each function is logged as rewards/<name>/mean."""

    funcs: list[Callable]
    weights: list[float]

    @property
    def names(self) -> list[str]:
        return [getattr(f, "__name__", type(f).__name__) for f in self.funcs]


def completion_text(completion) -> str:
    """A completion as text: itself (plain), or the content of its last message (conversational, TRL's
    [{"role": "assistant", "content": ...}])."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def reasoning_gym_reward(dataset: ProceduralDataset) -> Callable[..., list[float]]:
    """A reward function (named ``reasoning_gym``) grading with ``dataset.score_answer``.

    The returned function needs the dataset columns ``answer`` (gold answer strings) and ``metadata`` (dicts), as in
    reasoning-gym items. Reward per sample: ``dataset.score_answer(extract_answer(completion), item)`` in [0, 1]
    (1 = correct, partial credit for some tasks); a completion without ``<answer>`` tags scores 0.0.
    """

    def reward(completions: list, answer: list[str], metadata: list[dict], **kwargs) -> list[float]:
        return [
            float(dataset.score_answer(extract_answer(completion_text(c)), {"answer": a, "metadata": m}))
            for c, a, m in zip(completions, answer, metadata, strict=True)
        ]

    reward.__name__ = "reasoning_gym"
    return reward


def math_verify_reward(prompts, completions, completion_ids, answer, **kwargs) -> list[float | None]:
    """Math equivalence reward with math-verify (as TRL's ``trl.rewards.accuracy_reward``).

    For each sample, the gold ``answer`` (str) and the completion's ``<answer>`` content (the whole completion if
    it has no tags) are parsed with ``math_verify.parse`` and compared with ``math_verify.verify``, so ``\\frac{1}{2}``
    and ``0.5`` match. Returns 1.0 or 0.0 per sample, or None where the gold answer cannot be parsed (TRL skips such
    samples the same way). Requires the ``math-verify`` package; timeouts (signal-based) apply only in the main thread.
    """
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    rewards: list[float | None] = []
    for completion, gold in zip(map(completion_text, completions), answer, strict=True):
        gold_parsed = parse(str(gold), parsing_timeout=timeout)
        if not gold_parsed:
            rewards.append(None)
            continue
        tagged = extract_answer(completion)
        predicted = parse(completion if tagged is None else tagged, parsing_timeout=timeout)
        rewards.append(float(verify(gold_parsed, predicted, timeout_seconds=timeout)))
    return rewards


def load_reward_function(spec: str) -> Callable:
    """Import a reward function from ``"package.module:function"``.

    The module is imported with the current folder on the path (`import_from_cwd`).

    Raises:
        ValueError: ``spec`` is not of the form ``module:attribute``.
        ImportError: the module cannot be imported.
        AttributeError: the module has no such attribute.
        TypeError: the attribute is not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(f"reward function spec {spec!r} must look like 'package.module:function'")
    try:
        module = import_from_cwd(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_name!r} of reward function spec {spec!r}: {e}") from e
    try:
        func = getattr(module, attr)
    except AttributeError as e:
        raise AttributeError(f"module {module_name!r} has no attribute {attr!r} (reward function spec {spec!r})") from e
    if not callable(func):
        raise TypeError(f"{spec!r} is a {type(func).__name__}, not a callable reward function")
    return func


def import_from_cwd(module_name: str):
    """`importlib.import_module`, with the current folder on the path while it imports (as `python -m` has it, and
    as TRL's scripts find a reward module beside the config): `my_rewards:fn` works without PYTHONPATH. The path is
    restored afterwards; the module stays imported. A path to a .py file (what a run's saved config holds for a
    module of the folder it started in: `config.resolve`) is loaded from that file, once."""
    if module_name.endswith(".py"):
        return _import_file(Path(module_name))
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        if added:
            sys.path.remove(cwd)


def _import_file(path: Path):
    """The module of the Python file `path`, imported once (kept in sys.modules under its stem, as a plain import
    from its folder would name it, unless another module holds that name)."""
    if not path.is_file():
        raise ImportError(f"no such file {path}")
    known = sys.modules.get(path.stem)
    if known is not None and Path(getattr(known, "__file__", "") or "").resolve() == path.resolve():
        return known
    spec = importlib.util.spec_from_file_location(path.stem if known is None else f"branchreplay_user.{path.stem}",
                                                  path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def with_timeout(func: Callable, timeout_s: float, field: str = "task.reward_timeout_s", where: str = "") -> Callable:
    """`func`, interrupted with TimeoutError, naming the function, `field` (the setting of `timeout_s`) and `where`
    (e.g. " on rank 1"), when a call has not returned after `timeout_s` seconds.

    The call runs in the caller's thread, so that a reward function may use signals itself (math-verify's default
    timeouts, a sandbox's SIGALRM). In the main thread a timer sends SIGUSR1 to it at the limit, and a handler
    installed for the call raises TimeoutError there: a Python loop or a blocking call (sleep, a socket read) is
    interrupted; C code that never returns to Python is not. In another thread (signals reach only the main
    thread) the call runs without a limit. The previous SIGUSR1 handler is back after every call."""

    @functools.wraps(func)
    def timed(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return func(*args, **kwargs)
        done, delivered, fired = [False], threading.Event(), threading.Event()

        def on_timeout(signum, frame):
            delivered.set()
            if not done[0]:
                raise TimeoutError(f"reward function {getattr(func, '__name__', repr(func))!r} did not return "
                                   f"within {field}={timeout_s:g} s{where}")

        def fire():
            fired.set()
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

        previous = signal.signal(signal.SIGUSR1, on_timeout)
        timer = threading.Timer(timeout_s, fire)
        timer.daemon = True
        timer.start()
        try:
            return func(*args, **kwargs)
        finally:
            done[0] = True
            timer.cancel()
            timer.join()
            if fired.is_set():  # sent as the call ended: let its handler run (a no-op now) before restoring
                delivered.wait(5.0)
            signal.signal(signal.SIGUSR1, previous)

    return timed


def make_reward(spec: str, dataset: ProceduralDataset | None, timeout_s: float | None = None) -> Callable:
    """The reward function named by one spec of `TaskConfig.reward`: "task" -> `reasoning_gym_reward(dataset)`,
    "math_verify" -> `math_verify_reward`, else `load_reward_function(spec)`, called under `with_timeout(timeout_s)`
    when given (the built-in two bound their own time: math-verify's timeouts). Raises ValueError naming the field
    when that fails, or for "task" without a reasoning-gym dataset (the user's own task.dataset)."""
    if spec == "task":
        if not isinstance(dataset, ProceduralDataset):
            raise ValueError("task.reward='task' grades with a reasoning-gym dataset's score_answer; with task.dataset "
                             "use 'math_verify' or 'package.module:function'")
        return reasoning_gym_reward(dataset)
    if spec == "math_verify":
        return math_verify_reward
    try:
        func = load_reward_function(spec)
    except (ValueError, ImportError, AttributeError, TypeError) as e:
        raise ValueError(f"task.reward={spec!r}: {e}; accepted: 'task', 'math_verify' or "
                         "'package.module:function'") from e
    return func if timeout_s is None else with_timeout(func, timeout_s)


def make_rewards(cfg: TaskConfig, dataset) -> RewardFunctions:
    """Every function of cfg.reward (a comma list of specs, `make_reward`, the user's own under
    cfg.reward_timeout_s) with cfg.reward_weights (default 1.0 each), each checked to take what the items of
    `dataset` supply (`check_arguments`). Raises ValueError as `make_reward` and `check_arguments`."""
    specs = reward_specs(cfg.reward)
    funcs = [make_reward(spec, dataset, cfg.reward_timeout_s) for spec in specs]
    if len(dataset):  # a list of items or a reasoning-gym dataset: every call passes the keys of each item
        for spec, func in zip(specs, funcs, strict=True):
            check_arguments(func, dataset[0], f"task.reward {spec!r}", _data_name(cfg))
    return RewardFunctions(funcs, list(cfg.reward_weights or [1.0] * len(funcs)))


SUPPLIED = ("prompts", "completions", "completion_ids")
"""The arguments every reward call supplies besides the item's columns (TRL's, but for its trainer_state)."""


def check_arguments(func: Callable, item: dict, name: str, data: str) -> None:
    """Refuse, before any model loads, a reward function with a required argument that no call would supply: not
    one of `SUPPLIED` and not a column of `item` (one item of the data, whose keys every call passes), or
    positional-only. `name` names the function (the config field and spec), `data` the data (e.g. "task.dataset
    x.jsonl").

    Raises:
        ValueError: naming the function, the argument, the data's columns and the fixes.
    """
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return
    columns = [c for c in item if c not in ("question",)]
    for p in parameters:
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise ValueError(f"{name} takes {p.name!r} positionally only, but rewards are called with keyword "
                             "arguments (TRL's): make it a normal parameter")
        required = p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
        if required and p.name not in SUPPLIED and p.name not in item:
            raise ValueError(f"{name} needs the argument {p.name!r}, which no column of {data} supplies (its columns: "
                             f"{', '.join(columns)}; every call also passes {', '.join(SUPPLIED)}): add the column, "
                             f"map it (task.prompt_column / task.answer_column), or give {p.name!r} a default")


def _data_name(cfg: TaskConfig) -> str:
    return f"task.dataset {cfg.dataset}" if cfg.dataset is not None else f"task {cfg.name!r}"


def compute_rewards(
    funcs: list[Callable],
    weights: list[float] | None,
    *,
    prompts: list,
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list],
) -> torch.Tensor:
    """Weighted sum of several reward functions, per sample. Returns a float32 tensor of shape [B].

    Semantics of TRL ``GRPOTrainer._calculate_rewards``: function i fills column i of a [B, n_funcs] tensor (None ->
    NaN); ``weights`` (default all 1.0, length n_funcs) multiply the columns; the result is ``nansum`` over functions,
    so a None is skipped and a sample with None from every function gets 0.0 (with a warning, as in TRL).

    Raises:
        ValueError: no functions, or ``weights`` of the wrong length.
        RewardFunctionError: a function raised (chained), or returned a non-list, a list whose length is not B, or
            a value that is neither a number nor None (a string "1.0" is refused, never read as a number).
    """
    per_func = reward_columns(funcs, weights, prompts=prompts, completions=completions,
                              completion_ids=completion_ids, columns=columns)
    return (per_func * torch.tensor(weights or [1.0] * len(funcs), dtype=torch.float32)).nansum(dim=1)


def reward_columns(funcs: list[Callable], weights: list[float] | None, *, prompts: list, completions: list,
                   completion_ids: list[list[int]], columns: dict[str, list]) -> torch.Tensor:
    """[B, n_funcs] float32: function i's rewards in column i, None -> NaN (`compute_rewards` sums them). Raises as
    `compute_rewards`; warns when every function gave None for a sample."""
    if not funcs:
        raise ValueError("compute_rewards needs at least one reward function")
    batch = len(completions)
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ValueError(f"{len(weights)} reward weights for {len(funcs)} reward functions")
    per_func = torch.empty(batch, len(funcs), dtype=torch.float32)
    for i, func in enumerate(funcs):
        name = getattr(func, "__name__", repr(func))
        try:
            out = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:
            raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__}: {e}",
                                      "".join(traceback.format_exception(e))) from e
        if not isinstance(out, list) or len(out) != batch:
            got = f"a list of length {len(out)}" if isinstance(out, list) else f"a {type(out).__name__}"
            raise RewardFunctionError(f"reward function {name!r} returned {got}; expected a list of length {batch}")
        wrong = next((k for k, r in enumerate(out) if not _is_reward(r)), None)
        if wrong is not None:
            value = out[wrong]
            raise RewardFunctionError(f"reward function {name!r} returned {value!r} (a {type(value).__name__}) for "
                                      f"sample {wrong}; a reward is a number, or None for no reward (TRL's)")
        per_func[:, i] = torch.tensor([float("nan") if r is None else float(r) for r in out], dtype=torch.float32)
    if batch and torch.isnan(per_func).all(dim=1).any():
        rows = torch.isnan(per_func).all(dim=1).nonzero().flatten().tolist()
        warnings.warn(f"all reward functions returned None for samples {rows}; their reward is 0.0", stacklevel=2)
    return per_func


def _is_reward(value) -> bool:
    """None, or a real number: a Python or numpy one, or a one-element tensor (what TRL turns into a float)."""
    if value is None or isinstance(value, numbers.Real):
        return True
    return isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex()


def score(rewards, tokenizer, items: list[dict], samples: list[list], task: TaskConfig | None = None
          ) -> torch.Tensor:
    """[B] float32 rewards of the decoded completions, group-major (`score_columns`' weighted sum)."""
    total, _ = score_columns(rewards, tokenizer, items, samples, task)
    return total


def score_columns(rewards, tokenizer, items: list[dict], samples: list[list], task: TaskConfig | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] weighted-sum rewards, [B, n_funcs] each function's, NaN where it gave None) of the decoded completions,
    group-major. `rewards`: a `RewardFunctions` or one function. As TRL's GRPOTrainer: every item key is passed as a
    column; prompts are the dataset's (a user file's string or messages; a reasoning-gym question's chat
    messages); completions are strings, or [{"role": "assistant", "content": text}] for a conversational prompt."""
    rewards = rewards if isinstance(rewards, RewardFunctions) else RewardFunctions([rewards], [1.0])
    task = task or TaskConfig()
    expanded = [(item, s) for item, group in zip(items, samples, strict=True) for s in group]
    texts = [tokenizer.decode(s.completion_ids, skip_special_tokens=True) for _, s in expanded]
    per_func = reward_columns(
        rewards.funcs, rewards.weights,
        prompts=[item["question"] if task.dataset is not None else prompt_messages(item, task) for item, _ in expanded],
        completions=[[{"role": "assistant", "content": t}] if is_conversational(item) else t
                     for (item, _), t in zip(expanded, texts, strict=True)],
        completion_ids=[s.completion_ids for _, s in expanded],
        columns={key: [item[key] for item, _ in expanded] for key in items[0]},
    )
    return (per_func * torch.tensor(rewards.weights, dtype=torch.float32)).nansum(dim=1), per_func
