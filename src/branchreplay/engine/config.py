"""How the execution stack runs a tree: `EngineConfig`, the `engine` section of the run config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..fields import check, choice, help_of

Replay = Literal["keep", "replay", "auto"]
# Both calibrated by scripts/pack_overhead.py (its figures: docs/notes/execution-stack.md).
PACK_OVERHEAD_TOKENS = 48  # a pack's fixed cost, in positions
PREFIX_POSITION_OVERHEAD = 0.1  # a child position's extra cost under a root node, as a fraction of a position
EVERY_SHARED_NODE = {"pack_overhead_tokens": 0, "prefix_position_overhead": 0}
"""EngineConfig fields under which every shared node runs once (engine/schedule.py merges none): verify, the
self-check and the exactness tests run their small trees as trees with it."""


@dataclass(frozen=True)
class EngineConfig:
    """How the execution stack runs a tree. None of these change the result, only time and memory. Each field's
    help is its metadata. (Whether a model outside the registry runs at all is the caller's: the engine's
    `trusted`, the package's `force`, and the trainer's `train.unknown_family`.)"""

    max_pack_tokens: int = field(default=256, metadata=help_of(
        "most tokens of nodes run as one pack (one query sequence: siblings against one copy of their prefix K/V, "
        "or with split prefix attention children of several parents, each against its own), "
        ">= 1; a longer node runs alone. A pack costs pack^2 attention scores where its nodes need only the sum of "
        "their lengths^2 / 2, so long nodes run alone; the default is the fastest of the CPU bench's pack sizes"))
    max_batch_tokens: int = field(default=1024, metadata=help_of(
        "most tokens of one [B, L] batch, >= 1: childless nodes of one length run as the rows of one forward, as "
        "in a padded batch but without pads: at the root (the rollouts of the dense packed schedule) and, with "
        "split prefix attention, below a prefix, where nodes with children batch too (engine/stack.py). Batching "
        "pays for short rows and not for long ones; 1 runs every node alone"))
    pack_overhead_tokens: int = field(default=PACK_OVERHEAD_TOKENS, metadata=help_of(
        "what one pack's fixed cost is worth in token positions, >= 0: a shared node whose sharing saves fewer "
        "positions runs again inside each of its children instead of once (engine/schedule.py; when no shared node "
        "is worth it, each rollout runs alone: the dense packed schedule). 0 (with prefix_position_overhead 0) keeps "
        "every shared node. Calibrated by scripts/pack_overhead.py"))
    prefix_position_overhead: float = field(default=PREFIX_POSITION_OVERHEAD, metadata=help_of(
        "what a position attending to a cached prefix costs beyond one in a standalone rollout, as a fraction of a "
        "position, >= 0: a node at the root is shared only if its saving also pays this for each of its "
        "children's positions (split attention's second kernel and merge; engine/schedule.py). Charged only where "
        "the model runs split prefix attention (CPU, float32/64, full-attention families); calibrated by "
        "scripts/pack_overhead.py"))
    chunk_tokens: int = field(default=4096, metadata=help_of(
        "a node longer than this runs as a chain of chunks of at most this many tokens, each against the K/V of "
        "the ones before it, >= 1"))
    head_chunk_tokens: int = field(default=512, metadata=help_of(
        "rows of the LM head computed at once, >= 1 (memory: head_chunk_tokens x vocab floats)"))
    head_float32: bool = field(default=False, metadata=help_of(
        "run the LM head's projection in float32 outside autocast, on float32 hidden states (TRL's "
        "cast_lm_head_to_fp32: the head's weights are the caller's to cast)"))
    replay: Replay = field(default="auto", metadata=help_of(
        "'keep' holds every pack's activations until its backward; 'replay' holds only the K/V and last hidden "
        "state it hands to its children and recomputes its forward before its backward (one more forward per "
        "internal pack); 'auto' keeps what fits engine.memory_budget and replays the internal packs with the "
        "largest activations (engine/planner.py)"))
    memory_budget: int | None = field(default=None, metadata=help_of(
        "bytes for replay='auto', > 0; default (null): 90% of the device's available memory when the step starts"))
    forest: bool = field(default=True, metadata=help_of(
        "run the trees of one engine call (a step's groups, or a micro-batch's) as one prefix forest, so that a "
        "start rollouts of different groups share (a chat template's system prompt, a tool schema, few-shot turns) "
        "runs once; false runs each tree alone (the same gradient; for A/B measurements)"))

    def __post_init__(self):
        for name in ("max_pack_tokens", "max_batch_tokens", "chunk_tokens", "head_chunk_tokens"):
            check(f"engine.{name}", getattr(self, name) >= 1, ">= 1", getattr(self, name))
        check("engine.pack_overhead_tokens", self.pack_overhead_tokens >= 0, ">= 0", self.pack_overhead_tokens)
        check("engine.prefix_position_overhead", self.prefix_position_overhead >= 0, ">= 0",
              self.prefix_position_overhead)
        choice("engine.replay", self.replay, Replay)
        if self.memory_budget is not None:
            check("engine.memory_budget", self.memory_budget > 0, "> 0 bytes", self.memory_budget)
