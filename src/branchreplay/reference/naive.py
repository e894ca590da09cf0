"""The naive per-rollout computation that the execution stack must equal: each rollout run alone through the
unmodified Hugging Face forward (no cache, no padding, no mask), full logits, the same loss, summed.

This is the independent reference of every exactness test, of `branchreplay verify` and of the benchmark: it
imports only the tree and the losses, never the engine it checks.
"""

from __future__ import annotations

import math

import torch

from ..losses import LossFn, loss_inputs
from ..tree import ReplayResult, Rollout, RolloutTree
from ..value import is_value_model


def naive_backward(model, rollouts: list[Rollout], loss: LossFn | None, *, temperature: float = 1.0) -> ReplayResult:
    """For each rollout alone: model(input_ids [1, T]).logits, log_softmax(logits / temperature), the loss on the
    trainable positions, `.backward()` (skipped when `loss` is None). Same outputs as `replay_backward`.

    A dynamic-NTK rotary embedding is reset before each rollout: transformers keeps the frequencies of the longest
    call it has seen, so without the reset a rollout's logprobs would depend on the ones run before it.

    A critic (`value.is_value_model`): score(decoder(input_ids)) per position, as TRL's `get_reward`, the value of
    position t read at t - 1; its `ReplayResult` holds `values`, as the engine's."""
    if is_value_model(model):
        return _naive_values(model, rollouts, loss)
    logprobs, entropy, total = [], [], 0.0
    for r in rollouts:
        with torch.set_grad_enabled(loss is not None and torch.is_grad_enabled()):
            positions, lp, ent = _alone(model, r, temperature)
            logprobs.append(per_position(lp, positions, len(r)))
            entropy.append(per_position(ent, positions, len(r)))
            if loss is not None and positions.numel() > 0:
                value = loss(loss_inputs([r], positions, lp, ent))
                if value.requires_grad:
                    value.backward()
                total += value.item()
    return ReplayResult(logprobs, entropy, total, RolloutTree(rollouts).stats)


def _naive_values(model, rollouts: list[Rollout], loss: LossFn | None) -> ReplayResult:
    values, total = [], 0.0
    decoder = getattr(model, model.base_model_prefix)
    for r in rollouts:
        with torch.set_grad_enabled(loss is not None and torch.is_grad_enabled()):
            _fresh_rotary(model)
            ids = r.token_ids.to(model.device)[None]  # [1, T]
            v = model.score(decoder(input_ids=ids, use_cache=False).last_hidden_state)[0, :-1, 0]  # [T-1]
            positions = (r.loss_mask > 0).nonzero().squeeze(1)
            v = v[(positions - 1).to(model.device)]
            if v.dtype in (torch.float16, torch.bfloat16):
                v = v.float()
            values.append(per_position(v, positions, len(r)))
            if loss is not None and positions.numel() > 0:
                value = loss(loss_inputs([r], positions, None, None, values=v))
                if value.requires_grad:
                    value.backward()
                total += value.item()
    return ReplayResult([], [], total, RolloutTree(rollouts).stats, values=values)


def _alone(model, r: Rollout, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rollout alone through the model: its trainable positions [n] (>= 1: loss_mask[0] is 0) and the logprobs
    and entropies there ([n], [n], `rows_logprobs`), under the caller's grad mode."""
    _fresh_rotary(model)
    ids = r.token_ids.to(model.device)[None]  # [1, T]
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]  # [T-1, V]: position t predicts t + 1
    positions = (r.loss_mask > 0).nonzero().squeeze(1)
    lp, ent = rows_logprobs(logits, (positions - 1).to(model.device), ids[0, positions.to(model.device)], temperature)
    return positions, lp, ent


def _fresh_rotary(model) -> None:
    """Put every rotary embedding of `model` back to its frequencies after loading: each `<prefix>inv_freq` to its
    `<prefix>original_inv_freq`, each `<prefix>max_seq_len_cached` to `original_max_seq_len` (transformers'
    attribute names; Gemma-style modules prefix them with a layer type). What transformers' `dynamic_rope_update`
    does itself when a call is shorter than the original length; fixed-frequency embeddings are unchanged by it."""
    for module in model.modules():
        for name in [n for n in {*module._buffers, *vars(module)} if n.endswith("original_inv_freq")]:
            prefix = name[: -len("original_inv_freq")]
            setattr(module, f"{prefix}inv_freq", getattr(module, name).clone())
            if hasattr(module, f"{prefix}max_seq_len_cached") and hasattr(module, "original_max_seq_len"):
                setattr(module, f"{prefix}max_seq_len_cached", module.original_max_seq_len)


