"""The benchmark's workloads: shared-prompt (P + G x R), multi-turn agent trajectories sharing earlier turns, and
tree-sampled responses from a branching schedule; `Scenario` is one configuration, `scenario_grid` a sweep."""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..reference.shapes import Sequence, prompt_completion, random_ids, shared_prompt

SCENARIOS = ("shared-prompt", "multi-turn", "tree-sampled")
DEFAULT_PROMPT_TOKENS = {"shared-prompt": 2048, "multi-turn": 512, "tree-sampled": 1024}
LOW_SHARING = "low-sharing"  # a preset grid of the scenarios above where the tree saves little (`low_sharing`)


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
    paths = [(random_ids(prompt_tokens, vocab, g), [0] * prompt_tokens)]
    for level in range(turns):
        last = level == turns - 1
        nxt = []
        for k, (ids, mask) in enumerate(paths):
            for _ in range(branching[(k + level) % len(branching)]):
                reply = random_ids(reply_tokens, vocab, g)
                tool = [] if last else random_ids(tool_tokens, vocab, g)
                nxt.append((ids + reply + tool, mask + [1] * reply_tokens + [0] * len(tool)))
        paths = nxt
    return paths


def recorded_trajectories(path: str | Path, vocab: int) -> list[Sequence]:
    """The (ids, loss mask) of trajectories recorded from a real environment (`scripts/record_trajectories.py`: one
    JSON object per line with "ids" and "loss_mask"). Raises ValueError for a file without trajectories, or ids the
    model's vocabulary (`vocab`) does not hold (recorded with another tokenizer: pass its model with --model)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no trajectories")
    top = max(max(r["ids"]) for r in rows)
    if top >= vocab:
        raise ValueError(f"{path} holds token id {top}, past the model's vocabulary ({vocab}): it was recorded "
                         "with another tokenizer; bench it with that model (--model)")
    return [(r["ids"], r["loss_mask"]) for r in rows]


def recorded_items(path: str | Path) -> list:
    """The item (group) of each recorded trajectory, in file order; None where a row has none."""
    return [json.loads(line).get("item") for line in Path(path).read_text().splitlines() if line.strip()]


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
    prompt = random_ids(prompt_tokens, vocab, g)
    depths = depths + [response_tokens]
    responses: list[list[int]] = [[]]
    if depths[0] > 0:  # before the first fork, a single shared stem
        responses = [random_ids(depths[0], vocab, g)]
    for (d, f), end in zip(schedule, depths[1:], strict=True):
        responses = [r + random_ids(end - d, vocab, g) for r in responses for _ in range(f)]
    return [prompt_completion(prompt, r) for r in responses]


@dataclass(frozen=True)
class Scenario:
    """One benchmark configuration. Sizes in tokens; the fields a scenario does not use are None.

    shared-prompt: prompt_tokens, generations, response_tokens.
    multi-turn: prompt_tokens, turns, reply_tokens, tool_tokens, branching (see `agent_trajectories`); or
        `trajectories`, a file of recorded ones (`recorded_trajectories`; the sizes are then None).
    tree-sampled: prompt_tokens, response_tokens, fork_schedule ((depth, fan-out), ...; `tree_sampled`).
    """

    name: str
    prompt_tokens: int
    generations: int | None = None
    response_tokens: int | None = None
    turns: int | None = None
    reply_tokens: int | None = None
    tool_tokens: int | None = None
    branching: tuple[int, ...] | None = None
    fork_schedule: tuple[tuple[int, int], ...] | None = None
    trajectories: str | None = None

    def sequences(self, vocab: int, g: torch.Generator):
        if self.trajectories is not None:
            return recorded_trajectories(self.trajectories, vocab)
        if self.name == "shared-prompt":
            return shared_prompt(self.prompt_tokens, self.generations, self.response_tokens, vocab, g)
        if self.name == "multi-turn":
            return agent_trajectories(self.prompt_tokens, self.turns, self.reply_tokens, self.tool_tokens,
                                      self.branching, vocab, g)
        return tree_sampled(self.prompt_tokens, self.response_tokens, self.fork_schedule, vocab, g)

    def params(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "name"}

    def label(self) -> str:
        if self.name == "shared-prompt":
            return f"P={self.prompt_tokens} G={self.generations} R={self.response_tokens}"
        if self.trajectories is not None:
            return f"recorded {Path(self.trajectories).name}"
        if self.name == "multi-turn":
            b = ",".join(map(str, self.branching))
            return (f"P={self.prompt_tokens} turns={self.turns} reply={self.reply_tokens} "
                    f"tool={self.tool_tokens} fork={b}")
        forks = ",".join(f"{f}@{d}" for d, f in self.fork_schedule)
        return f"P={self.prompt_tokens} R={self.response_tokens} fork={forks}"


def low_sharing() -> list[Scenario]:
    """Where the tree saves little (token ratio 1.03-1.8): short prompts and long responses, shared-prompt P in
    {64, 256} x G in {2, 8} x R in {256, 1024}; and agent trajectories of a 64-token prompt and 4 turns (128-token
    replies, 32-token tool outputs) that share only the prompt (4 trajectories forking at the first reply) or, 3 of
    them, also share a first turn in pairs (fan-outs cycled as `agent_trajectories` does)."""
    grid = [Scenario("shared-prompt", P, generations=G, response_tokens=R)
            for P, G, R in itertools.product((64, 256), (2, 8), (256, 1024))]
    return grid + [Scenario("multi-turn", 64, turns=4, reply_tokens=128, tool_tokens=32, branching=b)
                   for b in ((4, 1, 1, 1, 1, 1, 1, 1), (2, 2, 1, 1, 1, 1, 1, 1))]


def scenario_grid(names=("shared-prompt",), prompt_tokens=None, generations=(8,), response_tokens=(128,),
                  turns=(4,), reply_tokens: int = 96, tool_tokens: int = 64, branching=(2, 1, 3),
                  fork_schedule=((0, 2), (32, 4)), trajectories: str | None = None) -> list[Scenario]:
    """Every combination of the listed sizes, per scenario: shared-prompt over prompt_tokens x generations x
    response_tokens, multi-turn over prompt_tokens x turns, tree-sampled over prompt_tokens x response_tokens.
    prompt_tokens None: each scenario's default (DEFAULT_PROMPT_TOKENS). `trajectories`: multi-turn is the one
    configuration of that recorded file instead. "low-sharing" adds the preset grid `low_sharing` (the size
    arguments do not apply to it)."""
    out = []
    for name in names:
        if name == LOW_SHARING:
            out += low_sharing()
            continue
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)} or {LOW_SHARING}")
        ps = prompt_tokens or (DEFAULT_PROMPT_TOKENS[name],)
        if name == "shared-prompt":
            out += [Scenario(name, P, generations=G, response_tokens=R)
                    for P, G, R in itertools.product(ps, generations, response_tokens)]
        elif name == "multi-turn" and trajectories is not None:
            out.append(Scenario(name, 0, trajectories=str(trajectories)))
        elif name == "multi-turn":
            out += [Scenario(name, P, turns=t, reply_tokens=reply_tokens, tool_tokens=tool_tokens,
                             branching=tuple(branching)) for P, t in itertools.product(ps, turns)]
        else:
            sched = tuple(tuple(x) for x in fork_schedule)
            for P, R in itertools.product(ps, response_tokens):
                if max(d for d, _ in sched) >= R:
                    raise ValueError(f"tree-sampled: fork depths {sched} must be below --response-tokens {R}")
                out.append(Scenario(name, P, response_tokens=R, fork_schedule=sched))
    return out
