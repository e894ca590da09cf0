"""Multi-turn rollouts with tree sampling across turns: trajectories that share their earlier turns.

For one dataset item, the environment's opening messages are prefilled once. Turn t then samples
`turn_branching[t]` assistant replies (1 past the list) from the conversation so far; each reply that called for
an answer gets the environment's messages (`environments.Environment.step`), and its conversation goes on to
turn t + 1. So with turn_branching (2, 4), 2 first replies are each continued 4 ways after their tool result: up to
8 trajectories, which share the prompt, and in fours their first turn. The ids are built by `conversation.
Conversation` (assistant turns as sampled, environment turns as the template's delta), so shared turns are the same
ids and `tree.RolloutTree` shares their nodes.

KV caches: one per conversation prefix that continues. A child copies its parent's cache (`copy.deepcopy`) and
prefills only its own new tokens (its reply and the environment's answer): the shared history is never run again.
A trajectory ends when the environment says done, its reply was cut at sampling.max_new_tokens (no end-of-turn:
`truncated`), it reached `max_turns` replies, or its next turn would pass `max_context_tokens`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from .conversation import Conversation
from .environments import Environment
from .sampling import SamplingConfig, prefill, sample_from


@dataclass
class Trajectory:
    """One multi-turn rollout: its conversation (ids, loss mask, messages), the sampler's logprob of each ids
    position (0.0 outside assistant turns), per-turn rewards, the final reward, and counts for the metrics."""

    conversation: Conversation
    logprobs: list[float]
    turn_rewards: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: bool = False
    ended_by: str = "done"  # done, truncated, max_turns or context


@torch.no_grad()
def sample_trajectories(model, tokenizer, env: Environment, item: dict, turn_branching: tuple[int, ...],
                        config: SamplingConfig, eos_token_ids, generator: torch.Generator | None = None,
                        max_turns: int = 4, max_context_tokens: int | None = None) -> list[Trajectory]:
    """The trajectories of `item`, depth first (children of one turn consecutive), at most prod(turn_branching).

    Raises ValueError: max_turns < 1, a branching factor < 1, or an opening prompt that leaves no room for a reply
    under `max_context_tokens`."""
    if max_turns < 1 or any(f < 1 for f in turn_branching):
        raise ValueError(f"max_turns ({max_turns}) and every turn_branching factor ({turn_branching}) must be >= 1")
    start = Conversation.start(tokenizer, env.reset(item))
    limit = max_context_tokens or math.inf
    if len(start.ids) + config.max_new_tokens > limit:
        raise ValueError(f"the opening messages take {len(start.ids)} tokens: with sampling.max_new_tokens "
                         f"({config.max_new_tokens}) more than the context limit ({max_context_tokens})")
    was_training = model.training
    model.eval()
    out: list[Trajectory] = []
    try:
        cache, logits = prefill(model, start.ids)
        todo = [(Trajectory(start, [0.0] * len(start.ids)), cache, logits)]
        while todo:
            parent, cache, logits = todo.pop()
            f = turn_branching[parent.turns] if parent.turns < len(turn_branching) else 1
            prefix = len(parent.conversation.ids)
            # the decoding consumes its cache (rows forked and dropped): it gets a copy, the children need this one
            samples = sample_from(model, copy.deepcopy(cache), logits, prefix, {0: f}, config, eos_token_ids,
                                  generator)
            children = []
            for sample in samples:
                child = copy.deepcopy(parent)
                text = tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
                child.conversation.add_assistant(sample.completion_ids, text)
                child.logprobs += sample.logprobs
                child.turns += 1
                nxt = _next(child, sample.truncated, env, item, tokenizer, max_turns, limit, config)
                if nxt is None:
                    child.reward = float(env.final_reward(child.conversation.messages, item))
                    out.append(child)
                    continue
                new = child.conversation.ids[prefix:]
                child_cache, child_logits = prefill(model, new, copy.deepcopy(cache), position=prefix)
                children.append((child, child_cache, child_logits))
            todo.extend(reversed(children))  # depth first, in sampling order
    finally:
        model.train(was_training)
    return out


def _next(child: Trajectory, truncated: bool, env: Environment, item: dict, tokenizer, max_turns: int,
          limit: float, config: SamplingConfig):
    """Whether `child` goes on after its last reply: None when it ends (recorded in `ended_by`), else True after
    the environment's messages were appended."""
    if truncated:
        child.truncated, child.ended_by = True, "truncated"
        return None
    response = env.step(child.conversation.messages, item)
    child.tool_calls += response.tool_calls
    child.tool_errors += response.tool_errors
    if response.reward is not None:
        child.turn_rewards.append(float(response.reward))
    if response.done:
        child.ended_by = "done"
        return None
    if child.turns >= max_turns:
        child.ended_by = "max_turns"
        return None
    before = len(child.conversation.ids)
    child.conversation.add_environment(tokenizer, response.messages)
    if len(child.conversation.ids) + config.max_new_tokens > limit:
        child.ended_by = "context"
        child.conversation.ids = child.conversation.ids[:before]  # the environment's reply is not trained on
        child.conversation.loss_mask = child.conversation.loss_mask[:before]
        child.conversation.messages = child.conversation.messages[: -len(response.messages)]
        return None
    child.logprobs += [0.0] * (len(child.conversation.ids) - before)
    return True
