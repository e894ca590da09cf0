"""The tree trainers on several processes: which launches they run, and how the tree's gradient meets the wrapper.

TRL's `training_step` runs one `accelerator.backward` per micro-batch through the wrapper accelerate built; the tree
runs many backward passes (one per pack), and ranks run different trees, so no collective may depend on a pack.
Each micro-batch therefore runs the tree on full parameters without the wrapper's hooks, and hands the micro-batch's
gradient to the wrapper's own reduction once (`WrapperStep`: one process or DDP, FSDP2, DeepSpeed ZeRO). The
optimizer step, gradient clipping and logged grad_norm then see the wrapper's reduced gradient. TRL's loss keeps its
per-process normalisation (`num_items_in_batch` / num_processes for dapo and cispo, each process's own counts
otherwise), because the tree runs TRL's formula on each process's micro-batch. tests/test_trl_processes.py trains
each drop-in beside TRL's class under the same launch of 2 processes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ..engine.vision import is_vision_language
from ..models import is_mixture_of_experts
from .fsdp2 import fsdp2_gathered, fsdp2_unsharded
from .zero import hook_free, linear_surrogate


def launch_refusals(accelerator, model: torch.nn.Module, trainer: str, config: str) -> list[tuple[bool, str]]:
    """(refused, why) of the launch, when the trainer is built: FSDP1 and FSDP's activation checkpointing; models
    whose whole gradient the zero-loss token cannot hand on (FSDP2, ZeRO-3: it runs no vision tower; ZeRO-3: it
    reaches no unrouted expert); processes that do not train together (torchrun's WORLD_SIZE larger than
    accelerate's process count: on a machine without an accelerator, transformers gives each process a one-process
    state unless `use_cpu=True`, and each would train its own copy); and a launch that asked for several processes
    but started one (`accelerate launch --cpu --num_processes N`: accelerate's launcher for --cpu starts one process
    and sets only MASTER_ADDR; `asked_for_processes`)."""
    kind = accelerator.distributed_type.value
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    fsdp = getattr(accelerator.state, "fsdp_plugin", None) if kind == "FSDP" else None
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None) if kind == "DEEPSPEED" else None
    zero3 = deepspeed is not None and deepspeed.zero_stage == 3
    wrapper = "FSDP2" if fsdp is not None else "DeepSpeed ZeRO-3"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [
        (fsdp is not None and fsdp.fsdp_version != 2,
         f"FSDP version {fsdp.fsdp_version if fsdp else None} is not supported by {trainer}: set fsdp_version: 2 in "
         "accelerate's config (or fsdp_config={'fsdp_version': 2})"),
        (fsdp is not None and bool(getattr(fsdp, "activation_checkpointing", False)),
         f"FSDP's activation_checkpointing wraps the decoder layers, whose cached state the tree's packs hand on: set "
         f"it to false in accelerate's FSDP config ({trainer} replays packs itself under engine.memory_budget)"),
        ((fsdp is not None or zero3) and is_vision_language(base),
         f"{wrapper} of a vision-language model is not supported by {trainer}: the token that hands the tree's "
         "gradient to the wrapper does not run the vision tower; use DDP or DeepSpeed ZeRO-1/2"),
        (zero3 and is_mixture_of_experts(base.config),
         f"DeepSpeed ZeRO-3 of a mixture-of-experts model is not supported by {trainer}: the token that hands the "
         "tree's gradient to DeepSpeed reaches only its routed experts; use ZeRO-2, FSDP2 or DDP"),
        (launched > accelerator.num_processes,
         f"WORLD_SIZE={launched} processes were launched but accelerate sees {accelerator.num_processes}, so each "
         f"would train its own copy of the model: on a machine without an accelerator set {config}(use_cpu=True); "
         "with accelerators, launch one process per device"),
        (asked_for_processes() and accelerator.num_processes == 1,
         f"accelerate launch was asked for several processes but started one ({trainer} would train alone, "
         "silently): its --cpu launcher starts a single process. On a CPU launch with `accelerate launch "
         "--config_file configs/accelerate/cpu.yaml` or `torchrun --nproc_per_node N`, with "
         f"{config}(use_cpu=True)"),
    ]


def asked_for_processes() -> bool:
    """Whether `accelerate launch` asked for more than one process but started this one alone: its one-process
    launcher (taken for --cpu) sets MASTER_ADDR for a multi-process request and ACCELERATE_USE_CPU, and no
    WORLD_SIZE, which every multi-process launcher (torchrun's, DeepSpeed's) sets."""
    return "ACCELERATE_USE_CPU" in os.environ and "MASTER_ADDR" in os.environ and "WORLD_SIZE" not in os.environ


@torch.no_grad()
def average_gradients(model: torch.nn.Module) -> None:
    """Replace every trainable parameter's gradient by its mean over the processes of the default group (DDP's
    reduction), in one flattened all-reduce per dtype and device. A parameter without a gradient on a process counts
    as zeros there, and keeps none where no process has one (the optimizer then skips it, as on one process). Every
    process must call it with the same model. A no-op on one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    buckets: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            buckets.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), group in buckets.items():
        has = torch.tensor([p.grad is not None for p in group], dtype=dtype, device=device)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group] + [has])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for p, had in zip(group, flat[-len(group):].tolist(), strict=True):
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone() if had else None
            offset += p.numel()


