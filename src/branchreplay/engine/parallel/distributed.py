"""Data parallelism for the execution stack on torch.distributed: FSDP2 (`fully_shard` per decoder layer) in one of two
modes, or DDP semantics (replicated parameters, gradients all-reduced once per step in one flattened collective).

FSDP2 "gather-once": every layer is unsharded once per step, stays unsharded through every pack, and reduce-scatters
the step's gradient once, in the step's last backward (`final_sync`): ZeRO-2's memory during the step, ZeRO-3's
outside it. FSDP2 "resharded" (FSDP2's default): each pack's forward and backward gather and free every layer and
each backward reduce-scatters its gradient at once: ZeRO-3's memory throughout, more bytes moved, and the ranks run
their packs in lock-step (`lockstep.py`). `fsdp_mode` picks by memory. The parameters outside the layers (embeddings,
final norm, LM head) are replicated and all-reduced once per step. Every reduction is a SUM on every backend (the
loss weights are computed over the whole step), so the ranks' summed gradient is the single-process gradient.
Design notes and measurements: docs/distributed.md, docs/notes/execution-stack.md.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Iterator
from typing import Literal, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ...models import base_decoder, is_mixture_of_experts
from ..head import check_head
from .lockstep import collective_device

Strategy = Literal["fsdp2", "ddp"]
FsdpMode = Literal["auto", "gather-once", "resharded"]
GATHER_ONCE_SHARE = 0.25
"""`fsdp_mode` "auto" gathers once when the full parameters and gradients take at most this share of a rank's
memory."""


def fsdp_mode(model, requested: FsdpMode = "auto", memory_bytes: int | None = None) -> str:
    """The FSDP2 mode: `requested` unless "auto", which is "gather-once" when the model's parameters and their
    gradients, unsharded (2 x parameter bytes), take at most `GATHER_ONCE_SHARE` of `memory_bytes` (default: the
    rank's memory, `rank_memory_bytes`), else "resharded"; with torch.distributed initialised, the smallest rank's
    memory, so that every rank takes the same mode. Gather-once moves fewer bytes (one all-gather and one
    reduce-scatter per step, against two and one per pack) and needs no lock-step; resharded holds one layer's full
    parameters at a time."""
    if requested != "auto":
        return requested
    memory = memory_bytes or rank_memory_bytes(model)
    if dist.is_initialized():
        smallest = torch.tensor([memory], dtype=torch.int64, device=collective_device())
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        memory = int(smallest)
    need = 2 * param_bytes(model)
    return "gather-once" if need <= GATHER_ONCE_SHARE * memory else "resharded"


def param_bytes(module) -> int:
    """The bytes of `module`'s parameters, unsharded."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def rank_memory_bytes(model) -> int:
    """The memory of one rank: its GPU's (`total_memory`) for a model on CUDA, else the machine's physical memory
    divided by the local world size (LOCAL_WORLD_SIZE, as torchrun sets it)."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (`model.<base>.layers`, GPT-2's `h`). Raises ValueError when
    the model has neither."""
    base = base_decoder(model)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (expected .layers or .h on "
                         f"{type(base).__name__}); FSDP2 needs them to shard per layer")
    return list(layers)


class DataParallel:
    """`model` data-parallel over the default process group (module docstring). `strategy`: "fsdp2" or "ddp";
    `device`: the model's device type ("cpu" for gloo: an explicit CPU mesh even on a machine with CUDA, PyTorch
    issue 132471); `broadcast`: start every rank from rank 0's weights (False when the caller already did);
    `mode`: FSDP2's "gather-once" or "resharded" (module docstring; `fsdp_mode` resolves "auto"). `lockstep`: the
    engine must run its calls with `lockstep=True` (resharded). Construct it on every rank with the same model
    configuration; resharded runs one forward of one token at construction (FSDP2's prefetch needs every layer's
    state initialised) and the engine's head check (`head.check_head`) with the parameters gathered."""

    def __init__(self, model, strategy: Strategy, device: str = "cpu", broadcast: bool = True,
                 mode: str = "gather-once"):
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs torch.distributed initialised: start with torchrun (it sets RANK, "
                               "WORLD_SIZE, MASTER_ADDR) and call branchreplay.engine.parallel.distributed.init()")
        if mode not in ("gather-once", "resharded"):
            raise ValueError(f"FSDP2 mode {mode!r}: expected 'gather-once' or 'resharded' (fsdp_mode resolves 'auto')")
        self.model, self.strategy = model, strategy
        self.mode = mode if strategy == "fsdp2" else None
        self.lockstep = self.mode == "resharded"
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.layers = decoder_layers(model) if strategy == "fsdp2" else []
        layer_params = {id(p) for layer in self.layers for p in layer.parameters()}
        self.replicated = [p for p in model.parameters() if id(p) not in layer_params]
        for p in model.parameters() if broadcast else []:  # every rank starts from rank 0's weights
            dist.broadcast(p.data, src=0)
        if strategy == "fsdp2":
            from torch.distributed.fsdp import FSDPModule, fully_shard

            unused = hasattr(FSDPModule, "set_reduce_scatter_unused_params")  # not in torch 2.11's FSDP2
            if not unused and is_mixture_of_experts(model.config):
                # an expert no token of one rank reached: the ranks' reduce-scatters would disagree
                raise RuntimeError(f"FSDP2 of a mixture-of-experts model needs torch's "
                                   f"FSDPModule.set_reduce_scatter_unused_params (torch {torch.__version__} has "
                                   "none): upgrade torch, or use --parallel.strategy ddp")
            self.mesh = init_device_mesh(device, (self.world_size,))
            for layer in self.layers:
                fully_shard(layer, mesh=self.mesh, reshard_after_forward=self.lockstep)
                layer.set_gradient_divide_factor(1.0)
                layer.set_force_sum_reduction_for_comms(True)
                if unused:
                    layer.set_reduce_scatter_unused_params(True)  # a layer part of which a rank did not use (MoE)
                layer.set_reshard_after_backward(self.lockstep)
            if self.lockstep:
                self._prefetch()
                with self.gathered():  # the engine's head check, on every rank now: cached on some ranks only (a
                    check_head(model)  # self-check before sharding), its forwards would gather layers alone

    def _prefetch(self) -> None:
        """Each layer's forward prefetches the next layer's parameters, its backward the previous one's. Every layer
        is its own FSDP2 root (the engine calls the embeddings and the head itself), whose communication state
        exists only after its first forward: one forward of one token, on every rank, makes it."""
        with torch.no_grad():
            self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.replicated[0].device))
        for before, after in itertools.pairwise(self.layers):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """While inside, the FSDP2 layers hold their full parameters (one all-gather per layer, on every rank alike),
        so that forwards and backwards, however many each rank runs (sampling, packs), need no collective;
        resharded on exit (before the optimizer step, which updates the shards). In resharded mode the layers do
        not reshard after each forward while inside."""
        for layer in self.layers:
            layer.set_reshard_after_forward(False)
            layer.unshard()
        try:
            yield
        finally:
            for layer in self.layers:
                layer.reshard()
                layer.set_reshard_after_forward(self.lockstep)

    def no_sync(self):
        """While inside, backward passes accumulate local gradients without any collective (until `final_sync`)."""
        return self._gradient_sync(False)

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """One step's backward passes: `gathered` and `no_sync` together; in resharded mode nothing (each backward
        reduce-scatters its layers' gradients)."""
        if self.lockstep:
            yield
            return
        with self.gathered(), self.no_sync():
            yield

    def final_sync(self):
        """Around the step's last backward: the FSDP2 layers reduce-scatter the accumulated gradient (a sum); in
        resharded mode nothing (every backward did)."""
        return contextlib.nullcontext() if self.lockstep else self._gradient_sync(True)

    @contextlib.contextmanager
    def _gradient_sync(self, enabled: bool) -> Iterator[None]:
        """The FSDP2 layers' gradient sync set to `enabled` while inside, and to the opposite on exit."""
        for layer in self.layers:
            layer.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            for layer in self.layers:
                layer.set_requires_gradient_sync(not enabled)

    def reduce_replicated(self) -> None:
        """All-reduce (sum) the gradients of the replicated parameters, in one flattened collective. A parameter
        without a gradient on a rank counts as zero there."""
        params = [p for p in self.replicated if p.requires_grad]
        if not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def full_grads(self) -> list[torch.Tensor]:
        """Every parameter's reduced gradient as a full (unsharded) tensor, zeros where none (for checks)."""
        out = []
        for p in self.model.parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out.append(g.full_tensor() if hasattr(g, "full_tensor") else g)
        return out


