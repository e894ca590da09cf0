"""The training side of data parallelism: who runs which prompts, and what the ranks agree on.

A step under torchrun: every rank computes the step's prompt indices (the same on all ranks); rank r samples and
scores the groups k with k % world_size == r, each group with its own generator seeded by (train.seed, step, k), so
a group's samples do not depend on the world size; the groups are gathered, so every rank holds the whole batch and
computes the same advantages and loss weights (normalised over the whole step); the trees then go to ranks by predicted
cost (`engine.parallel.sharding`) and the gradient is reduced once (`engine.parallel.distributed`). Losses, loss
statistics and stop requests are reduced across ranks; rank 0 alone writes the run folder. A rank that dies or hangs is
named by the others through the rendezvous store (`Heartbeat`), since a failed collective does not say which rank it
was.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import yaml

from ...engine.parallel.distributed import init


@dataclass(frozen=True)
class Ranks:
    """This process's place among the data-parallel ranks (torch.distributed's default group)."""

    rank: int
    world_size: int
    heartbeat: Heartbeat | None = field(default=None, compare=False)

    def mine(self, n: int) -> list[int]:
        """The indices of `n` groups that this rank samples and scores: k with k % world_size == rank."""
        return list(range(self.rank, n, self.world_size))

    def gather(self, obj) -> list:
        """`obj` of every rank, in rank order (all_gather_object: small picklable values only)."""
        out = [None] * self.world_size
        with self.waiting():
            dist.all_gather_object(out, obj)
        return out

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64)
        with self.waiting():
            dist.all_reduce(t)
        return t.tolist()

    def doing(self, text: str) -> None:
        """This rank's phase, for the others to read if it never arrives (`Heartbeat.phase`)."""
        if self.heartbeat is not None:
            self.heartbeat.phase(text)

    def waiting(self):
        """Context: this rank waits for the others in a collective (`Heartbeat.waiting`)."""
        return self.heartbeat.waiting() if self.heartbeat is not None else contextlib.nullcontext()

    def any(self, flag: bool) -> bool:
        """Whether any rank's flag is set (e.g. a stop request), so that all ranks stop at the same step."""
        return self.sum([float(flag)])[0] > 0


