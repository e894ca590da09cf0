"""Multi-turn rollouts with tree sampling across turns: trajectories that share their earlier turns.

For one dataset item, the environment's opening messages start the conversation. Turn t then samples
`turn_branching[t]` assistant replies (1 past the list; an entry may be a (depth, factor) schedule that also forks
inside the turn, `decode.config.turn_schedule`) from the conversation so far; each reply that called for an answer gets
the environment's messages (`environments.Environment.step`), and its conversation goes on to turn t + 1. So with
turn_branching (2, 4), 2 first replies are each continued 4 ways after their tool result: up to 8 trajectories,
which share the prompt, and in fours their first turn. The ids are built by `conversation.Conversation` (assistant
turns as sampled, environment turns as the template's delta), so shared turns are the same ids and
`tree.RolloutTree` shares their nodes. Sampling goes turn by turn across a step's items
(`sample_trajectories_turnwise`), so the shared history is never run again; `Limits` says when a trajectory ends.
"""

from __future__ import annotations

import copy
import math
import numbers
import time
from dataclasses import dataclass, field

import torch

from ...decode.config import SamplingConfig, turn_schedule
from ...decode.turns import InProcessTurns
from ..agent.conversation import Conversation, TemplateNotPrefixStableError
from ..agent.environments import TRUNCATED, Environment
from ..data.cells import check_messages


class ItemError(ValueError):
    """A dataset item that cannot start or go on: the environment's `reset`, `step` or `final_reward` raised, or the
    opening messages leave no room for a reply under the context limit (the trainer skips the item). The message
    names the item."""


@dataclass
class Trajectory:
    """One multi-turn rollout: its conversation (ids, loss mask, messages), the sampler's logprob of each ids
    position (0.0 outside assistant turns), per-turn rewards, the final reward, and counts for the metrics
    (`tool_calls` and `tool_errors` count the calls whose results entered the conversation)."""

    conversation: Conversation
    logprobs: list[float]
    turn_rewards: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: bool = False
    ended_by: str = "done"  # done, truncated, end_of_sequence, max_turns or context


@dataclass
class Limits:
    """When a trajectory stops growing: assistant replies (>= 1), total tokens (None = no limit), and the tokens one
    tool message may add (None = no cut).

    A trajectory ends when the environment says done (or answers with no message), its reply was cut at
    sampling.max_new_tokens (no end-of-turn: `truncated`), its reply ended on an EOS id other than the template's end
    of turn (the tokenizer's EOS: `end_of_sequence`, e.g. Qwen's <|endoftext|>), it reached `max_turns` replies, or
    its next reply could pass `max_context_tokens` (the environment's answer that would not fit is dropped, so the
    trajectory ends with its last reply). A tool message longer than `max_tool_output_tokens` is cut to that many
    tokens with a marker before it enters the conversation."""

    max_turns: int = 4
    max_context_tokens: int | None = None
    max_tool_output_tokens: int | None = None

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")


@torch.no_grad()
def sample_trajectories(model, tokenizer, env: Environment, item: dict, turn_branching: tuple,
                        config: SamplingConfig, eos_token_ids, generator: torch.Generator | None = None,
                        max_turns: int = 4, max_context_tokens: int | None = None,
                        max_tool_output_tokens: int | None = None, timings: dict | None = None) -> list[Trajectory]:
    """The trajectories of one `item`, sampled in this process (`turns.InProcessTurns`, every reply of a turn in one
    decoding loop, all drawing from `generator`), at most the product of the turn_branching factors
    (`sampling.SamplingConfig.turn_branching`: ints or (depth, factor) schedules), in the order of
    `sample_trajectories_turnwise`.

    timings: when given, timings["env_s"] accumulates the seconds spent in the environment (reset, step,
    final_reward), the rest of the call being the model's. Raises ItemError (reset, step or final_reward failed, or
    the opening leaves no room for a reply), ValueError for max_turns < 1."""
    limits = Limits(max_turns, max_context_tokens, max_tool_output_tokens)
    turns = InProcessTurns(model, config, eos_token_ids, lambda k, path: generator)
    done, errors = sample_trajectories_turnwise(turns, tokenizer, env, [item], turn_branching, config, limits, timings)
    if errors:
        raise ItemError(errors[0])
    return done[0]