class WrapperStep:
    """One micro-batch of the tree under the launch's wrapper (`model`: what accelerate prepared, TRL's
    `compute_loss` argument): `running()` yields the module the tree runs on, `loss(value, scale)` is the tensor
    `compute_loss` returns, on which transformers' training step runs its one `accelerator.backward`:
        one process, DDP   the unwrapped model. Outside the wrapper's forward DDP's reducer is not armed, so the
                           gradient accumulates locally over the accumulation window's micro-batches, as under DDP's
                           `no_sync`; at the window's last micro-batch (accelerate's `sync_gradients`)
                           `average_gradients` takes its mean over the processes, as DDP's reducer does. The loss
                           a leaf (its backward adds nothing);
        FSDP2              `fsdp2.fsdp2_gathered`: every unit gathered once for the micro-batch, gradient sync off;
                           at the window's end one zero-loss token through the root arms FSDP2's own
                           reduce-scatter (`fsdp2.py`). The loss a leaf;
        DeepSpeed ZeRO     the tree on hook-free aliases of the parameters (`zero.py`); the loss transformers
                           backwards carries their gradient into DeepSpeed's own backward, reduction and step.
    `scale`: what the gradient of the returned loss is multiplied by before transformers' division by the
    accumulation steps undoes it (1 when it does not divide). `injection`: the trainer's `zero.GradientInjection`,
    kept across micro-batches (ZeRO-3)."""

    def __init__(self, accelerator, model: torch.nn.Module, injection):
        self.accelerator, self.model, self.injection = accelerator, model, injection
        self.kind = accelerator.distributed_type.value
        plugin = getattr(accelerator.state, "deepspeed_plugin", None) if self.kind == "DEEPSPEED" else None
        self.zero_stage = plugin.zero_stage if plugin is not None else None
        self.grads: dict | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[torch.nn.Module]:
        accelerator = self.accelerator
        if self.kind == "FSDP":
            with fsdp2_gathered(self.model, accelerator.state.fsdp_plugin.reshard_after_forward,
                                sync=accelerator.sync_gradients, device=accelerator.device):
                yield accelerator.unwrap_model(self.model)
        elif self.kind == "DEEPSPEED":
            from trl.models.utils import unwrap_model_for_generation

            self.injection.check()
            with unwrap_model_for_generation(self.model, accelerator) as module, hook_free(module) as aliases:
                yield module  # ZeRO-3: gathered whole, DeepSpeed's module hooks off (as for TRL's generation)
            self.grads = {p: alias.grad for p, alias in aliases.items() if alias.grad is not None}
        else:
            unwrapped = accelerator.unwrap_model(self.model)
            yield unwrapped
            if accelerator.sync_gradients:
                average_gradients(unwrapped)

    def loss(self, value: float, scale: float) -> torch.Tensor:
        device = self.accelerator.device
        if self.grads is None:
            return torch.tensor(value, dtype=torch.float32, device=device, requires_grad=True)
        if self.zero_stage == 3:
            return self.injection.loss(self.model, value, self.grads, device)
        return linear_surrogate(value, self.grads, scale, device)


class RankDied(RuntimeError):
    """Another process of the launch died (killed, out of memory) during training: this one's collective failed,
    and the heartbeats (`rl.run.parallel.Heartbeat`) name the dead rank."""


@contextlib.contextmanager
def watching_ranks(accelerator, trainer: str, step: Callable[[], int]) -> Iterator[None]:
    """While inside (the trainer's `train`), on several processes every rank keeps a heartbeat in torch.distributed's
    rendezvous store; an error that leaves the inside while another rank's heartbeat stands still becomes
    `RankDied`, one line naming that rank and the step (`step()`), in place of the collective's own error (gloo
    fails at once when a peer's socket closes; nccl waits for its timeout). Under torchrun the agent also stops the
    survivors within a second and names the dead rank; other launchers (srun, mpirun, separate nodes) do not."""
    if accelerator.num_processes == 1 or "MASTER_ADDR" not in os.environ:
        yield
        return
    from ..rl.run.parallel import Heartbeat

    heartbeat = Heartbeat(accelerator.process_index, accelerator.num_processes)
    try:
        yield
    except Exception as e:
        dead = heartbeat.dead_ranks()
        if not dead:
            raise
        heartbeat.leaving()
        said = " ".join(str(e).split())[:200]
        raise RankDied(f"{trainer}: rank {', '.join(map(str, dead))} of {accelerator.num_processes} died during step "
                       f"{step()} (no heartbeat for {heartbeat.wait_s:g} s; the collective said: {said}); resume "
                       "from the last checkpoint with train(resume_from_checkpoint=True)") from e
    finally:
        heartbeat.stop()


def gathered(accelerator, model: torch.nn.Module):
    """A context that yields `model` (accelerate or TRL prepared it: TRL's reference model) unwrapped, with its full
    parameters for the tree's forward passes without gradients: gathered once under FSDP2 and ZeRO-3 (as for TRL's
    generation), as it is otherwise."""
    kind = accelerator.distributed_type.value
    if kind == "FSDP":
        return fsdp2_unsharded_module(model, accelerator.state.fsdp_plugin.reshard_after_forward)
    if kind == "DEEPSPEED":
        from trl.models.utils import unwrap_model_for_generation

        return unwrap_model_for_generation(model, accelerator)
    return contextlib.nullcontext(accelerator.unwrap_model(model))


@contextlib.contextmanager
def fsdp2_unsharded_module(model: torch.nn.Module, reshard_after_forward: bool) -> Iterator[torch.nn.Module]:
    with fsdp2_unsharded(model, reshard_after_forward):
        yield model
