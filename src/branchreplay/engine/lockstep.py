"""Lock-step execution of the ranks' forwards and backwards, for FSDP2 with its parameters gathered per layer.

With `reshard_after_forward=True` every decoder layer's forward all-gathers its parameters and frees them after,
and its backward all-gathers them again and reduce-scatters its gradient: every forward and every backward of the
decoder is a sequence of collectives, one or two per layer, that every rank must issue in the same order. The ranks'
shares of a step differ (other trees, other numbers of packs), so they cannot simply run their packs.

The engine's traversal is therefore a generator (`stack._Run.children`): before each decoder forward (a pack's,
or one of the planner's memory probes, which a rank runs when it first meets a tree size) it yields FORWARD,
before each backward BACKWARD, before a context-parallel round (`context_parallel.py`, whose layers all-gather K/V
too) CP_FORWARD or CP_BACKWARD. `LockStep.run` is one tick per collective event: the ranks
all-gather the kind of their next event (one int each), take the kind most of them wait for (FORWARD before
BACKWARD on a tie), and the ranks whose next event is of that kind run it while the others run a dummy of the same
kind: a forward of one token without a graph, or a backward of zero through a one-token graph made at the start
(kept with `retain_graph`), both through every layer and so through the same collectives. Every tick moves at least
one rank on, so the run ends; a context-parallel event runs only when every rank waits for it (every rank holds the
same context-parallel parts), anything else is a bug and raises. The cost: each tick moves a layer's parameters
(and a backward its gradient) whether the rank had work or not, and a tick's kind costs one small all-gather.

`drain` runs the same generator alone (one process, or FSDP2 gathered once per step, where no layer talks to the
other ranks during a pack).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TypeVar

import torch
import torch.distributed as dist

FORWARD, BACKWARD, CP_FORWARD, CP_BACKWARD = "forward", "backward", "context-parallel forward", \
    "context-parallel backward"
_CODES = {None: 0, FORWARD: 1, BACKWARD: 2, CP_FORWARD: 3, CP_BACKWARD: 4}  # None: the rank's events are done
_KINDS = {code: kind for kind, code in _CODES.items()}

T = TypeVar("T")
Events = Generator[str, None, T]


def drain(events: Events[T]) -> T:
    """Run `events` to its end, every event as it comes; returns the generator's return value."""
    while True:
        try:
            next(events)
        except StopIteration as done:
            return done.value


class LockStep:
    """Runs a rank's events in step with the other ranks of the default process group (module docstring).

    dummy_forward: a forward of one token through every decoder layer, returning a tensor of the graph (hidden
        state); run with autograd once at the start when `train`, without after.
    train: whether the events hold backwards (a replay with a loss), so that the dummy graph is needed.
    ticks, dummies: counted over `run` calls (ticks: collective events run; dummies: those this rank ran empty).
    """

    def __init__(self, dummy_forward: Callable[[], torch.Tensor], train: bool):
        self.dummy_forward, self.train = dummy_forward, train
        self.ticks = self.dummies = 0

    def run(self, events: Events[T]) -> T:
        """Run `events` to its end in step with the other ranks; returns the generator's return value. Raises
        RuntimeError when the ranks wait for context-parallel events of different kinds (different plans)."""
        device = collective_device()
        dummy = self.dummy_forward().sum() * 0 if self.train else None  # every rank at once, as the first tick
        self.ticks += 1
        result, pending = None, None
        try:
            pending = next(events)
        except StopIteration as done:
            result = done.value
        while True:
            codes = torch.tensor([_CODES[pending]], device=device)
            gathered = [torch.empty_like(codes) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, codes)
            kinds = [_KINDS[int(c)] for c in gathered]
            if all(k is None for k in kinds):
                return result
            kind = _choose(kinds)
            self.ticks += 1
            if kind == pending:
                try:
                    pending = next(events)
                except StopIteration as done:
                    result, pending = done.value, None
                continue
            self.dummies += 1
            if kind == FORWARD:
                with torch.no_grad():
                    self.dummy_forward()
            else:
                torch.autograd.backward(dummy, torch.ones_like(dummy), retain_graph=True)


def _choose(kinds: list[str | None]) -> str:
    """The kind of this tick: of FORWARD and BACKWARD the one most ranks wait for (FORWARD on a tie); a
    context-parallel kind only when every rank waits for it."""
    forward, backward = kinds.count(FORWARD), kinds.count(BACKWARD)
    if forward or backward:
        return FORWARD if forward >= backward else BACKWARD
    if len(set(kinds)) == 1:
        return kinds[0]
    raise RuntimeError(f"the ranks are out of step: they wait for {kinds} (every rank must hold the same "
                       "context-parallel parts, in the same order)")


def collective_device() -> torch.device:
    """The device of a small collective of the default process group (the lock-step's kinds, the trainer's counts):
    CPU (gloo, or the CPU half of "cpu:gloo,cuda:nccl"), CUDA on a process group that is nccl only."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
