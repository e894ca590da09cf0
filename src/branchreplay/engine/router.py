"""The mixture-of-experts router's load-balancing loss over a tree, exactly as over the naive rollouts.

The loss (Switch Transformer, https://arxiv.org/abs/2101.03961, eqs. 4-6; transformers' `load_balancing_loss_func`)
over the router logits z_lp of every MoE layer l and counted position p, E experts, top-k, N = layers x positions:

    aux = E * sum_e f_e * P_e,   f_e = T_e / N,   P_e = S_e / N,
    T_e = sum_{l, p} [e in top_k(softmax(z_lp))],   S_e = sum_{l, p} softmax(z_lp)_e

A position the tree computes once for k rollouts enters T, S and N with weight k. T carries no gradient, so the loss
is linear in each position's router probabilities once T and N are known: pass 1 (the forward without a graph) sums
k-weighted T, S and N (`RouterLoss`; `aux`, a float64 leaf the caller's loss reads); pass 2 adds to each pack's
backward sum_{l, p} k_p softmax(z_lp) . G, G = dL/daux * E * T / N^2 (float64, `stack._Run.pack`).
Design notes and measurements: docs/notes/execution-stack.md.
"""

from __future__ import annotations

import contextlib

import torch

from ..models import base_of
from .families import NO_ROUTER_LOSS


