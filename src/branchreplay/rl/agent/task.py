"""Multi-turn agent tasks in a run (config section `agent`): which environment answers the assistant's turns, the
limits of a trajectory, how its per-turn rewards combine with the final one, and its metrics (the greedy held-out
evaluation is `run/evaluation.evaluate_agent`). The sampling itself is `trajectories.sample_trajectories_turnwise`;
the environments are `environments.py`.

    agent.environment: calculator     the default task's arithmetic with a `calculate` tool (the task's verifier)
                       guess_number   guess a number from 1 to 10 with higher / lower replies
                       pkg.mod:Class  a user environment (`environments.Environment`), built with environment_kwargs

A trajectory's reward is one scalar (`trajectory_reward`), so every algorithm's advantage estimator applies as in
single-turn training (verl's multi-turn rollouts do the same with their turn scores); groups are the trajectories of
one item, of any size. `load_agent_task` says where the items come from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...models import max_positions
from ..config.agent import AgentConfig
from ..config.task import EVAL_SEED_OFFSET, reward_specs
from ..data.rewards import make_reward
from ..data.tasks import load_task
from ..rollouts.trajectories import Trajectory
from .environments import GuessNumber, calculator, load_environment

if TYPE_CHECKING:
    from ..config import Config


def load_agent_task(config: Config) -> tuple:
    """(environment, train items, held-out items) of a run `config` (`rl.config.Config`) whose agent.environment
    is set. Raises ValueError for an environment that does not import or lacks a method (`load_environment`).

    Items: an environment with an `items(n, seed)` method brings its own (task.size of them for training,
    task.eval_size held out, the held-out ones seeded with task.seed + tasks.EVAL_SEED_OFFSET); the others take the
    task's reasoning-gym splits (`tasks.load_task`)."""
    a, task = config.agent, config.task
    hold_out = config.train.eval_steps >= 0  # with evaluation off, a task.dataset file holds no row out
    kwargs = dict(a.environment_kwargs or {})
    splits = None
    if a.environment == "calculator":
        if len(reward_specs(task.reward)) != 1:
            raise ValueError(f"agent.environment=calculator scores with one task.reward, got {task.reward!r}")
        splits = load_task(task, hold_out)
        env = calculator(make_reward(task.reward, splits[0]), timeout_s=a.tool_timeout_s, **kwargs)
    elif a.environment == "guess_number":
        env = GuessNumber(**kwargs)
    else:
        env = load_environment(a.environment, **kwargs)
    if callable(getattr(env, "items", None)):
        return env, env.items(task.size, seed=task.seed), env.items(task.held_out_size(),
                                                                             seed=task.seed + EVAL_SEED_OFFSET)
    splits = splits or load_task(task, hold_out)
    return env, splits[0], splits[1]


def bind(env, tokenizer) -> None:
    """The environment's optional `bind(tokenizer)` (a tool environment checks the template's tool support)."""
    if callable(getattr(env, "bind", None)):
        env.bind(tokenizer)


def trajectory_reward(trajectory: Trajectory, config: AgentConfig) -> float:
    """final_reward + turn_reward_weight x (sum or mean of the per-turn rewards)."""
    turns = trajectory.turn_rewards
    combined = sum(turns) / len(turns) if turns and config.turn_reward_reduction == "mean" else sum(turns)
    return trajectory.reward + config.turn_reward_weight * combined


def turn_branching(config: Config) -> tuple:
    """sampling.turn_branching of a run, or (grpo.num_generations,) when it is empty."""
    return config.sampling.turn_branching or (config.grpo.num_generations,)


def context_limit(config: AgentConfig, model) -> int | None:
    """agent.max_context_tokens, or the model's max_position_embeddings (None when it has none)."""
    return config.max_context_tokens or max_positions(model.config)


def trajectory_metrics(groups: list[list[Trajectory]]) -> dict:
    """turns/mean, tool_calls/mean (per trajectory), tool_calls/error_rate (failed calls over calls; 0 without
    calls), agent/trajectories (the step's count: groups shrink when trajectories end early) and the fraction of
    trajectories by how they ended (agent/ended_by/<done | truncated | end_of_sequence | max_turns | context>;
    `trajectories.Trajectory.ended_by`)."""
    flat = [t for g in groups for t in g]
    n = max(len(flat), 1)
    calls = sum(t.tool_calls for t in flat)
    out = {"turns/mean": sum(t.turns for t in flat) / n, "tool_calls/mean": calls / n, "agent/trajectories": len(flat),
           "tool_calls/error_rate": sum(t.tool_errors for t in flat) / calls if calls else 0.0}
    for reason in ("done", "truncated", "end_of_sequence", "max_turns", "context"):
        out[f"agent/ended_by/{reason}"] = sum(t.ended_by == reason for t in flat) / n
    return out
