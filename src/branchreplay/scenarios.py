"""Synthetic rollout sets of known shapes, for the exactness tests, `branchreplay verify` and the benchmark.

Every builder takes a vocabulary size and a torch.Generator and returns a list of `Rollout`s with a prompt (loss
mask 0), completions (loss mask 1), random advantages in [-1, 1] and GRPO weights (1 / (|o| * B)).
"""

from __future__ import annotations

import torch

from .losses import token_weights
from .tree import Rollout


def _ids(n: int, vocab: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=g).tolist()


Sequence = tuple[list[int], list[int]]  # (token ids, 0/1 loss mask)


def make_rollouts(sequences: list[Sequence], g: torch.Generator, old_logprobs: bool = False) -> list[Rollout]:
    """(token ids, loss mask) pairs -> rollouts with a random advantage each and GRPO weights. With `old_logprobs`,
    adds old logprobs that depend only on the context, as a real sampler's would."""
    masks = [torch.tensor(m, dtype=torch.float64) for _, m in sequences]
    weights = token_weights(masks, "grpo")
    out = [
        Rollout(ids, m, advantages=float(torch.rand((), generator=g) * 2 - 1), weights=w)
        for (ids, _), m, w in zip(sequences, masks, weights)
    ]
    if old_logprobs:
        _add_shared_old_logprobs(out, g)
    return out


def _pc(prompt: list[int], completion: list[int]) -> Sequence:
    return prompt + completion, [0] * len(prompt) + [1] * len(completion)


def _add_shared_old_logprobs(rollouts: list[Rollout], g: torch.Generator) -> None:
    """Old logprobs that depend only on the token prefix (as a real sampler's would), near 0 to keep ratios ~1."""
    table: dict[tuple, float] = {}
    for r in rollouts:
        ids = r.token_ids.tolist()
        lp = torch.zeros(len(ids), dtype=torch.float64)
        for t in range(1, len(ids)):
            key = tuple(ids[: t + 1])
            if key not in table:
                table[key] = -float(torch.rand((), generator=g)) * 3.0
            lp[t] = table[key]
        r.old_logprobs = lp


def shared_prompt(P: int, G: int, R: int, vocab: int, g: torch.Generator) -> list[Sequence]:
    """One prompt of P tokens and G completions of R tokens."""
    prompt = _ids(P, vocab, g)
    return [_pc(prompt, _ids(R, vocab, g)) for _ in range(G)]


def branches_of_branches(vocab: int, g: torch.Generator) -> list[Sequence]:
    """A prompt, 3 shared response stems, each forking into 2-3 branches of uneven length."""
    prompt = _ids(24, vocab, g)
    out = []
    for i in range(3):
        stem = _ids(5 + i, vocab, g)
        for j in range(2 + i % 2):
            out.append(_pc(prompt, stem + _ids(3 + 2 * j, vocab, g)))
    return out


def edge_cases(vocab: int, g: torch.Generator) -> list[Sequence]:
    """Identical rollouts, a rollout that is a prefix of another, and an empty completion, under one prompt."""
    prompt = _ids(16, vocab, g)
    a = _ids(9, vocab, g)
    return [_pc(prompt, c) for c in (a, list(a), a[:4], [], _ids(6, vocab, g))]


def forest(vocab: int, g: torch.Generator, prompts: int = 3) -> list[Sequence]:
    """Several prompts (different first tokens), each with 2-3 completions."""
    out = []
    for i in range(prompts):
        prompt = [i % vocab] + _ids(10 + 3 * i, vocab, g)
        out += [_pc(prompt, _ids(4 + j, vocab, g)) for j in range(2 + i % 2)]
    return out


def multi_turn(vocab: int, g: torch.Generator, depth: int = 4) -> list[Sequence]:
    """Agent-like trajectories of `depth` turns, each turn a tool output (not trained) then a generated reply;
    every turn forks unevenly (1 or 2 continuations), so trajectories share their earlier turns."""
    paths = [([*_ids(20, vocab, g)], [0] * 20)]
    for level in range(depth):
        nxt = []
        for k, (ids, mask) in enumerate(paths):
            for _ in range(1 + (k + level) % 2):
                tool, reply = _ids(3, vocab, g), _ids(4 + level, vocab, g)
                nxt.append((ids + tool + reply, mask + [0] * 3 + [1] * len(reply)))
        paths = nxt
    return paths


def agent_trajectories(prompt_tokens: int, turns: int, reply_tokens: int, tool_tokens: int,
                       branching: tuple[int, ...], vocab: int, g: torch.Generator) -> list[Sequence]:
    """Agent trajectories at realistic sizes: a system+task prompt of `prompt_tokens` (loss mask 0), then `turns`
    turns, each a generated reply of `reply_tokens` (loss mask 1) followed by a tool output of `tool_tokens` (loss
    mask 0); the last turn ends with its reply. Trajectories fork at the start of a reply (where the sampler draws):
    the k-th partial trajectory at turn l forks into branching[(k + l) % len(branching)] replies, so the branching
    is uneven and the tree has turns + 1 levels (prompt + one per turn).

    E.g. 512, 4 turns, 96, 64, branching (2, 1, 3): 18 trajectories of 1088 tokens, 4640 unique positions.
    """
    if turns < 1 or min(branching, default=0) < 1:
        raise ValueError("agent_trajectories needs turns >= 1 and every branching factor >= 1")
    paths = [(_ids(prompt_tokens, vocab, g), [0] * prompt_tokens)]
    for level in range(turns):
        last = level == turns - 1
        nxt = []
        for k, (ids, mask) in enumerate(paths):
            for _ in range(branching[(k + level) % len(branching)]):
                reply = _ids(reply_tokens, vocab, g)
                tool = [] if last else _ids(tool_tokens, vocab, g)
                nxt.append((ids + reply + tool, mask + [1] * reply_tokens + [0] * len(tool)))
        paths = nxt
    return paths


