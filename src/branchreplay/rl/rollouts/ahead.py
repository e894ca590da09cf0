"""Rollouts drawn ahead (grpo.max_staleness = k >= 1): the batches of the next steps are sampled in a process of
their own while the trainer trains this step.

Step t trains on a batch drawn by weights at most k versions older than its own (`Ahead`: the schedule, the bound,
a resume); every group carries the version that drew it (`Batch.versions`), and the batch's logprobs are the
behaviour logprobs the update's ratio takes. The process (`SamplerProcess`, started by `start_sampler` on rank 0) is
forked before the trainer shards or changes its model; it samples a model on the CPU in-process or drives the vLLM
server, and reads each version's weights from shared memory. Its death fails the step with `SamplerFailed`;
`check_ahead` refuses what it cannot serve (DPO, no fork, an accelerator without vLLM). User guide:
docs/rollouts_ahead.md.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import signal
import time
import warnings
from typing import TYPE_CHECKING

import torch

from ..data.rewards import RewardFunctionError
from .batch import Batch
from .trajectories import ItemError
from .vllm.client import VLLMError

if TYPE_CHECKING:
    from ..config import Config
    from ..policy import Policy
    from ..run.parallel import Ranks

RAISED = {e.__name__: e for e in (RewardFunctionError, ItemError, VLLMError)}  # a step's own errors, re-raised


class SamplerFailed(RuntimeError):
    """The sampler process died, or failed on something other than a step's own error."""


def check_ahead(config: Config, samples: bool, device: torch.device) -> None:
    """Raise ValueError naming grpo.max_staleness where rollouts cannot be drawn ahead: an algorithm that does not
    sample (DPO), no fork on this platform, a model on an accelerator with the in-process sampler."""
    k = config.grpo.max_staleness
    if not k:
        return
    if not samples:
        raise ValueError(f"grpo.max_staleness={k} draws rollouts ahead; algorithm {config.algorithm} trains on "
                         "fixed pairs, not sampled rollouts: set grpo.max_staleness 0")
    if "fork" not in multiprocessing.get_all_start_methods():
        raise ValueError(f"grpo.max_staleness={k} forks a sampler process, which this platform cannot: set "
                         "grpo.max_staleness 0")
    if device.type != "cpu" and not config.sampling.uses_vllm:
        raise ValueError(f"grpo.max_staleness={k} samples in a forked process, which cannot use {device.type}: set "
                         "sampling.backend vllm, or grpo.max_staleness 0")


class SamplerProcess:
    """The forked process that draws batches with `sampler` (a `Sampler` over its own copy of the model, in one
    process: no ranks) from the weights in `slots` (per slot, the model's state dict in shared memory).

    The process is forked from the trainer before the trainer shards or changes its model, so it holds its own copy
    of the model, the task, the reward functions and the environment; only the requests and the batches are
    pickled. It runs one CPU thread (GNU OpenMP cannot start threads in a child forked after its parent ran its own)
    and cannot use CUDA (a forked child cannot), so it samples in-process only for a model on the CPU; with
    sampling.backend vllm it drives the server instead, pushing each version's weights before it asks. The weights
    travel through k slots of shared memory allocated before the fork: the request for step s uses slot s % k,
    written after the batch that used it last was taken.

    Faults: the process dying fails the step with `SamplerFailed` naming it (the run keeps its checkpoint). Ctrl-C
    reaches the trainer alone (the process ignores SIGINT) and the trainer closes it; a killed trainer leaves the
    process to find its pipe closed and exit."""

    def __init__(self, sampler, slots: list[dict]):
        self.slots = slots
        context = multiprocessing.get_context("fork")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(sampler, child, self.conn, slots), daemon=True,
                                       name="branchreplay-sampler")
        self.process.start()
        child.close()

    def ask(self, step: int, version: int, slot: int) -> None:
        """Ask for the batch of `step`, drawn by weights `version`, held in slot `slot`."""
        try:
            self.conn.send((step, version, slot))
        except OSError as e:
            raise SamplerFailed(self.died() or f"the sampler process cannot be asked for step {step} ({e})") from e

    def take(self) -> tuple:
        """The next answer: (step, version, ("batch", Batch) or (error kind, message), seconds, warnings). Raises
        SamplerFailed when the process died."""
        while not self.conn.poll(0.2):
            if not self.process.is_alive():
                raise SamplerFailed(self.died())
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise SamplerFailed(self.died() or f"the sampler process's answer was cut off ({e})") from e

    def died(self) -> str:
        """Why the process is gone ("" while it runs)."""
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        if code is None:
            return ""
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"the sampler process (pid {self.process.pid}) {how}"

    def close(self) -> None:
        """Stop the process (it finishes the batch it draws, or is terminated after 5 s)."""
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(timeout=5.0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5.0)
        self.conn.close()