def sample_trajectories_turnwise(sample_turn, tokenizer, env: Environment, items: list[dict], turn_branching: tuple,
                                 config: SamplingConfig, limits: Limits, timings: dict | None = None
                                 ) -> tuple[dict[int, list[Trajectory]], list[str]]:
    """Every item's trajectories turn by turn across the items: at each turn, every trajectory still going asks for
    its replies in ONE call `sample_turn([(conversation ids, {generated depth: fan-out}), ...], [(item index, branch
    path), ...])` -> per request, its `Sample`s (`decode.turns.InProcessTurns`, or `vllm.sampling.sample_trees`: all in
    flight together; the server's prefix cache holds the shared turns, so a turn costs its new tokens). A request's
    branch path is its parent's plus the index of its reply among the parent's. Trajectories end by `limits`; each
    item's are listed in the lexicographic order of their branch paths. With a template that renders tools itself,
    the environment's `template_tools` (JSON schemas) go to the template.

    Returns ({item index: its trajectories} for the items that did not fail, the failed items' ItemError
    messages); the sampler's errors (VLLMError) propagate."""
    clock = _Clock(timings)
    tools = getattr(env, "template_tools", None)
    live, done, errors = [], {}, {}  # live: (item, branch path, trajectory) still going
    for k, item in enumerate(items):
        try:
            start = _opening(env, item, tokenizer, config, limits, clock, tools)
        except ItemError as e:
            errors[k] = str(e)
            continue
        live.append((k, (), Trajectory(start, [0.0] * len(start.ids))))
        done[k] = []
    while live:
        replies = sample_turn([(t.conversation.ids, turn_schedule(turn_branching, t.turns)) for _, _, t in live],
                              [(k, path) for k, path, _ in live])
        going = []
        for (k, path, parent), samples in zip(live, replies, strict=True):
            if k in errors:
                continue
            try:
                for j, sample in enumerate(samples):
                    child = _replied(parent, sample, tokenizer)
                    if _next(child, sample.truncated, env, items[k], tokenizer, limits, config, clock, tools) is None:
                        _final_reward(child, env, items[k], clock)
                        done[k].append((path + (j,), child))
                    else:
                        going.append((k, path + (j,), child))
            except ItemError as e:
                errors[k] = str(e)
        live = [x for x in going if x[0] not in errors]
    return ({k: [t for _, t in sorted(v, key=lambda pt: pt[0])] for k, v in done.items() if k not in errors},
            list(errors.values()))


def _opening(env: Environment, item: dict, tokenizer, config: SamplingConfig, limits: Limits, clock, tools
             ) -> Conversation:
    """The item's conversation after the environment's opening messages; ItemError when reset fails or they leave
    no room for a reply under the context limit."""
    opening = _checked(_call(clock, env.reset, item), env, "reset", item)
    start = _render(lambda: Conversation.start(tokenizer, opening, tools=tools), env, "reset", item)
    if len(start.ids) + config.max_new_tokens > (limits.max_context_tokens or math.inf):
        raise ItemError(f"the opening messages of item {_short(item)} take {len(start.ids)} tokens: with "
                        f"sampling.max_new_tokens ({config.max_new_tokens}) more than the context limit "
                        f"({limits.max_context_tokens})")
    return start


def _replied(parent: Trajectory, sample, tokenizer) -> Trajectory:
    """A copy of `parent` with the sampled reply appended as its next assistant turn."""
    child = copy.deepcopy(parent)
    text = tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
    child.conversation.add_assistant(sample.completion_ids, text)
    child.logprobs += sample.logprobs
    child.turns += 1
    return child


def _final_reward(child: Trajectory, env: Environment, item: dict, clock) -> None:
    child.reward = _number(_call(clock, env.final_reward, child.conversation.messages, item), env, "final_reward",
                           item)


