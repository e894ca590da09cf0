"""Branching schedules sampled by the vLLM server: a shared response prefix sampled once, then continued n ways.

A schedule {generated depth: fan-out} (`config.sampling.branching`, or one multi-turn turn's `turn_schedule`) runs
level by level, every request of a level in flight together: level j asks, for each stream still going, fan-out_j
completions of (prompt + the stream's tokens so far) up to the next fork's depth (the last level: up to
max_new_tokens). The server's prefix cache holds the prompt and each shared prefix, so a fork costs its new tokens.
{0: G} is one level: G independent completions of the prompt.

The samples come in `decode.loop.sample_group`'s order and with its `parent`s: the children of a fork consecutive; a
stream that ended (EOS) before a fork is copied as it is, so its children are identical.
"""

from __future__ import annotations

from ....decode.config import SamplingConfig
from ....decode.loop import Sample
from .client import VLLMClient


def sample_trees(client: VLLMClient, requests: list[tuple[list[int], dict[int, int]]], config: SamplingConfig,
                 eos_ids: set[int]) -> list[list[Sample]]:
    """Per request (prompt token ids, schedule {generated depth: fan-out}, depth 0 first), the product of its
    fan-outs Samples (module docstring). Raises VLLMError when the server fails, ValueError when a prompt and its
    tokens to sample exceed the server's max_model_len."""
    # per request: its streams (ids, logprobs, ended, parent), level by level
    streams = [[([], [], False, None)] for _ in requests]
    schedules = [sorted({0: 1, **schedule}.items()) for _, schedule in requests]  # one stream up to a first fork
    for level in range(max(len(s) for s in schedules)):
        asks, where = [], []  # the level's server requests, and (request, stream) of each
        for r, ((prompt, _), schedule) in enumerate(zip(requests, schedules, strict=True)):
            if level >= len(schedule):
                continue
            depth, fan = schedule[level]
            end = schedule[level + 1][0] if level + 1 < len(schedule) else config.max_new_tokens
            for i, (ids, _, ended, _) in enumerate(streams[r]):
                if not ended:
                    asks.append((prompt + ids, fan, end - depth))
                    where.append((r, i))
        answers = dict(zip(where, client.complete(asks, config.temperature, config.top_p, config.top_k, eos_ids),
                           strict=True))
        for r, schedule in enumerate(schedules):
            if level < len(schedule):
                streams[r] = _forked(streams[r], schedule[level], {i: a for (q, i), a in answers.items() if q == r},
                                     last=level + 1 == len(schedule))
    return [[Sample(ids, logprobs, truncated=not ended, parent=parent) for ids, logprobs, ended, parent in s]
            for s in streams]


def _forked(streams: list, fork: tuple[int, int], answers: dict, last: bool) -> list:
    """Each stream's fan-out children at this fork: its tokens plus a completion (`answers[i]` from the server,
    ended when it closes with an EOS; at the `last` level a stream not ended is truncated), or copies of an ended
    stream. Parents as `decode.loop.sample_group`'s: child 0 keeps its stream's (moved to the new numbering), child
    k > 0 forked from child 0 (no shared token when the fork is at depth 0)."""
    depth, fan = fork
    out = []
    for i, (ids, logprobs, ended, parent) in enumerate(streams):
        for k in range(fan):
            new_parent = (None if parent is None else parent * fan) if k == 0 else (i * fan if depth > 0 else None)
            if ended:
                out.append((list(ids), list(logprobs), True, new_parent))
                continue
            more, more_logprobs, cut = answers[i][k]
            out.append((ids + more, logprobs + more_logprobs, not cut, new_parent))
    return out
