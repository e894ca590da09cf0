"""Token-level policy losses, written once for a node of the rollout tree.

A node's positions have ONE logprob each, shared by the k rollouts through it; advantages and loss weights are per
rollout. A loss is any callable `loss(x: LossInputs) -> scalar Tensor` whose value on a set of rollouts is the sum
of its values on the nodes: every per-token loss summed with weights (GRPO, DAPO, Dr. GRPO, BNPO and PPO once their
normalisation is put into the weights, `token_weights`; PPO's value loss, `ValueLoss`, on a critic). Losses of
summed logprobs (RLOO's `rloo_loss`, DPO's `dpo_loss`) and GSPO's `gspo_loss` run in two passes, `engine.sequence`.
`GRPOLoss` follows TRL 1.16's GRPOTrainer (trl/trainer/grpo_trainer.py); its docstring lists the departures.
Design notes: docs/algorithms.md, docs/training.md ("The GRPO loss").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .loss_types import DPO_LOSS_TYPES, LOSS_TYPES


@dataclass
class LossInputs:
    """What a loss sees for one node.

    The node's positions that carry a loss (any rollout through the node trains it) are gathered, in order: L' of
    them. dtypes: float of the model's compute dtype (float32 for bf16/fp16 models).

    logprobs: [L'] log p(token | context) of the current policy at temperature T (differentiable); None for a
        critic.
    entropy: [L'] entropy of the policy's next-token distribution at those positions (differentiable); None for a
        critic.
    weights: [k, L'] per-rollout loss weight of each position (0 where the rollout does not train it).
    advantages: [k, L'] per-rollout advantage of each position.
    old_logprobs: [k, L'] per-rollout logprobs under the sampling policy, or None (then the ratio is 1, as TRL
        with num_iterations=1). Per rollout, not per position: two samplers' logprobs of one shared context may
        differ in the last bits, and the naive sum uses each rollout's own.
    ref_logprobs: [k, L'] per-rollout logprobs under the reference model, or None.
    values: [L'] a critic's values V(prefix) (differentiable; `value.py`), or None for a policy.
    returns: [k, L'] per-rollout value targets, or None.
    old_values: [k, L'] per-rollout values before the update, or None.
    """

    logprobs: torch.Tensor | None
    entropy: torch.Tensor | None
    weights: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None


LossFn = Callable[[LossInputs], torch.Tensor]
"""A loss over one node: `LossInputs` -> scalar tensor, whose sum over the nodes is the loss over the rollouts."""


def loss_inputs(rollouts, positions: torch.Tensor, logprobs: torch.Tensor | None, entropy: torch.Tensor | None,
                values: torch.Tensor | None = None) -> LossInputs:
    """Gather the per-rollout data of `rollouts` (the k `tree.Rollout`s through a node, or one rollout alone) at
    absolute `positions` [L'] into a `LossInputs`, in the dtype and on the device of `logprobs` [L'] (of a critic's
    `values` [L'])."""
    like = logprobs if logprobs is not None else values

    def per_rollout(name):
        if getattr(rollouts[0], name) is None:
            return None
        return torch.stack([getattr(r, name)[positions] for r in rollouts]).to(like)

    return LossInputs(
        logprobs=logprobs,
        entropy=entropy,
        weights=per_rollout("weights"),
        advantages=per_rollout("advantages"),
        old_logprobs=per_rollout("old_logprobs"),
        ref_logprobs=per_rollout("ref_logprobs"),
        values=values,
        returns=per_rollout("returns"),
        old_values=per_rollout("old_values"),
    )


@dataclass
class LossStats:
    """Sums a loss records from the tensors it computed, over every (rollout, position) pair it trained (weight > 0),
    so that the metrics are token means of the same ratio, clip and KL values as the loss (TRL's `_compute_loss`
    logs `clip_ratio/*` from the `coef_1` and advantages it just used).

    sums: [width] float64 on the loss's device, or None before the first node. `GRPOLoss`'s five: trained (rollout,
    position) pairs; of them, ratio < 1 - epsilon_low where A < 0; ratio > 1 + epsilon_high where A > 0; the sum of
    next-token entropies (nats); the sum of the k3 KL estimates. `ValueLoss`'s three: its own. Kept on the device
    (no sync per node) until read. kl: whether the loss had a KL term. Data parallelism sums `totals()` over the
    ranks and sets them back with `set_totals`.
    """

    sums: torch.Tensor | None = None
    kl: bool = False
    width: int = 5

    def add(self, values: torch.Tensor, kl: bool = False) -> None:
        """Add one node's [width] sums (in the order of `sums`)."""
        values = values.detach().to(torch.float64)
        self.sums = values if self.sums is None else self.sums + values
        self.kl = self.kl or kl

    def totals(self) -> list[float]:
        """The sums and the KL flag as [width + 1] floats (zeros before the first node)."""
        return (self.sums.tolist() if self.sums is not None else [0.0] * self.width) + [float(self.kl)]

    def set_totals(self, totals: list[float]) -> None:
        """The inverse of `totals` (after they were summed over the ranks: a KL term on any rank sets `kl`)."""
        self.sums, self.kl = torch.tensor(totals[:-1], dtype=torch.float64), totals[-1] > 0

    def metrics(self) -> dict[str, float]:
        """TRL's names: entropy, clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean and, with a KL
        term, kl; each a mean over the trained tokens (0 when there were none)."""
        tokens, low, high, entropy, kl = (self.sums.tolist() if self.sums is not None else [0.0] * 5)
        n = max(tokens, 1.0)
        out = {"entropy": entropy / n, "clip_ratio/low_mean": low / n, "clip_ratio/high_mean": high / n,
               "clip_ratio/region_mean": (low + high) / n}
        if self.kl:
            out["kl"] = kl / n
        return out


@dataclass
class GRPOLoss:
    """GRPO's clipped surrogate with the k3 KL penalty and an optional entropy bonus, summed with per-token weights.

    Per position t of rollout i (TRL 1.16 GRPOTrainer, `_compute_loss`; Shao et al. 2024, DeepSeekMath, eq. 3):
        ratio = exp(logp - old_logp)
        l = -min(min(ratio, delta) * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)
                                    # grpo, bnpo, dr_grpo, dapo, luspo (their normalisations: `token_weights`)
        l = -sg(min(ratio, epsilon_high)) * A * logp            # cispo (MiniMax-M1; epsilon_high is eps_max)
        l = -sigmoid(tau (ratio - 1)) * 4 / tau * A             # sapo (tau = sapo_temperature_pos where A > 0,
                                                                # else sapo_temperature_neg)
        kl = exp(ref_logp - logp) - (ref_logp - logp) - 1       # k3 estimator (Schulman, "Approximating KL
                                                                # divergence", 2020), as TRL
        kl *= ratio                                             # use_bias_correction_kl (DeepSeek-V3.2)
        l += beta * kl
    loss = sum_i sum_t weights[i, t] * l[i, t] - entropy_coef * H, where H is the mean entropy over the
    `entropy_tokens` trained (rollout, position) pairs, as TRL's bonus for every loss_type, or, when
    `entropy_tokens` is None, sum_i sum_t weights[i, t] * entropy[t] (verl's entropy aggregated like its loss).

    Departures from TRL's GRPOTrainer (tests/test_losses_trl.py feeds the same batch to both): the normalisation is
    carried by per-token weights computed up front, so a batch split into micro-batches gives the same gradient (TRL's
    entropy mean is per micro-batch: equal with one); sequence-level importance sampling (GSPO) is `gspo_loss`, a
    function of each rollout's logprobs that runs in two passes (`engine.sequence.replay_function_backward`);
    top_entropy_quantile is the trainer's (it zeroes the advantages of low-entropy tokens); the loss type vespo is
    not implemented.

    Args:
        epsilon_low, epsilon_high: clipping range (TRL `epsilon`, `epsilon_high`; DAPO uses 0.2 / 0.28).
        beta: KL coefficient; ref_logprobs are required when beta != 0.
        entropy_coef: entropy bonus coefficient (0 = off).
        use_bias_correction_kl: multiply the k3 KL by the (differentiable) importance ratio, TRL 1.16's default;
            it changes the KL gradient even on-policy, where the ratio's value is 1.
        delta: upper bound of the ratio in the unclipped term (two-sided clipping, TRL `delta`; INTELLECT-2,
            Prime Intellect 2025), or None.
        entropy_tokens: the number of trained (rollout, position) pairs of the whole step, which H averages over
            (the trainer sets it), or None (above).
        loss_type: which per-token term (above); the normalisation is in the weights (`token_weights`).
        sapo_temperature_pos, sapo_temperature_neg: sapo's gate temperatures (TRL's defaults 1.0 and 1.05).
    Every call adds to `stats` (`LossStats`) what it computed; set `stats = LossStats()` to start a new count.
    Raises:
        ValueError: beta != 0 but a node has no reference logprobs.
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    entropy_coef: float = 0.0
    use_bias_correction_kl: bool = True
    delta: float | None = None
    entropy_tokens: float | None = None
    loss_type: str = "grpo"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    stats: LossStats = field(default_factory=LossStats, compare=False, repr=False)

    def __call__(self, x: LossInputs) -> torch.Tensor:
        logp = x.logprobs
        old = x.old_logprobs if x.old_logprobs is not None else logp.detach()
        ratio = torch.exp(logp - old)  # [L'] or [k, L']
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        unclipped = ratio if self.delta is None else torch.clamp(ratio, max=self.delta)
        A = x.advantages  # [k, L']
        if self.loss_type == "cispo":
            per_token = -torch.clamp(ratio, max=self.epsilon_high).detach() * A * logp
        elif self.loss_type == "sapo":
            tau = torch.where(A > 0, self.sapo_temperature_pos, self.sapo_temperature_neg)
            per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * A
        else:
            per_token = -torch.minimum(unclipped * A, clipped * A)  # [k, L']
        kl = None
        if self.beta != 0.0:
            if x.ref_logprobs is None:
                raise ValueError("GRPOLoss.beta is non-zero but the rollouts carry no ref_logprobs")
            delta = x.ref_logprobs - logp
            kl = torch.exp(delta) - delta - 1
            if self.use_bias_correction_kl:
                kl = kl * ratio
            per_token = per_token + self.beta * kl
        loss = (x.weights * per_token).sum()
        if self.entropy_coef != 0.0:
            if self.entropy_tokens is None:
                entropy_weights = x.weights
            else:
                entropy_weights = (x.weights > 0).to(x.entropy.dtype) / max(float(self.entropy_tokens), 1.0)
            loss = loss - self.entropy_coef * (entropy_weights * x.entropy).sum()
        self._record(x, unclipped, kl)  # TRL's clip_ratio metrics use the ratio after `delta`
        return loss

    @torch.no_grad()
    def _record(self, x: LossInputs, ratio: torch.Tensor, kl: torch.Tensor | None) -> None:
        """Add this node's trained tokens, clipped ratios, entropy and KL to `stats` (LossStats)."""
        trained = (x.weights > 0).to(ratio.dtype)  # [k, L']
        ratio, A = ratio.detach().expand_as(trained), x.advantages
        self.stats.add(torch.stack([
            trained.sum(),
            (((ratio < 1 - self.epsilon_low) & (A < 0)) * trained).sum(),
            (((ratio > 1 + self.epsilon_high) & (A > 0)) * trained).sum(),
            (x.entropy.detach() * trained).sum(),
            (kl.detach() * trained).sum() if kl is not None else trained.new_zeros(()),
        ]), kl is not None)


@dataclass
class ValueLoss:
    """PPO's clipped value loss for a critic (`value.py`), summed with per-token weights. Per position t of rollout i
    (TRL 0.24 PPOTrainer, trl/trainer/ppo_trainer.py; the clipping of Ziegler et al. 2019's lm-human-preferences):
        v_clipped = clamp(v, old_v - cliprange_value, old_v + cliprange_value)
        l = 0.5 * max((v - R)^2, (v_clipped - R)^2)
    loss = coef * sum_i sum_t weights[i, t] * l[i, t]; with weights = mask / (completion tokens of the step) it is
    TRL's `vf_coef * 0.5 * masked_mean(...)`. R are the rollouts' `returns`, old_v their `old_values`.

    `stats` (`LossStats` of width 3: trained (rollout, position) pairs, clipped ones where the clipped term is larger,
    sum of l) gives TRL's `loss/value_avg` and `val/clipfrac_avg` (`value_metrics`).
    Raises ValueError: a node without returns or old_values, or a policy's inputs (no values).
    """

    cliprange_value: float = 0.2
    coef: float = 0.1
    stats: LossStats = field(default_factory=lambda: LossStats(width=3), compare=False, repr=False)

    def __call__(self, x: LossInputs) -> torch.Tensor:
        if x.values is None:
            raise ValueError("ValueLoss needs a critic's values: run it over a value model (branchreplay.value)")
        if x.returns is None or x.old_values is None:
            raise ValueError("ValueLoss needs the rollouts' returns and old_values (PPO's GAE targets)")
        v = x.values  # [L'], broadcast over the k rollouts
        clipped = torch.clamp(v, x.old_values - self.cliprange_value, x.old_values + self.cliprange_value)
        unclipped_loss, clipped_loss = (v - x.returns) ** 2, (clipped - x.returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped_loss, clipped_loss)  # [k, L']
        with torch.no_grad():
            trained = (x.weights > 0).to(per_token.dtype)
            self.stats.add(torch.stack([trained.sum(), ((clipped_loss > unclipped_loss) * trained).sum(),
                                        (per_token.detach() * trained).sum()]))
        return self.coef * (x.weights * per_token).sum()

    def value_metrics(self) -> dict[str, float]:
        """TRL's names: loss/value_avg (0.5 x the mean clipped squared error) and val/clipfrac_avg, token means."""
        tokens, clipped, total = self.stats.totals()[:3]
        n = max(tokens, 1.0)
        return {"loss/value_avg": total / n, "val/clipfrac_avg": clipped / n}


def rloo_loss(sums: torch.Tensor, old_sums: torch.Tensor, advantages: torch.Tensor, *, epsilon_low: float = 0.2,
              epsilon_high: float = 0.2, num_sequences: int | None = None) -> torch.Tensor:
    """RLOO's sequence-level clipped loss (TRL 1.16 RLOOTrainer, `_compute_loss`): with ratio_i = exp(s_i -
    old_s_i) of the summed completion logprobs,
        loss = sum_i -min(ratio_i A_i, clip(ratio_i, 1 - epsilon_low, 1 + epsilon_high) A_i) / num_sequences
    (TRL's mean over the batch; num_sequences is the step's count when `sums` is a micro-batch's share, default
    len(sums)). sums, old_sums, advantages: [N] float64. Over a tree, `engine.sequence.replay_sequence_backward`
    gives its exact gradient."""
    ratio = torch.exp(sums - old_sums)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_sequence = -torch.minimum(ratio * advantages, clipped * advantages)
    return per_sequence.sum() / (num_sequences or len(sums))


def rloo_clip_metrics(sums: torch.Tensor, old_sums: torch.Tensor, advantages: torch.Tensor, *,
                      epsilon_low: float = 0.2, epsilon_high: float = 0.2) -> dict[str, float]:
    """TRL 1.16 RLOOTrainer's clip metrics of `rloo_loss` (same arguments): the fraction of sequences whose ratio is
    clipped below (ratio < 1 - epsilon_low with A < 0: clip_ratio/low_mean), above (ratio > 1 + epsilon_high with
    A > 0: clip_ratio/high_mean), and their sum (clip_ratio/region_mean)."""
    ratio = torch.exp(sums.detach() - old_sums)
    low = ((ratio < 1 - epsilon_low) & (advantages < 0)).double().mean().item()
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).double().mean().item()
    return {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low + high}


def gspo_loss(logprobs: list[torch.Tensor], entropy: list[torch.Tensor], rollouts, loss: GRPOLoss) -> torch.Tensor:
    """GRPO with sequence-level importance sampling (GSPO, Zheng et al. 2025; TRL 1.16 GRPOTrainer with
    importance_sampling_level="sequence"): `loss`'s clipped term, KL and entropy bonus, with the token ratio
    replaced, for every token of rollout i, by
        ratio_i = exp(sum_t m_it (logp_it - old_logp_it) / max(sum_t m_it, 1))
    (the KL's bias correction multiplies by the same ratio_i, as TRL's). logprobs, entropy: per rollout [T] float64
    (the `engine.sequence.replay_function_backward` pass), rollouts: their `tree.Rollout`s (weights carry the
    loss_type's normalisation; loss_types cispo and sapo as TRL's on the sequence ratio). Records `loss.stats`."""
    total = 0.0
    for lp, ent, r in zip(logprobs, entropy, rollouts, strict=True):
        m = r.loss_mask.to(lp)
        positions = m.nonzero().squeeze(1)
        if positions.numel() == 0:
            continue
        old = r.old_logprobs.to(lp) if r.old_logprobs is not None else lp.detach()
        log_ratio = ((lp - old) * m).sum() / m.sum()
        x = loss_inputs([r], positions, lp[positions], ent[positions])
        total = total + _with_ratio(loss, x, log_ratio)
    return total if isinstance(total, torch.Tensor) else torch.zeros((), dtype=torch.float64)


def _with_ratio(loss: GRPOLoss, x: LossInputs, log_ratio: torch.Tensor) -> torch.Tensor:
    """`loss` on one rollout's inputs with every token's ratio exp(log_ratio): the old logprobs are shifted so that
    logp - old equals log_ratio at each position (differentiable through both)."""
    shifted = LossInputs(x.logprobs, x.entropy, x.weights, x.advantages,
                         old_logprobs=(x.logprobs - log_ratio)[None], ref_logprobs=x.ref_logprobs)
    return loss(shifted)



def token_weights(
    loss_masks: list[torch.Tensor],
    loss_type: str = "grpo",
    max_completion_length: int | None = None,
    num_items_in_batch: int | None = None,
) -> list[torch.Tensor]:
    """Per-token loss weights that put TRL's normalisation of each `loss_type` into a weighted sum.

    Args:
        loss_masks: per rollout, [T] 0/1 trainable mask.
        loss_type: (TRL GRPOConfig.loss_type)
            "grpo": mean over rollouts of (sum of the rollout's token losses / its number of tokens):
                w = m / (|o_i| * B). Has a length bias (Liu et al. 2025, Dr. GRPO).
            "bnpo": sum of token losses / number of active tokens in the batch: w = m / sum(m).
            "dr_grpo": sum of token losses / (B * max_completion_length): w = m / (B * L_max).
            "dapo": sum of token losses / active tokens in the whole global batch (num_items_in_batch, all
                micro-batches and processes): w = m / N. Yu et al. 2025, DAPO.
            "cispo": as dapo (TRL). "sapo": as grpo (TRL).
            "luspo": the sum of each rollout's token losses, mean over rollouts: w = m / B (TRL; LUSPO scales
                each sequence by its length).
        max_completion_length: L_max in tokens, required for dr_grpo.
        num_items_in_batch: N for dapo (defaults to the active tokens of these rollouts).
    Returns:
        per rollout, [T] float64 weights (0 where the mask is 0). A rollout with no trainable token gets all zeros.
    Raises:
        ValueError: unknown loss_type, or dr_grpo without max_completion_length.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type '{loss_type}' is unknown; choose one of {', '.join(LOSS_TYPES)}")
    masks = [torch.as_tensor(m, dtype=torch.float64) for m in loss_masks]
    B = len(masks)
    active = sum(float(m.sum()) for m in masks)
    if loss_type in ("grpo", "sapo"):
        return [m / (max(float(m.sum()), 1.0) * B) for m in masks]
    if loss_type == "luspo":
        return [m / max(B, 1) for m in masks]
    if loss_type == "bnpo":
        return [m / max(active, 1.0) for m in masks]
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length (tokens)")
        return [m / (B * max_completion_length) for m in masks]
    n = num_items_in_batch if num_items_in_batch is not None else active
    return [m / max(float(n), 1.0) for m in masks]



def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor | None,
             ref_rejected_logps: torch.Tensor | None, *, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None, simpo_gamma: float = 0.5) -> torch.Tensor:
    """Per-pair DPO losses [B] from summed completion logprobs [B] (nats) of the policy and the frozen reference,
    as TRL 1.16's DPOTrainer (`_compute_loss`, f_divergence_type="reverse_kl"), with delta = (chosen_logps -
    ref_chosen_logps) - (rejected_logps - ref_rejected_logps):

        sigmoid  -log sigmoid(beta * delta)                                  Rafailov et al. 2023, DPO
        hinge    relu(1 - beta * delta)                                      Zhao et al. 2023, SLiC
        ipo      (delta' - 1 / (2 beta))^2, delta' of per-token means        Azar et al. 2023, IPO, eq. 17 (TRL
                 (chosen_tokens, rejected_tokens: completion lengths)        normalises by the completion lengths)
        robust   (-(1 - e) log sigmoid(beta delta) + e log sigmoid(-beta delta)) / (1 - 2e), e = label_smoothing
                                                                             Chowdhury et al. 2024, rDPO
        simpo    -(1 - e) log sigmoid(beta m) - e log sigmoid(-beta m), m = the difference of the per-token mean
                 logprobs (chosen_tokens, rejected_tokens) - simpo_gamma / beta; reference-free (the ref arguments
                 may be None)                                                Meng et al. 2024, SimPO (TRL's
                                                                             CPOTrainer loss_type="simpo" with
                                                                             cpo_alpha=0)

    Over a tree, `engine.sequence.replay_sequence_backward` computes the summed logprobs and the exact gradient.
    Raises ValueError: unknown loss_type, beta <= 0, label_smoothing outside [0, 0.5) for robust, ipo or simpo
    without the completion lengths, or a reference-based loss without the reference logprobs."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"DPO loss_type '{loss_type}' is unknown; choose one of {', '.join(DPO_LOSS_TYPES)}")
    if beta <= 0:
        raise ValueError(f"DPO beta must be > 0, got {beta}")
    logsigmoid = torch.nn.functional.logsigmoid
    if loss_type == "simpo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("DPO loss_type 'simpo' needs chosen_tokens and rejected_tokens (completion lengths)")
        margin = chosen_logps / chosen_tokens.clamp(min=1) - rejected_logps / rejected_tokens.clamp(min=1)
        z = beta * (margin - simpo_gamma / beta)
        return -(1 - label_smoothing) * logsigmoid(z) - label_smoothing * logsigmoid(-z)
    if ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError(f"DPO loss_type '{loss_type}' needs the reference model's logprobs")
    chosen, rejected = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        return -torch.nn.functional.logsigmoid(beta * (chosen - rejected))
    if loss_type == "hinge":
        return torch.relu(1 - beta * (chosen - rejected))
    if loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("DPO loss_type 'ipo' needs chosen_tokens and rejected_tokens (completion lengths)")
        delta = chosen / chosen_tokens.clamp(min=1) - rejected / rejected_tokens.clamp(min=1)
        return (delta - 1 / (2 * beta)) ** 2
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"DPO label_smoothing must be in [0, 0.5) for 'robust', got {label_smoothing}")
    z = beta * (chosen - rejected)
    return (-(1 - label_smoothing) * logsigmoid(z) + label_smoothing * logsigmoid(-z)) / (1 - 2 * label_smoothing)


def dpo_metrics(sums: torch.Tensor, ref_sums: torch.Tensor | None, lengths: torch.Tensor, *, beta: float,
                loss_type: str) -> dict[str, float]:
    """TRL 1.16 DPOTrainer's metrics of a step's pairs. sums, ref_sums, lengths: [2B] float64, the policy's and the
    reference's summed completion logprobs (nats) and the completion lengths (tokens), chosen and rejected
    interleaved (pair k at 2k, 2k + 1). The implicit rewards are beta x (sums - ref_sums), or for simpo
    (reference-free, as TRL's CPOTrainer) beta x the mean logprob per token; returns rewards/chosen,
    rewards/rejected, rewards/accuracies (the fraction of pairs with chosen > rejected), rewards/margins and
    logps/chosen, logps/rejected (summed logprobs), each a mean over the pairs."""
    rewards = beta * sums / lengths.clamp(min=1) if loss_type == "simpo" else beta * (sums - ref_sums)
    chosen, rejected = rewards[0::2], rewards[1::2]
    return {"rewards/chosen": chosen.mean().item(), "rewards/rejected": rejected.mean().item(),
            "rewards/accuracies": (chosen > rejected).double().mean().item(),
            "rewards/margins": (chosen - rejected).mean().item(),
            "logps/chosen": sums[0::2].mean().item(), "logps/rejected": sums[1::2].mean().item()}