class RouterLoss:
    """The router load-balancing loss of one replay call (module docstring): pass 1 collects, pass 2 differentiates.

    Args:
        model: a Hugging Face MoE causal LM (or a peft model of one) whose class records `router_logits`.
        top_k: the experts each position is routed to in the loss's counts; the config's `num_experts_per_tok` when
            None.

    Raises:
        ValueError: the model records no router logits (not an MoE model transformers computes this loss for), its
            family has no such loss (`families.NO_ROUTER_LOSS`: DeepSeek-V3's bias-balanced routing), or it has no
            `num_experts_per_tok` and no `top_k` is given.
    """

    @staticmethod
    def exists(model) -> bool:
        """Whether transformers computes a router load-balancing loss for `model`: it records router logits and its
        family is not balanced another way (`families.NO_ROUTER_LOSS`). Llama 4 and Gemma 4 record none."""
        base = base_of(model)
        recorder = getattr(type(base), "_can_record_outputs", None) or {}
        return base.config.get_text_config().model_type not in NO_ROUTER_LOSS and "router_logits" in recorder

    def __init__(self, model, top_k: int | None = None):
        base = base_of(model)
        model_type = base.config.get_text_config().model_type
        if model_type in NO_ROUTER_LOSS:
            raise ValueError(f"{model_type}: transformers computes no router load-balancing loss for this family (its "
                             "routing is balanced by e_score_correction_bias, outside the gradient); train without one "
                             "(router_aux_loss_coef 0)")
        recorder = getattr(type(base), "_can_record_outputs", None) or {}
        spec = recorder.get("router_logits")
        if spec is None:
            raise ValueError(f"{type(base).__name__} records no router logits: it has no MoE router load-balancing "
                             "loss to compute")
        target, self.index = getattr(spec, "target_class", spec), getattr(spec, "index", 0)
        layer_name = getattr(spec, "layer_name", None)
        self.routers = [m for name, m in base.named_modules()
                        if isinstance(m, target) and (layer_name is None or name.endswith(layer_name))]
        config = base.config.get_text_config()
        self.top_k = top_k if top_k is not None else getattr(config, "num_experts_per_tok", None)
        if not self.routers or self.top_k is None:
            raise ValueError(f"{type(base).__name__}: no router modules or no num_experts_per_tok; pass top_k")
        self.counts = self.prob_sums = None  # [E] float64: k-weighted T_e and S_e (module docstring)
        self.rows = 0.0  # N: k-weighted positions, summed over the MoE layers
        self.aux: torch.Tensor | None = None  # pass 1's value, a 0-dim float64 leaf that requires grad
        self.gradient: torch.Tensor | None = None  # G [E] float64, pass 2
        self._weights: torch.Tensor | None = None  # [S] each token's rollout count in the decoder call running now
        self._terms: list[torch.Tensor] = []

    @contextlib.contextmanager
    def attached(self):
        """Hooks on the router modules for the duration (removed after, also on an error)."""
        handles = [m.register_forward_hook(self._hook) for m in self.routers]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def tokens(self, weights: torch.Tensor):
        """For one decoder call: `weights` [S] (float64, on the model's device), the number of rollouts each of the
        call's S tokens stands for, in the order the routers see them (rows of a batch one after the other)."""
        self._weights = weights
        try:
            yield
        finally:
            self._weights = None

    def _hook(self, module, args, output) -> None:
        w = self._weights
        if w is None:  # a decoder call outside `tokens` (none in a replay)
            return
        logits = output[self.index] if isinstance(output, (tuple, list)) else output
        logits = logits.reshape(-1, logits.shape[-1])  # [S, E]
        if logits.shape[0] != w.shape[0]:
            raise RuntimeError(f"router {type(module).__name__} saw {logits.shape[0]} tokens, the pack has "
                               f"{w.shape[0]}")
        probs = torch.softmax(logits, dim=-1)  # in the logits' dtype, as transformers' loss takes it
        if self.gradient is None:  # pass 1: the k-weighted sums
            with torch.no_grad():
                if self.counts is None:
                    self.counts = torch.zeros(logits.shape[-1], dtype=torch.float64, device=logits.device)
                    self.prob_sums = torch.zeros_like(self.counts)
                top = torch.topk(probs, self.top_k, dim=-1).indices.reshape(-1)
                self.counts.index_add_(0, top, w.repeat_interleave(self.top_k))
                self.prob_sums += (probs.double() * w[:, None]).sum(0)
                self.rows += float(w.sum())
        elif torch.is_grad_enabled() and logits.requires_grad:  # pass 2 (a replayed pack's first forward: no graph)
            self._terms.append((probs.double() * (w[:, None] * self.gradient[None, :])).sum())

    def value(self) -> torch.Tensor:
        """After pass 1: the loss (module docstring), a 0-dim float64 leaf that requires grad, also kept as `aux`.
        Raises ValueError when pass 1 saw no position."""
        if self.counts is None or self.rows == 0:
            raise ValueError("the router loss saw no position: run pass 1 (replay_logprobs with router=) first")
        E = self.counts.numel()
        aux = E * (self.counts / self.rows * self.prob_sums / self.rows).sum()
        self.aux = aux.detach().cpu().requires_grad_(True)
        return self.aux

    def set_gradient(self, d_aux: float) -> None:
        """Pass 2's coefficients from dL/daux (the caller's loss, differentiated at `aux`)."""
        E = self.counts.numel()
        self.gradient = d_aux * E * self.counts / self.rows**2

    def take(self) -> list[torch.Tensor]:
        """Pass 2's terms of the decoder calls since the last take (scalars whose gradient is the loss's through
        those calls' router logits); the pack that ran them adds them to its backward."""
        terms, self._terms = self._terms, []
        return terms


def routed(router: RouterLoss | None, nodes: list, device: torch.device):
    """Around a decoder call over the tokens of `nodes` (`tree.Node`s, concatenated or as the rows of a batch):
    each token's rollout count, for `router` (a no-op context without one)."""
    if router is None:
        return contextlib.nullcontext()
    counts = torch.tensor([len(n.rollouts) for n in nodes], dtype=torch.float64)
    lengths = torch.tensor([len(n) for n in nodes])
    return router.tokens(torch.repeat_interleave(counts, lengths).to(device))


def taken(router: RouterLoss | None) -> list[torch.Tensor]:
    """`router.take()`, or [] without a router."""
    return router.take() if router is not None else []
