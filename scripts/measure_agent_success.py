"""Measure a model's success on a multi-turn environment before any training (issue 13: choose tasks a 135M model
can learn by their base success rate, as docs/default_task.md did for the single-turn task).

For each of the first --n held-out questions of the default task (calculator) or --n targets drawn with seed 10 000
(guess-number), one greedy trajectory (top_k 1) through the
environment (`rl.trajectories.sample_trajectories`, no branching), at most --max-turns replies of at most
--max-new-tokens tokens. Prints the success rate (final reward 1), the mean reward, turns, tool calls per
trajectory, the fraction of tool calls that failed, how trajectories ended, and the time.

Run:  .venv/bin/python scripts/measure_agent_success.py [--env calculator|guess-number] [--n 32] [--max-turns 3]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from branchreplay.models import load_policy
from branchreplay.rl.environments import GuessNumber, calculator
from branchreplay.rl.rewards import make_reward
from branchreplay.rl.sampling import SamplingConfig, eos_token_ids
from branchreplay.rl.tasks import TaskConfig, load_task
from branchreplay.rl.trajectories import sample_trajectories


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--env", default="calculator", choices=["calculator", "guess-number"])
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    model, tokenizer = load_policy(args.model)
    if args.env == "calculator":
        train, held_out = load_task(TaskConfig())
        env = calculator(make_reward("task", train))
    else:
        env = GuessNumber()
        held_out = env.items(args.n, seed=10_000)
    greedy = SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=args.max_new_tokens)
    eos = eos_token_ids(model, tokenizer)
    rewards, turns, calls, errors, ended = [], [], 0, 0, collections.Counter()
    start = time.perf_counter()
    for k in range(min(args.n, len(held_out))):
        item = held_out[k]
        (t,) = sample_trajectories(model, tokenizer, env, item, (), greedy, eos, torch.Generator(model.device),
                                   max_turns=args.max_turns)
        rewards.append(t.reward)
        turns.append(t.turns)
        calls, errors = calls + t.tool_calls, errors + t.tool_errors
        ended[t.ended_by] += 1
    n = len(rewards)
    print(f"{args.model} on {args.env}, {n} held-out questions, greedy, max_turns {args.max_turns}, "
          f"{args.max_new_tokens} new tokens per reply, {time.perf_counter() - start:.0f} s:")
    print(f"  success {sum(r == 1.0 for r in rewards) / n:.3f}, mean reward {sum(rewards) / n:.3f}, turns "
          f"{sum(turns) / n:.2f}, tool calls per trajectory {calls / n:.2f}, failed calls "
          f"{errors / max(calls, 1):.2f}, ended: {dict(ended)}")


if __name__ == "__main__":
    main()
