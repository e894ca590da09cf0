"""DeepSpeed ZeRO under accelerate: the tree's gradient handed to DeepSpeed's own backward, once per micro-batch.

DeepSpeed reduces a gradient in hooks on the parameters (ZeRO-2 and ZeRO-3 partition it as it arrives, and refuse a
parameter whose gradient arrives twice in one backward), and accelerate's `backward` runs `engine.backward` and, at
the accumulation boundary, `engine.step`. The tree's many backward passes must not fire those hooks, so the tree runs
on hook-free aliases of the parameters (`hook_free`), and its gradient g of the micro-batch then reaches DeepSpeed
through the one `accelerator.backward` of transformers' training step, on a loss whose value is TRL's and whose
gradient is g (`linear_surrogate` under ZeRO-1 and ZeRO-2, `GradientInjection` under ZeRO-3). So DeepSpeed's
reduction, accumulation, partitioning and step are its own. During the tree's forward and backward a ZeRO-3 rank
holds the whole model gathered (TRL's `unwrap_model_for_generation`) and, under every stage, one full gradient (the
aliases'), which DeepSpeed then partitions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def is_deepspeeds(hook) -> bool:
    """Whether a module hook is DeepSpeed's (defined in a `deepspeed` module, or a partial of such a function)."""
    return getattr(getattr(hook, "func", hook), "__module__", "").split(".")[0] == "deepspeed"


@contextlib.contextmanager
def hook_free(model: torch.nn.Module) -> Iterator[dict[torch.nn.Parameter, torch.nn.Parameter]]:
    """`model`'s trainable parameters replaced, while inside, by leaves that share their storage and carry no hook
    (a parameter registered in two modules, tied weights, gets one alias), and DeepSpeed's module hooks removed
    from `model` and its submodules; yields {parameter: its alias}, whose `.grad` the tree's backward passes fill.
    TRL's `unwrap_model_for_generation` removes the training engine's per-layer hooks but keeps the engine's own on
    the root (the start of a forward resets ZeRO-3's parameter trace) and those of any other engine built on the
    same module (TRL's DPO precomputes reference logprobs through a second, inference engine): a forward of the tree
    would fire them on the aliases."""
    kept = [(module, name, dict(getattr(module, name))) for module in model.modules() for name in MODULE_HOOKS
            if any(is_deepspeeds(h) for h in getattr(module, name).values())]
    for module, name, hooks in kept:
        for key, hook in hooks.items():
            if is_deepspeeds(hook):
                del getattr(module, name)[key]
    aliases: dict[torch.nn.Parameter, torch.nn.Parameter] = {}
    swapped = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.requires_grad:
                continue
            if p not in aliases:
                aliases[p] = torch.nn.Parameter(p.detach(), requires_grad=True)
            module._parameters[name] = aliases[p]
            swapped.append((module, name, p))
    try:
        yield aliases
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
        for module, name, hooks in kept:
            getattr(module, name).clear()
            getattr(module, name).update(hooks)


def linear_surrogate(value: float, grads: dict[torch.nn.Parameter, torch.Tensor], scale: float,
                     device: torch.device) -> torch.Tensor:
    """A 0-dim tensor equal to `value` whose gradient with respect to each parameter p of `grads` is scale * g_p:
    value + (s - s.detach()) with s = scale * sum (p * g_p).sum() (ZeRO-1 and ZeRO-2, whose parameters are whole)."""
    s = sum((p * g.to(p.dtype)).sum() for p, g in grads.items()) * scale
    return torch.tensor(value, dtype=torch.float32, device=device) + (s - s.detach()).float()


class GradientInjection:
    """ZeRO-3: one zero-loss token through the engine's forward (each layer gathered by DeepSpeed's own hooks, as in
    any step), whose backward carries the tree's gradient (module docstring). `loss(...)` registers on each
    parameter a hook that adds g_p to its gradient and removes itself (g is the gradient of the loss after
    transformers' division by the accumulation steps, which scales only the token's zero loss); `check()`, at the
    next micro-batch, raises RuntimeError naming a parameter whose hook did not run (the token did not reach it: an
    MoE expert), rather than lose its gradient."""

    def __init__(self):
        self.pending: dict[str, torch.utils.hooks.RemovableHandle] = {}

    def loss(self, engine, value: float, grads: dict[torch.nn.Parameter, torch.Tensor],
             device: torch.device) -> torch.Tensor:
        names = {p: name for name, p in engine.module.named_parameters()}
        for p, g in grads.items():
            name = names[p]

            def add(grad, g=g, name=name):
                self.pending.pop(name).remove()
                return grad + g.to(grad.dtype)

            self.pending[name] = p.register_hook(add)
        logits = engine(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device)).logits
        zero = logits.float().sum() * 0.0
        return torch.tensor(value, dtype=torch.float32, device=device) + (zero - zero.detach())

    def check(self) -> None:
        if self.pending:
            names = ", ".join(sorted(self.pending)[:3])
            raise RuntimeError(f"DeepSpeed ZeRO-3: the gradient of {names} did not reach DeepSpeed (the zero-loss "
                               "token did not use it, e.g. an MoE expert); use ZeRO-2 or FSDP2")
