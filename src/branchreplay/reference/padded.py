"""TRL's padded batch, exact: the `padded` reference of `train.method` (rl/policy.py) and a baseline of
`branchreplay bench` (reference/prompt_sharing.py).

padded_backward: the batch TRL's GRPOTrainer builds (trl/trainer/grpo_trainer.py, `_generate_and_score_completions`
    and `_get_per_token_logps_and_entropies`): prompts left-padded, completions right-padded, concatenated into one
    [B, P_max + C_max] batch with an attention mask, one forward/backward, logits only on the last C_max + 1
    positions (TRL's `logits_to_keep + 1`). Departs from TRL in passing explicit position ids (TRL leaves them to
    the model, which with left padding shifts a row's positions; RoPE is shift-invariant, absolute embeddings
    are not) and in one batch for all rollouts (TRL splits it into `per_device_train_batch_size` micro-batches).

A rollout's prompt: its positions before the first trained one (loss mask 1), as TRL splits prompt and completion.
Same gradients as the naive per-rollout computation (`reference.naive.naive_backward`), to floating-point tolerance.
"""

from __future__ import annotations

import torch

from ..losses import LossFn, loss_inputs
from ..tree import ReplayResult, Rollout
from .naive import per_position, rows_logprobs


def prompt_length(r: Rollout) -> int:
    """Positions before the first trained one (at least 1 and at most len(r) - 1, so a suffix is never empty;
    len(r) - 1 for a rollout with nothing trained)."""
    trained = (r.loss_mask > 0).nonzero()
    P = int(trained[0]) if trained.numel() else len(r) - 1
    return max(1, min(P, len(r) - 1)) if len(r) > 1 else 1


def padded_shape(rollouts: list[Rollout]) -> tuple[int, int, int]:
    """(B, P_max, C_max) of the padded batch: rollouts, longest prompt, longest completion (tokens)."""
    prompts = [prompt_length(r) for r in rollouts]
    return len(rollouts), max(prompts), max(len(r) - P for r, P in zip(rollouts, prompts, strict=True))


def padded_backward(model, rollouts: list[Rollout], loss: LossFn, *, temperature: float = 1.0,
                    pad_token_id: int = 0) -> ReplayResult:
    """TRL's padded batch: one forward/backward of [B, P_max + C_max], gradients into `param.grad`.
    Returns per-rollout logprobs/entropy at trained positions and the loss, as `reference.naive.naive_backward` (stats
    None: no tree is built)."""
    device = model.device
    B, P_max, C_max = padded_shape(rollouts)
    T = P_max + C_max
    ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    prompts = [prompt_length(r) for r in rollouts]
    for i, (r, P) in enumerate(zip(rollouts, prompts, strict=True)):
        C = len(r) - P
        ids[i, P_max - P : P_max + C] = r.token_ids
        mask[i, P_max - P : P_max + C] = 1
    position_ids = (mask.cumsum(1) - 1).clamp_min(0)
    ids, mask, position_ids = ids.to(device), mask.to(device), position_ids.to(device)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=C_max + 1,
                   use_cache=False).logits[:, :-1]  # [B, C_max, V]: column c predicts completion token c
    completion = ids[:, P_max:]  # [B, C_max]
    rows = [(i, torch.arange(len(r) - P, device=device)) for i, (r, P) in enumerate(zip(rollouts, prompts,
                                                                                        strict=True))]
    return row_losses(logits, completion, rollouts, prompts, rows, loss, temperature)


def row_losses(x: torch.Tensor, targets: torch.Tensor, rollouts: list[Rollout], starts: list[int], rows,
                loss: LossFn, temperature: float, head=None) -> ReplayResult:
    """Row b of x ([B, C, V] logits, or [B, C, H] hidden states when `head` is given: the head then runs on the
    valid rows only) predicts targets[b, c], the token at absolute position starts[b] + c of rollouts[b]. `rows`:
    (b, columns [n]) of each rollout's valid columns. The loss of each rollout on its trained positions (the same
    call as `naive_backward` makes), summed, then one backward."""
    if head is not None:
        flat = torch.cat([x[b, cols] for b, cols in rows])  # [sum n, H]
        logits_flat = head(flat)
        logits, offset = [], 0
        for _, cols in rows:
            logits.append(logits_flat[offset : offset + len(cols)])
            offset += len(cols)
    else:
        logits = [x[b, cols] for b, cols in rows]
    logprobs, entropy, losses = [], [], []
    for (b, cols), lg, r, s in zip(rows, logits, rollouts, starts, strict=True):
        positions = (r.loss_mask > 0).nonzero().squeeze(1)  # absolute, all >= s
        local = (positions - s).to(lg.device)
        lp, ent = rows_logprobs(lg, local, targets[b, cols][local], temperature)
        logprobs.append(per_position(lp, positions, len(r)))
        entropy.append(per_position(ent, positions, len(r)))
        if loss is not None and positions.numel() > 0:
            losses.append(loss(loss_inputs([r], positions, lp, ent)))
    total = torch.stack(losses).sum() if losses else None
    if total is not None and total.requires_grad:
        total.backward()
    return ReplayResult(logprobs, entropy, 0.0 if total is None else total.item(), None)