def launch(strategy: str, config: dict, timeout_s: float = 600.0) -> Ranks | None:
    """Start data parallelism for `strategy` (`ParallelConfig.strategy`): None for one process ("auto" without
    torchrun, or with a world size of 1), else the initialised `Ranks`, after checking that every rank was started
    with the same configuration (`config`, the run config as a dict, hashed); collectives time out after
    `timeout_s` seconds (a rank that died stops the others with torch.distributed's error).

    Raises ValueError: "fsdp2" / "ddp" without torchrun's environment, or ranks with different configurations."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if strategy == "auto" and world == 1:
        return None
    if "RANK" not in os.environ:
        raise ValueError(f"parallel.strategy={strategy!r} needs torchrun: launch with `torchrun --nproc_per_node N "
                         "-m branchreplay train ...`, or leave parallel.strategy at 'auto' for one process")
    rank, world = init(timeout_s=timeout_s)
    ranks = Ranks(rank, world, Heartbeat(rank, world))
    digest = hashlib.sha256(yaml.safe_dump(config, sort_keys=True).encode()).hexdigest()
    digests = ranks.gather(digest)
    different = [r for r, d in enumerate(digests) if d != digests[0]]
    if different:
        raise ValueError(f"ranks {different} were started with a configuration different from rank 0's: start every "
                         "rank with the same --config and overrides")
    return ranks


FAILED = "failed in "
"""The start of the phase a rank writes when it raises (`Trainer.fit`)."""


class Heartbeat:
    """This rank's liveness counter in the rendezvous store (TCPStore at MASTER_ADDR:MASTER_PORT, torchrun's agent
    or rank 0), bumped every `period_s` seconds by a daemon thread until `stop()` (at the latest at exit: a thread
    left inside the store's C++ client while the process exits makes it abort).

    A rank that dies (killed, out of memory) makes the others' next collective fail: gloo at once (the peer's socket
    closes), nccl at the collective timeout (`parallel.timeout_s`). Which rank it was, the error does not say (gloo
    names an address); `dead_ranks` names the ranks whose counter stood still. A rank that is alive but never
    arrives (a reward function that hangs) keeps beating; its collective partners fail at the collective timeout.
    So every rank also writes its phase there (`phase`: what the run loop shows in its progress bar, "step 3:
    scoring 8 completions"), and marks it waiting while it is inside one of the trainer's collectives
    (`Ranks.gather`, `sum`, `any`); `stuck_ranks` names the ranks that were not waiting, and what they were doing
    since when. A rank that raises writes its error as its phase before it leaves, so that the others name it
    whichever way its exit reaches them.

    `dead_ranks()` reads every rank's counter, waits `wait_s` seconds (several periods), reads again, and returns
    the other ranks whose counter did not move and that did not say they were `leaving()` (a survivor that found
    the dead rank and is exiting: with 3 or more ranks the slower survivors must not name it); when the store
    itself cannot be reached, rank 0 (which holds it when the ranks were not started by torchrun) is taken for
    dead. Both in a rank's own words: seconds. A beat that fails (the store slow to answer) is retried at the next
    period."""

    PREFIX = "branchreplay/heartbeat/"

    def __init__(self, rank: int, world_size: int, period_s: float = 0.5, wait_s: float = 2.0):
        self.rank, self.world_size, self.period_s, self.wait_s = rank, world_size, period_s, wait_s
        self.text = "the start"  # this rank's phase (`phase`)
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=datetime.timedelta(seconds=5))
        self.store.add(self._key(rank), 1)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="branchreplay-heartbeat", daemon=True)
        self.thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """End the beats (idempotent); the others then take this rank for dead, so call it only at the end."""
        self.stopped.set()
        self.thread.join(timeout=10)

    def leaving(self) -> None:
        """Say in the store that this rank stops on purpose (it found a dead rank), before it exits."""
        try:
            self.store.set(self._key(self.rank, "leaving"), "1")
        except Exception:  # noqa: BLE001 (the store is gone: nobody is left to read it)
            pass

    def phase(self, text: str, waiting: bool = False) -> None:
        """Write what this rank is doing (from now) to the store; a failed write is let go (the phase is a help)."""
        self.text = text
        try:
            self.store.set(self._key(self.rank, "phase"), json.dumps([time.time(), text, waiting]))
        except Exception:  # noqa: BLE001 (the store is slow or gone)
            pass

    @contextlib.contextmanager
    def waiting(self):
        """Marks this rank's phase as waiting for the others while inside (the phase text stays)."""
        text = self.text
        self.phase(text, waiting=True)
        yield  # left waiting when the collective raises: this rank did arrive
        self.phase(text)

    def stuck_ranks(self) -> list[tuple[int, str, float]]:
        """(rank, phase text, seconds in it) of the other ranks that were not waiting in a collective, the ones the
        others waited for; [] when every rank waits (or the store cannot be read). A rank that raised or is leaving
        (it found another rank dead or stuck) is not stuck."""
        try:
            phases = {r: self._phase(r) for r in range(self.world_size)
                      if r != self.rank and not self.store.check([self._key(r, "leaving")])}
        except Exception:  # noqa: BLE001 (the store cannot be reached)
            return []
        return [(r, text, time.time() - since) for r, (since, text, waiting) in phases.items()
                if text and not waiting and not text.startswith(FAILED)]

    def last_phase(self, rank: int) -> str:
        """The phase text `rank` last wrote, or "" (none, or the store cannot be read)."""
        try:
            return self._phase(rank)[1]
        except Exception:  # noqa: BLE001
            return ""

    def _phase(self, rank: int) -> tuple[float, str, bool]:
        """(since, text, waiting) of `rank`'s phase in the store; (0, "", False) when it wrote none."""
        if not self.store.check([self._key(rank, "phase")]):
            return 0.0, "", False
        since, text, waiting = json.loads(self.store.get(self._key(rank, "phase")))
        return since, text, waiting

    def _key(self, rank: int, what: str = "beats") -> str:
        return f"{self.PREFIX}{rank}/{what}"

    def _beat(self) -> None:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=5))  # its own connection: a store is not shared
        while not self.stopped.wait(self.period_s):
            try:
                store.add(self._key(self.rank), 1)
            except Exception:  # noqa: BLE001 (slow or gone: the next period tries again; `stop` ends the loop)
                continue

    def dead_ranks(self) -> list[int]:
        """The other ranks that stopped beating (class docstring); [] when every rank is alive."""
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            before = [self.store.add(self._key(r), 0) for r in others]
            time.sleep(self.wait_s)
            after = [self.store.add(self._key(r), 0) for r in others]
            stopped = [r for r, a, b in zip(others, before, after, strict=True) if a == b]
            return [r for r in stopped if not self.store.check([self._key(r, "leaving")])]
        except Exception:  # noqa: BLE001 (the store cannot be reached: its host is gone)
            return [0] if self.rank != 0 else []
