"""Multi-turn environments: what answers an assistant turn (tool results, user feedback), when a trajectory ends,
and its reward. Small and explicit, after the `verifiers` package's MultiTurnEnv (`env_response`, `is_completed`,
a rubric) and TRL 1.16's tool calling (plain Python functions with docstrings as tools, `<tool_call>` JSON calls).

`Environment` is what a multi-turn task implements (reset, step, final_reward and optional hooks).
`ToolEnvironment` runs plain functions as tools, every failure becoming the tool's reply to the model, never an
exception of the run. `load_environment("package.module:Class")` builds a user environment. `calculator(reward_fn)`
is the built-in tool task: the default task's arithmetic with a `calculate` tool; `GuessNumber` the built-in
feedback task (higher / lower replies).
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from transformers.utils import get_json_schema

from ..data.rewards import import_from_cwd
from .conversation import template_renders_tools

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TRUNCATED = "\n[output truncated]"


@dataclass
class EnvResponse:
    """The environment's answer to an assistant turn: its messages (role "tool" or "user"; none when done), whether
    the trajectory is done, and an optional per-turn reward. `tool_calls` and `tool_errors` count this turn's."""

    messages: list[dict]
    done: bool = False
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(Protocol):
    """What a multi-turn task implements:

        env.reset(item)            -> the opening messages (system, user) for a dataset item
        env.step(messages, item)   -> EnvResponse(messages, done, reward): after each assistant turn
        env.final_reward(messages, item) -> float: once the trajectory is done
        env.bind(tokenizer)        (optional) called once with the policy's tokenizer before any reset
        env.template_tools         (optional) JSON schemas the chat template renders (transformers' `tools=`)
        env.items(n, seed)         (optional) the environment's own dataset items; else the task's (`rl.agent`)
        env.scores_accuracy        (optional) True when final_reward is a success score in [0, 1]: the held-out
                                   score is then called an accuracy, else the mean reward

    The calls of different items interleave (a step resets all its items before any step, as the vLLM path steps
    every item's turn together), so an environment keeps what it knows of an item in the messages and the item, not
    on itself."""

    def reset(self, item: dict) -> list[dict]: ...

    def step(self, messages: list[dict], item: dict) -> EnvResponse: ...

    def final_reward(self, messages: list[dict], item: dict) -> float: ...


