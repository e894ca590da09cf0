"""The keywords the TRL drop-ins take besides TRL's own: `DropInOptions` (one source for their checks, their help
and the config reference page)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from ..engine import EngineConfig
from ..fields import check, choice, help_of
from ..rl.config.reference import fields_table

UnknownFamily = Literal["self-check", "refuse"]
SplitGroups = Literal["auto", "recompute", "context-parallel"]


@dataclass(frozen=True)
class DropInOptions:
    """`TreeGRPOTrainer(..., engine=..., unknown_family=..., split_groups=...)`: each field's help is its metadata.

    Raises:
        ValueError: naming the keyword, for a value outside its choices.
    """

    engine: EngineConfig | None = field(default=None, metadata=help_of(
        "packing, chunking, replay and memory options of the execution stack (`branchreplay.engine.EngineConfig`, "
        "the `engine` section of a run config); None for its defaults. None of them change the result"))
    unknown_family: UnknownFamily = field(default="self-check", metadata=help_of(
        "a model family outside the engine's registry: 'self-check' it when the trainer is built (the engine "
        "against the naive per-rollout computation on a small random tree of the model itself, as "
        "`branchreplay train`'s train.unknown_family) or 'refuse' it"))
    split_groups: SplitGroups = field(default="auto", metadata=help_of(
        "on several processes, a GRPO or RLOO group whose rows land on several ranks has its prompt 'recompute'd "
        "by each of them, or run once across the ranks ('context-parallel'), or 'auto': per prompt the faster on "
        "the engine's cost model. DPO's pairs each lie on one rank"))
    reward_timeout_s: float | None = field(default=None, metadata=help_of(
        "seconds a reward function (a Python callable of reward_funcs) may take per call, > 0, or None for no "
        "limit (TRL's): past it the call raises TimeoutError naming the function, so that a reward hung on one "
        "rank ends the job at once, the other ranks naming the rank that stopped, instead of blocking until the "
        "process group's timeout (30 minutes by default); as `branchreplay train`'s task.reward_timeout_s"))

    def __post_init__(self):
        choice("unknown_family", self.unknown_family, UnknownFamily)
        choice("split_groups", self.split_groups, SplitGroups)
        if self.reward_timeout_s is not None:
            check("reward_timeout_s", self.reward_timeout_s > 0, "> 0 seconds", self.reward_timeout_s)

    @classmethod
    def pop_from(cls, kwargs: dict) -> DropInOptions:
        """The options among a trainer's keyword arguments, removed from `kwargs` (what is left is TRL's)."""
        return cls(**{f.name: kwargs.pop(f.name) for f in fields(cls) if f.name in kwargs})


def keywords_reference() -> str:
    """The config reference page's section on these keywords (markdown; `rl.config.reference`)."""
    return "\n".join(["## TRL drop-ins' keywords", "", "`TreeGRPOTrainer`, `TreeRLOOTrainer` and `TreeDPOTrainer` "
                      "take these keywords besides TRL's own (`branchreplay.trl.options.DropInOptions`).", "",
                      fields_table(DropInOptions)])