def rows_logprobs(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, temperature: float):
    """log softmax(logits / temperature) of `rows` [n] of `logits` [N, V] at `targets` [n], and the entropy of
    those rows: ([n], [n]), float32 for half-precision logits."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    scaled = logits[rows] / temperature  # [n, V]
    logp_all = torch.log_softmax(scaled, dim=-1)
    logprobs = scaled.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return logprobs, -(logp_all.exp() * logp_all).sum(-1)


def per_position(values: torch.Tensor, positions: torch.Tensor, T: int) -> torch.Tensor:
    """[n] values at `positions` of a rollout of T tokens -> [T] on the CPU, 0 elsewhere (detached): float64 for
    float64 values, else float32 (as `ReplayResult`)."""
    out = torch.zeros(T, dtype=torch.float64 if values.dtype == torch.float64 else torch.float32)
    out[positions] = values.detach().cpu().to(out.dtype)
    return out


GRADIENT_FLOOR = 1e-6
"""The smallest scale a parameter's error is taken against, as a fraction of the largest reference gradient of
any parameter (`max_rel_grad_err`)."""


def max_rel_grad_err(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Max over parameters of max|g - g_ref| / max(max|g_ref|, GRADIENT_FLOOR * the largest max|g_ref| of any
    parameter). Lists of matching [*] tensors; 0.0 for empty lists; absolute errors when every reference gradient
    is zero; inf when a gradient holds NaN (Python's max would drop it).

    The floor is for gradients that are zero in exact arithmetic and rounding noise in both computations: the bias
    of a key projection (softmax cancels a constant added to all of a query's scores) has reference gradients of
    1e-20 in a float64 OPT whose largest gradient is 0.1, and judged against that noise alone an exact engine
    reads as 1.7 off. A parameter whose gradient is at least GRADIENT_FLOOR of the largest keeps its relative error
    (an engine wrong on it by 100% still reads 1)."""
    peaks = [r.abs().max() for r in reference]
    scale = max(peaks, default=torch.tensor(0.0)).item() * GRADIENT_FLOOR
    errs = [
        ((g - r).abs().max() / max(peak.item(), scale)).item() if max(peak.item(), scale) > 0
        else g.abs().max().item()
        for g, r, peak in zip(grads, reference, peaks, strict=True)
    ]
    return math.inf if any(math.isnan(e) for e in errs) else max(errs, default=0.0)


def naive_sequence_backward(model, rollouts: list[Rollout], loss, *, temperature: float = 1.0
                            ) -> tuple[float, torch.Tensor]:
    """For each rollout alone: model(input_ids [1, T]).logits, its logprobs at the trainable positions (as
    `rows_logprobs`) summed under autograd into s_i; then `loss(s)` (s [N] float64) and `.backward()`. The
    reference of `engine.sequence.replay_sequence_backward`. Returns (the loss value, s detached)."""
    s = torch.stack([_alone(model, r, temperature)[1].double().sum() for r in rollouts]).cpu()  # loss inputs: CPU
    value = loss(s)
    value.backward()
    return value.item(), s.detach()


def naive_function_backward(model, rollouts: list[Rollout], loss, *, temperature: float = 1.0) -> float:
    """For each rollout alone: its logprobs and entropies at the trainable positions (as `rows_logprobs`) under
    autograd, placed into [T] float64 vectors (0 elsewhere); then `loss(logprobs, entropies)` and `.backward()`.
    The reference of `engine.sequence.replay_function_backward`. Returns the loss value."""
    logprobs, entropy = [], []
    for r in rollouts:
        positions, lp, ent = _alone(model, r, temperature)
        where = positions.to(lp.device)
        logprobs.append(torch.zeros(len(r), dtype=torch.float64, device=lp.device).index_put((where,), lp.double()))
        entropy.append(torch.zeros(len(r), dtype=torch.float64, device=lp.device).index_put((where,), ent.double()))
    value = loss([x.cpu() for x in logprobs], [x.cpu() for x in entropy])
    value.backward()
    return value.item()
