"""The naive per-rollout computation that the execution stack must equal: each rollout run alone through the
unmodified Hugging Face forward (no cache, no padding, no mask), full logits, the same loss, summed.

This is the independent reference of every exactness test, of `branchreplay verify` and of the benchmark.
"""

from __future__ import annotations

import torch

from .engine import LossFn, ReplayResult, loss_inputs
from .tree import Rollout, RolloutTree


def naive_backward(model, rollouts: list[Rollout], loss: LossFn | None, *, temperature: float = 1.0) -> ReplayResult:
    """For each rollout alone: model(input_ids [1, T]).logits, log_softmax(logits / temperature), the loss on the
    trainable positions, `.backward()` (skipped when `loss` is None). Same outputs as `replay_backward`."""
    logprobs, entropy, total = [], [], 0.0
    for r in rollouts:
        ids = r.token_ids.to(model.device)[None]  # [1, T]
        with torch.set_grad_enabled(loss is not None and torch.is_grad_enabled()):
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1]  # [T-1, V]: position t predicts t + 1
            if logits.dtype in (torch.float16, torch.bfloat16):
                logits = logits.float()
            logp_all = torch.log_softmax(logits / temperature, dim=-1)
            positions = (r.loss_mask > 0).nonzero().squeeze(1)  # >= 1: loss_mask[0] is 0
            rows = (positions - 1).to(model.device)
            lp = logp_all[rows].gather(-1, ids[0, positions.to(model.device)][:, None]).squeeze(-1)
            ent = -(logp_all[rows].exp() * logp_all[rows]).sum(-1)
            out_lp = torch.zeros(len(r), dtype=torch.float32)
            out_ent = torch.zeros(len(r), dtype=torch.float32)
            out_lp[positions] = lp.detach().float().cpu()
            out_ent[positions] = ent.detach().float().cpu()
            logprobs.append(out_lp)
            entropy.append(out_ent)
            if loss is not None and positions.numel() > 0:
                value = loss(loss_inputs([r], positions, lp, ent))
                if value.requires_grad:
                    value.backward()
                total += value.item()
    return ReplayResult(logprobs, entropy, total, RolloutTree(rollouts).stats)


def max_rel_grad_err(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Max over parameters of max|g - g_ref| / max|g_ref| (a parameter whose reference gradient is all zero counts
    its absolute error). Lists of matching [*] tensors; 0.0 for empty lists."""
    errs = [
        ((g - r).abs().max() / r.abs().max().clamp_min(torch.finfo(r.dtype).tiny)).item()
        if r.abs().max() > 0
        else g.abs().max().item()
        for g, r in zip(grads, reference)
    ]
    return max(errs, default=0.0)