class ToolEnvironment:
    """Tools as plain Python functions with docstrings (their JSON schemas, transformers' `get_json_schema`, are
    described in the system prompt, which every template renders); the final reward is `reward(messages, item)`.

    A call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the assistant's text (the Hermes / Qwen
    format of transformers' tool-aware templates). A turn without a call ends the trajectory. Every failure becomes
    the tool's reply to the model, never an exception of the run: a tool that raises (its error text), a call that
    does not parse, an unknown tool, a tool that runs past `timeout_s`, an output longer than `max_output_chars`
    (cut, with a marker).

    Args:
        tools: functions with type hints and Google-style docstrings (transformers' tool convention).
        system_prompt: the task's instructions; the tool descriptions and the call format are appended.
        reward: (messages, item) -> float, the trajectory's final reward.
        timeout_s: seconds a tool call may run (> 0); past it the model reads an error. The call's thread cannot
            be killed and finishes in the background.
        max_output_chars: longest tool output returned (> 0), cut with a marker.
        examples: few-shot turns placed between the system prompt and the question (e.g. a worked tool call).
    Raises ValueError: no tools, two tools with one name, a tool without a docstring or type hints (naming it),
    or a bad limit.
    """

    def __init__(self, tools: list[Callable], system_prompt: str, reward: Callable[[list[dict], dict], float],
                 timeout_s: float = 5.0, max_output_chars: int = 2000, examples: list[dict] | None = None):
        if not tools:
            raise ValueError("ToolEnvironment needs at least one tool")
        if timeout_s <= 0 or max_output_chars <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) and max_output_chars ({max_output_chars}) must be > 0")
        self.tools: dict[str, Callable] = {}
        schemas = []
        for fn in tools:
            try:
                schemas.append(get_json_schema(fn))
            except Exception as e:  # noqa: BLE001 (transformers raises several types for one cause)
                raise ValueError(f"tool {getattr(fn, '__name__', fn)!r} needs type hints and a docstring with an Args "
                                 f"section (transformers' get_json_schema: {e})") from e
            name = schemas[-1]["function"]["name"]
            if name in self.tools:
                raise ValueError(f"two tools are named {name!r}")
            self.tools[name] = fn
        self.instructions, self.schemas = system_prompt, schemas
        self.template_tools: list[dict] | None = None  # the schemas, once `bind` found a template that renders them
        self.reward, self.timeout_s, self.max_output_chars = reward, timeout_s, max_output_chars
        self.examples = list(examples or [])

    def bind(self, tokenizer) -> None:
        """Let the tokenizer's chat template render the tools when it has tool support (transformers' `tools=`;
        `conversation.template_renders_tools`): the schemas then go to the template (`template_tools`) and leave the
        system prompt. Without it they stay described in the system prompt."""
        self.template_tools = self.schemas if template_renders_tools(tokenizer, self.schemas) else None

    @property
    def system_prompt(self) -> str:
        """The instructions, the tools' schemas unless the template renders them, and the call format."""
        listed = "" if self.template_tools else ("\n\nYou can call these tools:\n"
                                                 + "\n".join(json.dumps(s["function"]) for s in self.schemas))
        return (f"{self.instructions}{listed}\nTo call one, write <tool_call>{{\"name\": NAME, \"arguments\": "
                "{...}}</tool_call> and stop; its result comes back in the next message.")

    def reset(self, item: dict) -> list[dict]:
        """The system prompt with the tools, the few-shot examples, then the item's question as the user's message."""
        return [{"role": "system", "content": self.system_prompt}, *self.examples,
                {"role": "user", "content": item["question"]}]

    def step(self, messages: list[dict], item: dict) -> EnvResponse:
        """The tool results of the last assistant message's calls, one tool message each; done without a call."""
        calls = TOOL_CALL.findall(messages[-1]["content"])
        if not calls:
            return EnvResponse([], done=True)
        replies, errors = [], 0
        for raw in calls:
            name, content, failed = self.call(raw)
            errors += failed
            replies.append({"role": "tool", "name": name, "content": content})
        return EnvResponse(replies, tool_calls=len(calls), tool_errors=errors)

    def call(self, raw: str) -> tuple[str, str, bool]:
        """(tool name or "unknown", the text the model reads, whether the call failed) for one call's JSON."""
        try:
            call = json.loads(raw)
            name, arguments = call["name"], call.get("arguments", {})
            if not isinstance(arguments, dict):
                raise TypeError("arguments must be a JSON object")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            return "unknown", f"error: malformed tool call ({e}); write {{\"name\": ..., \"arguments\": {{...}}}}", True
        if name not in self.tools:
            return str(name), f"error: unknown tool {name!r}; the tools are {', '.join(self.tools)}", True
        result: dict = {}

        def run():
            try:
                result["value"] = str(self.tools[name](**arguments))
            except Exception as e:  # noqa: BLE001 (the model reads the tool's error, its str() failing included)
                result["error"] = f"{type(e).__name__}: {e}"

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            return name, f"error: {name} did not answer within {self.timeout_s:g} s", True
        if "error" in result:
            return name, f"error: {result['error']}", True
        text = result["value"]
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + TRUNCATED
        return name, text, False

    def final_reward(self, messages: list[dict], item: dict) -> float:
        return float(self.reward(messages, item))


def load_environment(spec: str, **kwargs) -> Environment:
    """A user environment from "package.module:Class" (imported with the current folder on the path), built with
    `kwargs`. Raises ValueError naming the spec when it does not import, or the class lacks reset / step /
    final_reward."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"environment {spec!r} must look like 'package.module:Class'")
    try:
        cls = getattr(import_from_cwd(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"environment {spec!r} does not import: {e}") from e
    missing = [m for m in ("reset", "step", "final_reward") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment {spec!r} lacks {', '.join(missing)} (rl.agent.environments.Environment)")
    return cls(**kwargs) if inspect.isclass(cls) else cls


# -- built-in: arithmetic with a calculator ------------------------------------------------------------------------

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> float:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

    Args:
        expression: the expression, e.g. "12 * (3 + 4)"
    """
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {ast.dump(node)[:40]}")

    result = value(ast.parse(expression, mode="eval").body)
    return int(result) if float(result).is_integer() else result


