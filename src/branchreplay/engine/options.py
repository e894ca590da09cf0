"""How one engine call runs: `ReplayOptions`, the one object `replay.replay_with` and the execution stack take."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from .config import EngineConfig
from .router import RouterLoss


@dataclass(frozen=True)
class ReplayOptions:
    """The options of one engine call (`replay.replay_backward` lists what each does).

    temperature: logprobs are of softmax(logits / temperature), > 0. engine: the `EngineConfig` (packing,
    chunking, replay). trusted: run a family outside the registry as `families.generic_family` guesses it, without a
    check (the caller checked it). lockstep: every forward and backward in step with the other ranks.
    final_backward: a context around the call's last backward (data parallelism's one gradient reduction).
    head_stats: names of `head.HEAD_STATS` to return. router: the MoE router load-balancing loss's `RouterLoss`.
    """

    temperature: float = 1.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    trusted: bool = False
    lockstep: bool = False
    final_backward: contextlib.AbstractContextManager | None = None
    head_stats: tuple[str, ...] = ()
    router: RouterLoss | None = None
