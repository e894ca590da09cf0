"""A reward function in TRL's form, for `--task.reward "examples.my_rewards:format_reward"` (docs/training.md).

TRL calls each reward function with the completions and every other dataset column by name, and takes one float
per completion back.
"""

import re


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 for a completion whose last line is a bare number (the answer alone, as the system prompt asks), else 0."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # plain or conversational
    return [1.0 if re.fullmatch(r"\s*-?\d+(\.\d+)?\s*", (t.strip().splitlines() or [""])[-1]) else 0.0 for t in texts]