CALCULATOR_EXAMPLE = [  # one worked call: a 135M model does not call a tool, nor tag its answer, zero-shot
    {"role": "user", "content": "What is 12 * 7?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculate", "arguments": {"expression": "12 * 7"}}'
                                     "</tool_call>"},
    {"role": "tool", "name": "calculate", "content": "84"},
    {"role": "assistant", "content": "12 * 7 = 84. <answer>84</answer>"},
]
CALCULATOR_PROMPT = ("Think briefly. You may use the calculator tool. Then give the final answer inside "
                     "<answer></answer> tags.")


def calculator(reward_fn, **kwargs) -> ToolEnvironment:
    """The built-in tool task: the default task's questions with a `calculate` tool; the final reward is the task's
    verifier (`reward_fn`, TRL's signature: `rewards.make_reward`) on the last assistant message. `kwargs` go to
    `ToolEnvironment` (timeout_s, max_output_chars)."""
    def reward(messages: list[dict], item: dict) -> float:
        return float(reward_fn(completions=[messages[-1]["content"]], answer=[item["answer"]],
                               metadata=[item.get("metadata", {})])[0])

    env = ToolEnvironment([calculate], CALCULATOR_PROMPT, reward, examples=CALCULATOR_EXAMPLE, **kwargs)
    env.scores_accuracy = True  # the task's verifier: a score in [0, 1]
    return env


# -- built-in: guess the number with higher / lower replies ---------------------------------------------------------

GUESS_PROMPT = ("I am thinking of a whole number from {low} to {high}. Guess it: reply with your guess inside "
                "<answer></answer> tags. I will say whether the number is higher or lower.")
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


class GuessNumber:
    """The built-in feedback task: the item's `target` (a whole number in [low, high]) is guessed over the turns; the
    user replies "higher", "lower" or, on a reply without a tagged number, how to answer. Done when the guess is
    right. Final reward 1.0 for a right guess, else 0.0; per-turn reward None. The opening messages hold one worked
    game (1 to 10)."""

    scores_accuracy = True  # the final reward is 1 for a right guess, else 0

    def __init__(self, low: int = 1, high: int = 10):
        if low >= high:
            raise ValueError(f"GuessNumber needs low < high, got {low} and {high}")
        self.low, self.high = low, high

    def items(self, n: int, seed: int = 0) -> list[dict]:
        """`n` items {"question", "target"} with targets drawn uniformly by `seed`."""
        import random

        rng = random.Random(seed)
        return [{"question": GUESS_PROMPT.format(low=self.low, high=self.high),
                 "target": rng.randint(self.low, self.high)} for _ in range(n)]

    def reset(self, item: dict) -> list[dict]:
        """One worked game (a 135M model does not tag a guess zero-shot), then the item's question."""
        example = GUESS_PROMPT.format(low=1, high=10)
        return [{"role": "user", "content": example}, {"role": "assistant", "content": "<answer>5</answer>"},
                {"role": "user", "content": "No, the number is higher than 5. Guess again."},
                {"role": "assistant", "content": "<answer>7</answer>"},
                {"role": "user", "content": "Right, it was 7. New game. " + item["question"]}]

    def step(self, messages: list[dict], item: dict) -> EnvResponse:
        guess = _guess(messages[-1]["content"])
        if guess is None:
            return EnvResponse([{"role": "user", "content": "Reply with one whole number inside <answer></answer> "
                                                            "tags."}])
        if guess == item["target"]:
            return EnvResponse([], done=True)
        hint = "higher" if item["target"] > guess else "lower"
        return EnvResponse([{"role": "user", "content": f"No, the number is {hint} than {guess}. Guess again."}])

    def final_reward(self, messages: list[dict], item: dict) -> float:
        return float(_guess(messages[-1]["content"]) == item["target"])


def _guess(text: str) -> int | None:
    found = ANSWER.findall(text)
    return int(found[-1]) if found else None
