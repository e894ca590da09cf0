"""The vLLM sampler's logprobs against the trainer's own, and TRL's truncated importance sampling."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...tree import Rollout

if TYPE_CHECKING:
    from ..rollouts.batch import Batch


def sampler_mismatch(batch: Batch, rollouts: list[Rollout], logprobs: list[torch.Tensor], cap: float | None,
                     ratios: bool = False) -> tuple[dict, dict[int, torch.Tensor] | None]:
    """The vLLM sampler's logprobs s (`batch.sampler_logprobs`, per rollout of `batch.rollouts`) against the run's
    own old-policy logprobs t (`logprobs`, per rollout of `rollouts` [T]: an old-policy pass's, or on-policy the
    first update's) on every trained token: sampling/logprob_diff_mean and _max = mean and max |t - s| (nats),
    sampling/mismatch_kl = mean of exp(t - s) - (t - s) - 1 (the k3 estimate of KL(sampler || trainer) on the
    sampler's tokens). With `cap`: TRL's truncated importance sampling (token_truncate) multiplies each trained
    token's policy term by min(exp(t - s), cap), logged as sampling/importance_sampling_ratio/min, /mean and /max;
    the term is linear in the advantage, so the factor goes into the advantages (GRPO's estimate multiplies them),
    leaving the KL and entropy terms alone, as TRL's. Without `cap`, `ratios` logs the same statistics of the
    uncapped exp(t - s), weighing nothing (a batch drawn ahead: the importance ratio its staleness makes).
    Returns (the metrics, {id(rollout): its [T] float64 factor, 1 off the trained tokens} with `cap`, else None).
    Writes nothing."""
    sampler = {id(r): lp for r, lp in zip(batch.flat, batch.sampler_logprobs, strict=True)}
    diffs, kept, factors = [], [], {} if cap is not None else None
    for r, t in zip(rollouts, logprobs, strict=True):
        mask = r.loss_mask.bool()
        d = (t.double() - sampler[id(r)])[mask]
        diffs.append(d)
        if cap is not None:
            ratio = torch.ones(len(r), dtype=torch.float64)
            ratio[mask] = torch.exp(d).clamp(max=cap)
            factors[id(r)] = ratio
            kept.append(ratio[mask])
        elif ratios:
            kept.append(torch.exp(d))
    d = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    if not d.numel():
        return {}, factors
    out = {"sampling/logprob_diff_mean": d.abs().mean().item(), "sampling/logprob_diff_max": d.abs().max().item(),
           "sampling/mismatch_kl": (d.exp() - d - 1).mean().item()}
    if kept:
        ratio = torch.cat(kept)
        out.update({f"sampling/importance_sampling_ratio/{k}": getattr(ratio, k)().item()
                    for k in ("min", "mean", "max")})
    return out, factors