def _next(child: Trajectory, truncated: bool, env: Environment, item: dict, tokenizer, limits: Limits,
          config: SamplingConfig, clock, tools):
    """Whether `child` goes on after its last reply: None when it ends (recorded in `ended_by`), else True after
    the environment's messages were appended."""
    if truncated:
        child.truncated, child.ended_by = True, "truncated"
        return None
    if child.conversation.ids[-1] != tokenizer.eos_token_id:  # another EOS id (Qwen's <|endoftext|>): no turn follows
        child.ended_by = "end_of_sequence"
        return None
    response = _call(clock, env.step, child.conversation.messages, item)
    if response.reward is not None:
        child.turn_rewards.append(_number(response.reward, env, "step", item))
    if response.done or not response.messages:
        child.ended_by = "done"
        return None
    if child.turns >= limits.max_turns:
        child.ended_by = "max_turns"
        return None
    before = len(child.conversation.ids)
    messages = [_cut(m, tokenizer, limits.max_tool_output_tokens)
                for m in _checked(response.messages, env, "step", item)]
    _render(lambda: child.conversation.add_environment(tokenizer, messages, tools=tools), env, "step", item)
    if len(child.conversation.ids) + config.max_new_tokens > (limits.max_context_tokens or math.inf):
        child.ended_by = "context"
        child.conversation.ids = child.conversation.ids[:before]  # the environment's reply is not trained on
        child.conversation.loss_mask = child.conversation.loss_mask[:before]
        child.conversation.messages = child.conversation.messages[: -len(messages)]
        return None
    child.logprobs += [0.0] * (len(child.conversation.ids) - before)
    child.tool_calls += response.tool_calls  # counted once the model reads their results
    child.tool_errors += response.tool_errors
    return True


def _call(clock, method, *args):
    """env.reset, env.step or env.final_reward, timed; any exception becomes an ItemError naming the environment and
    the item (it is skipped)."""
    try:
        with clock:
            return method(*args)
    except Exception as e:  # noqa: BLE001 (a user environment's failure skips its item, never the run)
        raise ItemError(f"the environment {_name(method)}'s {method.__name__} failed for item {_short(args[-1])}: "
                        f"{type(e).__name__}: {e}") from e


def _checked(messages, env, method: str, item: dict) -> list[dict]:
    """`messages` from env.`method`, checked (`data.cells.check_messages`); an ItemError naming the environment,
    the item and the field when they cannot be rendered."""
    try:
        check_messages(messages, f"{method}'s")
    except ValueError as e:
        raise ItemError(f"the environment {type(env).__name__}'s {e}, for item {_short(item)}") from e
    return messages


def _render(add, env, method: str, item: dict):
    """`add()` (the chat template rendering env.`method`'s messages); a template that fails on them is an
    ItemError naming the environment and the item (a template that is not prefix-stable stays an error of the
    run: every item would fail)."""
    try:
        return add()
    except TemplateNotPrefixStableError:
        raise
    except Exception as e:  # noqa: BLE001 (what the template cannot render skips the item, never the run)
        raise ItemError(f"the chat template could not render the environment {type(env).__name__}'s {method} "
                        f"messages for item {_short(item)}: {type(e).__name__}: {e}") from e


def _number(value, env, method: str, item: dict) -> float:
    """A reward from env.`method`, as a float; a value that is not a finite number is an ItemError (the item is
    skipped, as when the environment raises)."""
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ItemError(f"the environment {type(env).__name__}'s {method} gave the reward {value!r} for item "
                        f"{_short(item)}: a reward is a finite number")
    return float(value)


def _name(method) -> str:
    owner = getattr(method, "__self__", None)
    return type(owner).__name__ if owner is not None else "?"


def _cut(message: dict, tokenizer, max_tokens: int | None) -> dict:
    """A tool message whose content is longer than `max_tokens` tokens, cut there with the TRUNCATED marker."""
    if max_tokens is None or message.get("role") != "tool":
        return message
    ids = tokenizer(str(message["content"]), add_special_tokens=False).input_ids
    if len(ids) <= max_tokens:
        return message
    return {**message, "content": tokenizer.decode(ids[:max_tokens], skip_special_tokens=True) + TRUNCATED}


class _Clock:
    """Adds the seconds spent inside `with clock:` to timings["env_s"] (nothing when timings is None)."""

    def __init__(self, timings: dict | None):
        self.timings = timings

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.timings is not None:
            self.timings["env_s"] = self.timings.get("env_s", 0.0) + time.perf_counter() - self.t0


def _short(item: dict) -> str:
    text = repr(item)
    return text if len(text) <= 120 else text[:117] + "..."
