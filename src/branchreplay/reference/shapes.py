"""Synthetic rollout sets of known shapes, for the exactness tests, `branchreplay verify` and the benchmark
(whose larger workloads are in `bench/scenarios.py`).

Every builder takes a vocabulary size and a torch.Generator and returns a list of `Rollout`s with a prompt (loss
mask 0), completions (loss mask 1), random advantages in [-1, 1] and GRPO weights (1 / (|o| * B)).
"""

from __future__ import annotations

import torch

from ..losses import token_weights
from ..tree import Rollout


def random_ids(n: int, vocab: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=g).tolist()


Sequence = tuple[list[int], list[int]]  # (token ids, 0/1 loss mask)


def make_rollouts(sequences: list[Sequence], g: torch.Generator, old_logprobs: bool = False) -> list[Rollout]:
    """(token ids, loss mask) pairs -> rollouts with a random advantage each and GRPO weights. With `old_logprobs`,
    adds old logprobs that depend only on the context, as a real sampler's would."""
    masks = [torch.tensor(m, dtype=torch.float64) for _, m in sequences]
    weights = token_weights(masks, "grpo")
    out = [
        Rollout(ids, m, advantages=float(torch.rand((), generator=g) * 2 - 1), weights=w)
        for (ids, _), m, w in zip(sequences, masks, weights, strict=True)
    ]
    if old_logprobs:
        _add_shared_old_logprobs(out, g)
    return out


def prompt_completion(prompt: list[int], completion: list[int]) -> Sequence:
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
    prompt = random_ids(P, vocab, g)
    return [prompt_completion(prompt, random_ids(R, vocab, g)) for _ in range(G)]


def branches_of_branches(vocab: int, g: torch.Generator) -> list[Sequence]:
    """A prompt, 3 shared response stems, each forking into 2-3 branches of uneven length."""
    prompt = random_ids(24, vocab, g)
    out = []
    for i in range(3):
        stem = random_ids(5 + i, vocab, g)
        for j in range(2 + i % 2):
            out.append(prompt_completion(prompt, stem + random_ids(3 + 2 * j, vocab, g)))
    return out


def edge_cases(vocab: int, g: torch.Generator) -> list[Sequence]:
    """Identical rollouts, a rollout that is a prefix of another, and an empty completion, under one prompt."""
    prompt = random_ids(16, vocab, g)
    a = random_ids(9, vocab, g)
    return [prompt_completion(prompt, c) for c in (a, list(a), a[:4], [], random_ids(6, vocab, g))]


def forest(vocab: int, g: torch.Generator, prompts: int = 3) -> list[Sequence]:
    """Several prompts (different first tokens), each with 2-3 completions."""
    out = []
    for i in range(prompts):
        prompt = [i % vocab] + random_ids(10 + 3 * i, vocab, g)
        out += [prompt_completion(prompt, random_ids(4 + j, vocab, g)) for j in range(2 + i % 2)]
    return out


def multi_turn(vocab: int, g: torch.Generator, depth: int = 4) -> list[Sequence]:
    """Agent-like trajectories of `depth` turns, each turn a tool output (not trained) then a generated reply;
    every turn forks unevenly (1 or 2 continuations), so trajectories share their earlier turns."""
    paths = [([*random_ids(20, vocab, g)], [0] * 20)]
    for level in range(depth):
        nxt = []
        for k, (ids, mask) in enumerate(paths):
            for _ in range(1 + (k + level) % 2):
                tool, reply = random_ids(3, vocab, g), random_ids(4 + level, vocab, g)
                nxt.append((ids + tool + reply, mask + [0] * 3 + [1] * len(reply)))
        paths = nxt
    return paths


