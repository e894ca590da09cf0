"""Multi-turn agent tasks in a run (config section `agent`): which environment answers the assistant's turns, the
limits of a trajectory, how its per-turn rewards combine with the final one, its metrics, and the greedy held-out
evaluation. The sampling itself is `trajectories.sample_trajectories_turnwise`; the environments are `environments.py`.

    agent.environment: calculator     the default task's arithmetic with a `calculate` tool (the task's verifier)
                       guess_number   guess a number from 1 to 10 with higher / lower replies
                       pkg.mod:Class  a user environment (`environments.Environment`), built with environment_kwargs

A trajectory's reward is one scalar (`trajectory_reward`), so every algorithm's advantage estimator applies as in
single-turn training (verl's multi-turn rollouts do the same with their turn scores); groups are the trajectories of
one item, of any size. `load_agent_task` says where the items come from.
"""

from __future__ import annotations

import time
import warnings

import torch

from ...models import max_positions
from .environments import GuessNumber, calculator, load_environment
from ..data.rewards import make_reward
from ..config.agent import AgentConfig
from ..config.sampling import SamplingConfig
from ..config.task import EVAL_SEED_OFFSET, reward_specs
from ..data.tasks import load_task
from ..rollouts.packed_linears import packed_linears
from ..rollouts.trajectories import Limits, Trajectory, sample_trajectories_turnwise
from ..rollouts.turns import InProcessTurns


def load_agent_task(config) -> tuple:
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


def turn_branching(config) -> tuple:
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


@torch.no_grad()
def evaluate_agent(model, tokenizer, config, env, items, eos, progress=None, batch_size: int = 16) -> dict:
    """Greedy multi-turn held-out evaluation: one trajectory per item (top-1 token at every step), up to
    agent.max_turns replies of sampling.max_new_tokens, in the run's sampling.cache_implementation. Returns
    eval/accuracy (mean final reward: the task's success), eval/frac_correct (final reward 1), eval/reward (the
    combined reward trained on), eval/turns_mean, eval/tool_calls_mean, eval/mean_length (assistant tokens) and
    time/eval_s. Items that raise ItemError are skipped with a warning (eval/skipped counts them). The items run
    `batch_size` at a time (progress(done, total) after each batch), each turn of a batch's items in one decoding
    loop, the start their openings share prefilled once per batch (`turns.InProcessTurns`)."""
    t0, a, s = time.perf_counter(), config.agent, config.sampling
    greedy = SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=s.max_new_tokens,
                            cache_implementation=s.cache_implementation, enforce_eager=s.enforce_eager,
                            pack_weights=s.pack_weights)
    limits = Limits(a.max_turns, context_limit(a, model), a.max_tool_output_tokens)
    done, skipped = [], 0
    with packed_linears(model, s.pack_weights, rows=batch_size):  # a turn's most replies: one per item
        for first in range(0, len(items), batch_size):
            if progress is not None:
                progress(first, len(items))
            turns = InProcessTurns(model, greedy, eos, lambda k, path: None)
            batch = [items[k] for k in range(first, min(first + batch_size, len(items)))]  # a dataset: no slices
            drawn, errors = sample_trajectories_turnwise(turns, tokenizer, env, batch, (1,), greedy, limits)
            for why in errors:
                warnings.warn(f"a held-out item was skipped: {why}", RuntimeWarning, stacklevel=2)
            done += [t for k in sorted(drawn) for t in drawn[k]]
            skipped += len(errors)
    if progress is not None:
        progress(len(items), len(items))
    n, counts = max(len(done), 1), trajectory_metrics([done])
    return {"eval/accuracy": sum(t.reward for t in done) / n,
            "eval/frac_correct": sum(t.reward == 1 for t in done) / n,
            "eval/reward": sum(trajectory_reward(t, a) for t in done) / n,
            "eval/turns_mean": counts["turns/mean"],
            "eval/tool_calls_mean": counts["tool_calls/mean"],
            "eval/mean_length": sum(sum(t.conversation.loss_mask) for t in done) / n,
            "eval/skipped": skipped, "time/eval_s": time.perf_counter() - t0}