def _serve(sampler, conn, parent_end, slots: list[dict]) -> None:
    """The sampler process: load the asked version's weights, draw the batch, send it; until told to stop or the
    trainer is gone. Exits with os._exit: the trainer's exit handlers are not its own."""
    parent_end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes this process
    torch.set_num_threads(1)
    state = sampler.policy.model.state_dict()
    loaded = None
    try:
        while True:
            try:
                request = conn.recv()
            except EOFError:  # the trainer is gone
                break
            if request is None:
                break
            step, version, slot = request
            if version != loaded:
                with torch.no_grad():
                    for name, tensor in state.items():
                        tensor.copy_(slots[slot][name])
                sampler.policy.version = loaded = version  # the sampler syncs its back-end (vLLM) to it
            conn.send_bytes(pickle.dumps((step, version, *_draw(sampler, step, version))))
    except (BrokenPipeError, ConnectionResetError):  # the trainer is gone
        pass
    finally:
        os._exit(0)


def _draw(sampler, step: int, version: int) -> tuple:
    """(("batch", the batch) or (error kind, message), seconds, the warnings it raised) of `step`."""
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            batch = sampler.batch(step)
            batch.versions = [version] * len(batch.rollouts)
            reply = ("batch", batch)
        except tuple(RAISED.values()) as e:
            reply = (type(e).__name__, str(e), getattr(e, "traceback", ""))
        except Exception as e:  # noqa: BLE001 (named in the trainer's one line)
            reply = ("error", f"{type(e).__name__}: {e}")
    return reply, time.perf_counter() - start, [str(w.message) for w in caught]


def start_sampler(config: Config, policy: Policy, sampler_of, ranks: Ranks | None) -> SamplerProcess | None:
    """The sampler process of a run with grpo.max_staleness >= 1, on rank 0 (None on the others): forked now, with
    a `Sampler` built by `sampler_of(policy)` over a one-process copy of `policy` and one shared slot of weights
    per batch in flight."""
    if ranks is not None and ranks.rank != 0:
        return None
    sampler = sampler_of(dataclasses.replace(policy, ranks=None, dp=None, optimizer=None, scheduler=None))
    sampler.backend.keeps_logprobs = True  # the behaviour logprobs, for the ratio
    sampler.status = lambda text: None  # nothing to show: the trainer shows its wait
    slots = [{name: torch.empty_like(t, device="cpu").share_memory_() for name, t in policy.model.state_dict().items()}
             for _ in range(config.grpo.max_staleness)]
    return SamplerProcess(sampler, slots)


