"""Lock-step execution of the ranks' forwards and backwards, for FSDP2 with its parameters gathered per layer.

With `reshard_after_forward=True` every decoder forward and backward is a sequence of per-layer collectives that
every rank must issue in the same order, but the ranks' shares of a step differ. The engine's traversal is a
generator (`stack._Run.children`) that yields FORWARD before each decoder forward (a pack's or a memory probe's),
BACKWARD before each backward, and CP_FORWARD / CP_BACKWARD before a context-parallel round. `LockStep.run` is one
tick per event: the ranks all-gather the kind of their next event, take the kind most of them wait for (FORWARD on a
tie), and the ranks without such an event run a dummy of that kind through every layer (a one-token forward without
a graph, or a backward of zero through a one-token graph). A context-parallel event runs only when every rank waits
for it; anything else raises. `drain` runs the generator alone (one process, or FSDP2 gathered once per step).
Design notes and measurements: docs/distributed.md, docs/notes/execution-stack.md.
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
