"""The `agent` section of the run config: `AgentConfig` (multi-turn environments, turns, limits, turn rewards).

Torch-free, so that the run config parses (and `--help` prints) before torch loads; `rl/agent/task.py` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...fields import check, choice, help_of

TurnRewardReduction = Literal["sum", "mean"]
BUILT_IN = ("calculator", "guess_number")


@dataclass
class AgentConfig:
    """Multi-turn training and evaluation (module docstring). Null `environment` = single-turn prompt -> completion."""

    environment: str | None = field(default=None, metadata=help_of(
        "calculator, guess_number, or 'package.module:Class' (rl.agent.environments.Environment); null = single-turn "
        "(the task's prompt, one completion)"))
    environment_kwargs: dict | None = field(default=None, metadata=help_of(
        "keyword arguments of the environment's class (guess_number: low, high; a user class: its own)"))
    max_turns: int = field(default=4, metadata=help_of("assistant replies per trajectory at most, >= 1"))
    max_context_tokens: int | None = field(default=None, metadata=help_of(
        "a trajectory's total tokens at most (prompt, replies and environment turns), > sampling.max_new_tokens: a "
        "reply is started only when sampling.max_new_tokens more tokens fit; null = the model's "
        "max_position_embeddings"))
    max_tool_output_tokens: int | None = field(default=256, metadata=help_of(
        "tokens of one tool message at most, >= 1, cut with a marker; null = no cut"))
    tool_timeout_s: float = field(default=5.0, metadata=help_of(
        "seconds a calculator tool call may run, > 0; past it the model reads an error (a user ToolEnvironment takes "
        "its own timeout_s in environment_kwargs)"))
    turn_reward_weight: float = field(default=1.0, metadata=help_of(
        "weight of the per-turn rewards in a trajectory's reward: final + weight x reduction(turn rewards)"))
    turn_reward_reduction: TurnRewardReduction = field(default="sum", metadata=help_of(
        "sum or mean of a trajectory's per-turn rewards (0 when it has none)"))

    def __post_init__(self):
        choice("agent.turn_reward_reduction", self.turn_reward_reduction, TurnRewardReduction)
        check("agent.max_turns", self.max_turns >= 1, ">= 1", self.max_turns)
        if self.max_context_tokens is not None:
            check("agent.max_context_tokens", self.max_context_tokens >= 1, ">= 1 (or null)", self.max_context_tokens)
        if self.max_tool_output_tokens is not None:
            check("agent.max_tool_output_tokens", self.max_tool_output_tokens >= 1, ">= 1 (or null)",
                  self.max_tool_output_tokens)
        check("agent.tool_timeout_s", self.tool_timeout_s > 0, "> 0 seconds", self.tool_timeout_s)
        if self.environment is not None and self.environment not in BUILT_IN and ":" not in self.environment:
            raise ValueError(f"agent.environment={self.environment!r} is not valid; use {', '.join(BUILT_IN)} or "
                             "'package.module:Class'")