def short_beside_long(vocab: int, g: torch.Generator) -> list[Sequence]:
    """A short child alone beside long siblings of one length, which random trees seldom draw: the siblings run as
    one batch and the short child as a pack of a few LM head rows (`engine.packs.batched_packs`), whose input
    gradient cancels most where the target's probability is near 1 (`engine.head.projection`). The prompt is a
    random span of 12 tokens said twice, so that a trained model predicts the copying that follows almost surely, as
    it predicts its own samples. Below it: a 3-token child that goes on copying; three 16-token children that start
    elsewhere and then copy; and a 16-token stem forking into a 1-token copying branch and two of 8 tokens."""
    span = random_ids(12, vocab, g)
    copying = span * 2
    long = [random_ids(1, vocab, g) + copying[1:16] for _ in range(3)]
    stem = random_ids(16, vocab, g)
    branches = [[span[0]]] + [random_ids(1, vocab, g) + copying[1:8] for _ in range(2)]
    completions = [copying[:3]] + long + [stem + b for b in branches]
    return [prompt_completion(span + span, c) for c in completions]


def random_tree(vocab: int, g: torch.Generator, max_rollouts: int = 8) -> list[Sequence]:
    """A random tree: a random prompt, then each rollout copies a random prefix of an earlier one and goes on."""
    prompt = random_ids(int(torch.randint(1, 20, (), generator=g)), vocab, g)
    completions: list[list[int]] = []
    for _ in range(int(torch.randint(1, max_rollouts + 1, (), generator=g))):
        base = completions[int(torch.randint(0, len(completions), (), generator=g))] if completions else []
        cut = int(torch.randint(0, len(base) + 1, (), generator=g))
        completions.append(base[:cut] + random_ids(int(torch.randint(0, 8, (), generator=g)), vocab, g))
    return [prompt_completion(prompt, c) for c in completions]


def around_window(window: int, vocab: int, g: torch.Generator) -> list[Sequence]:
    """Branch points placed relative to a sliding window of `window` tokens (a query at q sees keys k with
    q - k < window; window >= 2): one trunk of 3 * window + 6 tokens (its first window // 2 are the prompt) and
    rollouts that leave it before the window is full (depth window // 2 + 1), at its edge (window - 1, window,
    window + 1) and well past it (2 * window + 3), each going on for window + 3 tokens so that its queries cross the
    window boundary; the branch at depth window forks again inside its own window (depth window + window // 2)."""
    prompt_len = max(1, window // 2)
    trunk = random_ids(3 * window + 6, vocab, g)
    out = [trunk]
    for depth in (window // 2 + 1, window - 1, window, window + 1, 2 * window + 3):
        out.append(trunk[:depth] + random_ids(window + 3, vocab, g))
    at_edge = out[3]  # the branch at depth `window`
    out.append(at_edge[: window + window // 2] + random_ids(window + 3, vocab, g))
    return [prompt_completion(s[:prompt_len], s[prompt_len:]) for s in out]


def around_length(n: int, vocab: int, g: torch.Generator) -> list[Sequence]:
    """Rollouts whose lengths straddle a threshold of n tokens (n >= 6), where something switches with the length
    or position (a rotary regime, an attention chunk, the engine's chunk): a prompt of n - 4 tokens, completions
    ending at n - 1 and n tokens (at or below it), and n + 1 and n + 4 tokens (past it; the longer extends the
    shorter, so a branch point sits past n too)."""
    if n < 6:
        raise ValueError(f"around_length needs a threshold of at least 6 tokens, got {n}")
    prompt = random_ids(n - 4, vocab, g)
    stem = random_ids(5, vocab, g)
    return [prompt_completion(prompt, random_ids(3, vocab, g)),
            prompt_completion(prompt, stem[:1] + random_ids(3, vocab, g)), prompt_completion(prompt, stem),
            prompt_completion(prompt, stem + random_ids(3, vocab, g))]


SHAPES = {
    "shared-prompt": lambda vocab, g: shared_prompt(48, 8, 6, vocab, g),
    "branches-of-branches": branches_of_branches,
    "edge-cases": edge_cases,
    "forest": forest,
    "multi-turn": multi_turn,
    "short-beside-long": short_beside_long,
    "random": random_tree,
}