class Ahead:
    """The batches of a run with grpo.max_staleness = k >= 1: `sample(step)` and `score(batch)` as `Sampler`'s (the
    batch comes scored: `score` gives it back).
    `process`: the `SamplerProcess` on rank 0 (None on the others); `local`: the trainer's own `Sampler`, which
    draws a batch again when one is beyond the bound; `policy`: the trained `Policy` whose weights are sent;
    `last`: the run's last step (train.steps), beyond which nothing is asked for.

        step t (the weights are version t - 1: the sampling rounds trained before it)
            take batch t            drawn by version t - 1 - k (by a later one in the first k steps of a run or resume)
            ask for batch t + k     drawn by version t - 1, whose weights are copied into a shared slot
            train on batch t        while the sampler process draws the batches asked for

    Every group of a batch carries the version that drew it (`Batch.versions`), so its staleness (the versions
    between it and the weights that train it) is at most k by construction. A batch beyond the bound all the same
    is dropped, counted (sample/dropped_stale_total, groups) and drawn again by the trainer's own `Sampler` with its
    current weights, never trained. The process draws a batch exactly as the synchronous loop would with those
    weights (`Sampler.batch`: group k of step s from a generator seeded by (train.seed, s, k)); its logprobs travel
    with the batch, the behaviour logprobs the update's ratio takes (`run.step.passes`). Under
    torchrun rank 0 owns the process and every rank receives the batch. A resume asks again for the batches that
    were in flight, drawn by the checkpoint's weights: nothing is lost and nothing trains twice."""

    def __init__(self, process: SamplerProcess | None, local, policy: Policy, bound: int, last: int,
                 ranks: Ranks | None = None,
                 status=lambda text: None):
        self.process, self.local, self.policy, self.bound, self.ranks = process, local, policy, bound, ranks
        self.last = last
        self.status = status
        self.asked = 0  # the last step asked for

    def score(self, batch: Batch) -> Batch:
        """`batch`: the sampler process scored it."""
        return batch

    def sample(self, step: int) -> Batch:
        """The batch of `step` (>= 1), the weights now being version step - 1. Raises what its draw raised
        (RewardFunctionError, ItemError, VLLMError), SamplerFailed when the process died."""
        version = step - 1
        if self.asked < step:  # the start of a run or a resume
            self.ask(step, version)
        self.status(f"step {step}: waiting for the sampler process")
        answer = self.take(step)
        for later in range(self.asked + 1, min(step + self.bound, self.last) + 1):
            self.ask(later, version)
        _, drawn_by, reply, seconds, caught = answer
        for message in caught:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        if reply[0] == "error":
            raise SamplerFailed(f"the sampler process failed on step {step}: {reply[1]}")
        if reply[0] != "batch":
            error = RAISED[reply[0]](reply[1])
            if reply[2]:  # a reward's traceback (RewardFunctionError.traceback)
                error.traceback = reply[2]
            raise error
        batch, dropped = reply[1], 0
        if version - min(batch.versions) > self.bound:  # never by this schedule; never trained all the same
            dropped = len(batch.rollouts)
            batch = self.local.batch(step)
            batch.versions = [version] * len(batch.rollouts)
        staleness = [version - v for v in batch.versions]
        batch.metrics.update({"sample/staleness_mean": sum(staleness) / len(staleness),
                              "sample/staleness_max": max(staleness), "sample/dropped_stale_total": dropped,
                              "time/sampler_process_s": seconds})
        return batch

    def describe(self) -> str:
        """Who draws the batches, for the run's console."""
        who = f"the sampler process (pid {self.process.process.pid})" if self.process is not None else \
            "rank 0's sampler process"
        fed = ", fed by rank 0; every rank receives each batch" if self.ranks is not None else ""
        return f"rollouts ahead (grpo.max_staleness={self.bound}): {who} draws the next steps{fed}"

    def ask(self, step: int, version: int) -> None:
        """Ask the process for `step`'s batch with the current weights (`version`); every rank calls it (the full
        weights are gathered to rank 0 under FSDP2)."""
        state = self.policy.full_state_dict()
        if self.process is not None:
            slot = self.process.slots[step % self.bound]
            with torch.no_grad():
                for name, tensor in slot.items():
                    tensor.copy_(state[name])
            self.process.ask(step, version, step % self.bound)
        self.asked = step

    def take(self, step: int) -> tuple:
        """The process's answer for `step`, on every rank."""
        answer, failure = None, None
        if self.process is not None:
            try:
                answer = self.process.take()
            except SamplerFailed as e:
                if self.ranks is None:
                    raise
                failure = str(e)
        if self.ranks is not None:
            answer, failure = self.ranks.gather((answer, failure))[0]
            if failure is not None:
                raise SamplerFailed(failure)
        if answer[0] != step:
            raise SamplerFailed(f"the sampler process answered step {answer[0]} when step {step} was due")
        return answer

    def close(self) -> None:
        """Stop the sampler process (rank 0)."""
        if self.process is not None:
            self.process.close()