def tree_sampled(prompt_tokens: int, response_tokens: int, schedule: tuple[tuple[int, int], ...], vocab: int,
                 g: torch.Generator) -> list[Sequence]:
    """Responses sampled on a branching schedule: one prompt of `prompt_tokens`, every response `response_tokens`
    long; at response depth d (tokens after the prompt) each partial response forks into f continuations, for each
    (d, f) in `schedule`. E.g. ((0, 2), (32, 4)): 2 stems of 32 tokens, each forking into 4, 8 responses that share
    their first 32 tokens in pairs of 4."""
    schedule = sorted(schedule)
    depths = [d for d, _ in schedule]
    if any(d < 0 or d >= response_tokens or f < 1 for d, f in schedule) or len(set(depths)) < len(depths):
        raise ValueError(f"tree_sampled: fork depths must be distinct and in [0, {response_tokens}), fan-outs >= 1; "
                         f"got {schedule}")
    prompt = _ids(prompt_tokens, vocab, g)
    depths = depths + [response_tokens]
    responses: list[list[int]] = [[]]
    if depths[0] > 0:  # before the first fork, a single shared stem
        responses = [_ids(depths[0], vocab, g)]
    for (d, f), end in zip(schedule, depths[1:]):
        responses = [r + _ids(end - d, vocab, g) for r in responses for _ in range(f)]
    return [_pc(prompt, r) for r in responses]


def random_tree(vocab: int, g: torch.Generator, max_rollouts: int = 8) -> list[Sequence]:
    """A random tree: a random prompt, then each rollout copies a random prefix of an earlier one and goes on."""
    prompt = _ids(int(torch.randint(1, 20, (), generator=g)), vocab, g)
    completions: list[list[int]] = []
    for _ in range(int(torch.randint(1, max_rollouts + 1, (), generator=g))):
        base = completions[int(torch.randint(0, len(completions), (), generator=g))] if completions else []
        cut = int(torch.randint(0, len(base) + 1, (), generator=g))
        completions.append(base[:cut] + _ids(int(torch.randint(0, 8, (), generator=g)), vocab, g))
    return [_pc(prompt, c) for c in completions]


def around_window(window: int, vocab: int, g: torch.Generator) -> list[Sequence]:
    """Branch points placed relative to a sliding window of `window` tokens (a query at q sees keys k with
    q - k < window; window >= 2): one trunk of 3 * window + 6 tokens (its first window // 2 are the prompt) and
    rollouts that leave it before the window is full (depth window // 2 + 1), at its edge (window - 1, window,
    window + 1) and well past it (2 * window + 3), each going on for window + 3 tokens so that its queries cross the
    window boundary; the branch at depth window forks again inside its own window (depth window + window // 2)."""
    prompt_len = max(1, window // 2)
    trunk = _ids(3 * window + 6, vocab, g)
    out = [trunk]
    for depth in (window // 2 + 1, window - 1, window, window + 1, 2 * window + 3):
        out.append(trunk[:depth] + _ids(window + 3, vocab, g))
    at_edge = out[3]  # the branch at depth `window`
    out.append(at_edge[: window + window // 2] + _ids(window + 3, vocab, g))
    return [_pc(s[:prompt_len], s[prompt_len:]) for s in out]


def around_length(n: int, vocab: int, g: torch.Generator) -> list[Sequence]:
    """Rollouts whose lengths straddle a threshold of n tokens (n >= 6), where something switches with the length
    or position (a rotary regime, an attention chunk, the engine's chunk): a prompt of n - 4 tokens, completions
    ending at n - 1 and n tokens (at or below it), and n + 1 and n + 4 tokens (past it; the longer extends the
    shorter, so a branch point sits past n too)."""
    if n < 6:
        raise ValueError(f"around_length needs a threshold of at least 6 tokens, got {n}")
    prompt = _ids(n - 4, vocab, g)
    stem = _ids(5, vocab, g)
    return [_pc(prompt, _ids(3, vocab, g)), _pc(prompt, stem[:1] + _ids(3, vocab, g)), _pc(prompt, stem),
            _pc(prompt, stem + _ids(3, vocab, g))]


SHAPES = {
    "shared-prompt": lambda vocab, g: shared_prompt(48, 8, 6, vocab, g),
    "branches-of-branches": branches_of_branches,
    "edge-cases": edge_cases,
    "forest": forest,
    "multi-turn": multi_turn,
    "random": random_tree,
}