@torch.no_grad()
def clip_grad_norm_(parallels: list[DataParallel], max_norm: float) -> float:
    """Clip the reduced gradients of the models of `parallels` together to a total L2 norm of `max_norm`, as
    torch.nn.utils.clip_grad_norm_ over all their parameters (scale max_norm / (norm + 1e-6) when below 1), with the
    norm over the whole models: the FSDP2 shards' squares summed over ranks, the replicated parameters counted once
    (float64). Every rank calls it. Returns the norm before clipping."""
    params = [p for dp in parallels for p in dp.model.parameters() if p.grad is not None]
    local = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for p in params:
        if hasattr(p.grad, "to_local"):
            local += p.grad.to_local().double().pow(2).sum().cpu()
        else:
            replicated += p.grad.double().pow(2).sum().cpu()
    dist.all_reduce(local)
    norm = float((local + replicated).sqrt())
    coef = min(max_norm / (norm + 1e-6), 1.0)
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return norm


def init(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """`init_process_group` from the torchrun environment, collectives timing out after `timeout_s` seconds; returns
    (rank, world_size). gloo on CPU; with CUDA, the device of LOCAL_RANK and "cpu:gloo,cuda:nccl" (CUDA tensors over
    nccl, the CPU ones: counts, objects, norms, over gloo), unless `backend`. Raises RuntimeError without the
    torchrun environment. Run on one GPU (docs/gpu.md), not yet on several."""
    import datetime

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("no torchrun environment (RANK, WORLD_SIZE): launch with `torchrun --nproc_per_node N "
                           "-m branchreplay ...`, or drop --parallel.strategy for one process")
    if torch.cuda.is_available():  # one GPU per local rank; CPU tensors (counts, small objects) go over gloo
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"),
                                timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for MASTER_PORT of local processes (verify and bench --nproc)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_together(error: BaseException | None, what: str, kinds: tuple[type, ...] = ()) -> None:
    """Raise on every rank when any rank failed at `what` (a collective: every rank calls it, in place of a barrier):
    the failing rank its own `error`, the others "`what` failed on rank R: ..." as a RuntimeError, or, when the
    failure is an instance of one of `kinds` (exception classes the caller handles: a PermissionError is an
    OSError), as that class, so that every rank takes the same path; no rank waits for the collective timeout in the
    next collective. Without a process group, raise
    `error` if any."""
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    errors = [None] * dist.get_world_size()
    said = None if error is None else (f"{type(error).__name__}: {error}",  # and the first of `kinds` it is, by index
                                       next((i for i, k in enumerate(kinds) if isinstance(error, k)), None))
    dist.all_gather_object(errors, said)
    if error is not None:
        raise error
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, (text, kind) = failed[0]
        raise (RuntimeError if kind is None else kinds[kind])(f"{what} failed on rank {rank}: {text}")


def shutdown() -> None:
    """End data parallelism on a rank whose work succeeded: a barrier, then `destroy_process_group`. Without the
    barrier a rank that finishes first tears down its gloo connections while another still talks to it, and gloo
    aborts one of them ("terminate called without an active exception", SIGABRT: seen twice in
    tests/test_engine_distributed.py). After an error, do not call it: a barrier or a destroy while another rank
    sits in a collective blocks (torchtitan destroys the group only after a successful run, for that reason); the
    collective timeout then stops the others. A no-op without a process group. A spawned rank ends with
    `end_spawned_rank` instead."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def end_spawned_rank() -> NoReturn:
    """End a rank started by `torch.multiprocessing.spawn` whose work succeeded and whose results are written:
    `shutdown`, flush stdout and stderr, then `os._exit(0)`, skipping the interpreter's teardown. There, now and
    then, a gloo worker thread still drops the last reference to a collective's tensor, takes the GIL during
    finalization, is ended by Python with `pthread_exit`, and the C++ runtime aborts the rank ("terminate called
    without an active exception", SIGABRT: seen in tests/test_engine_distributed.py and `verify --nproc 2` under load;
    pytorch/pytorch#179291 describes it), which spawn reports as that rank's failure after its work succeeded.
    The `atexit` handlers run first, as at a normal exit (the weight-sync files in /dev/shm are removed there).
    For the check, bench and test workers only: a torchrun process ends through `shutdown` and the CLI."""
    import atexit

    shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


ROLLOUT_FIELDS = ("token_ids", "loss_mask", "advantages", "weights", "old_logprobs", "ref_logprobs", "returns",
                  "old_values")


def check_same_trees(trees: list, layout: str) -> None:
    """Raises ValueError, on every rank alike, naming the ranks whose `trees` (every rollout's tensors, in order) or
    plan `layout` differ from rank 0's: each rank runs its share of the plan of all trees, so different trees would
    give a wrong gradient without an error. One object all-gather of a SHA-256 digest (a collective: every rank of
    the default group calls it)."""
    import hashlib

    digest = hashlib.sha256(layout.encode())
    for tree in trees:
        digest.update(len(tree.rollouts).to_bytes(8, "little"))
        for rollout in tree.rollouts:
            for name in ROLLOUT_FIELDS:
                value = getattr(rollout, name)
                digest.update(name.encode() + (b"-" if value is None else value.double().numpy().tobytes()))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest.hexdigest())
    others = [r for r, d in enumerate(everyone) if d != everyone[0]]
    if others:
        raise ValueError(f"replay_backward_sharded: the trees of rank {', '.join(map(str, others))} differ from rank "
                         f"0's: every rank must pass the same trees (the plan gives each rank its share of them)")
