"""`TreeGRPOTrainer`: TRL 1.16's `GRPOTrainer` whose training step runs the execution stack.

    from branchreplay.trl import TreeGRPOTrainer   # was: from trl import GRPOTrainer
    trainer = TreeGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    trainer.train()

GRPO's token-level losses run in one pass (`losses.GRPOLoss` with `losses.token_weights`: TRL 1.16's
`_compute_loss`, tests/test_losses_trl.py); the settings whose loss couples a row's tokens or reads the logprobs and
entropies before the loss run TRL's own loss in two (`base.py`).
"""

from __future__ import annotations

import dataclasses

import torch
import trl
from trl.trainer.utils import nanmax, nanmin

from ..engine import replay_backward
from ..losses import GRPOLoss, token_weights
from .base import TreeTrainerMixin
from .rows import batch_rollouts, in_row_order, on_rows, prompt_trees, trained_mask

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
"""GRPOConfig.loss_type values the tree runs exactly as TRL: every loss type of TRL 1.16."""


class TreeGRPOTrainer(TreeTrainerMixin, trl.GRPOTrainer):
    """TRL 1.16's `GRPOTrainer` with the padded forward and backward of each micro-batch replaced by the execution
    stack over one rollout tree per prompt: the same gradient (to floating-point tolerance), each shared position
    computed once.

    Args:
        *args, **kwargs: exactly `trl.GRPOTrainer`'s (model, reward_funcs, args=GRPOConfig, datasets, ...).
        engine, unknown_family: `base.TreeTrainerMixin`'s.

    Supported GRPOConfig settings: every `loss_type` of TRL 1.16, `beta` (the k3 KL, with or without
    `use_bias_correction_kl`), `entropy_coef` fixed or `use_adaptive_entropy`, `epsilon` / `epsilon_high`, `delta`,
    `importance_sampling_level` 'token' or 'sequence' (GSPO), `top_entropy_quantile`, `off_policy_mask_threshold`,
    `num_iterations`, `steps_per_generation`, gradient accumulation, `temperature`, `bf16` autocast,
    `cast_lm_head_to_fp32`, `router_aux_loss_coef` (MoE models), `gradient_checkpointing` (the tree keeps its own
    activations, so it is switched off: a notice says so), TRL's tools (`tool_mask`), and vLLM's importance-sampling
    correction (every mode).

    Two paths, both exact: the token-level settings run in one pass of the execution stack (`losses.GRPOLoss`,
    TRL's formula per node). GSPO's sequence ratio, vespo's sequence weights, the entropy quantile mask, the
    off-policy sequence mask, the adaptive entropy controller and an MoE model's router aux loss run TRL's own
    `_compute_loss` on the tree's rows in two passes (`base.TreeTrainerMixin`), for one more forward pass without
    a graph.

    Raises: `base.TreeTrainerMixin`'s, when the trainer is built.
    """

    def _tree_backward(self, model, inputs) -> float:
        if self._loss_reads_whole_rows():
            return super()._tree_backward(model, inputs)  # TRL's own loss, two passes
        mask = trained_mask(inputs)
        ratio = inputs.get("importance_sampling_ratio") if self.use_vllm and self.vllm_importance_sampling_correction \
            else None
        rollouts, lengths = batch_rollouts(inputs, mask, ratio)
        accumulation = self.current_gradient_accumulation_steps
        if self.loss_type in ("dapo", "cispo"):  # TRL: num_items_in_batch spans the generation batch
            normalizer = float(inputs["num_items_in_batch"].clamp(min=1.0)) / self.accelerator.num_processes
            normalizer = normalizer * accumulation / self.args.steps_per_generation
            weights = token_weights([r.loss_mask for r in rollouts], self.loss_type, num_items_in_batch=normalizer)
        else:
            weights = token_weights([r.loss_mask for r in rollouts], self.loss_type,
                                    max_completion_length=self.max_completion_length)
            weights = [w / accumulation for w in weights]
        rollouts = [dataclasses.replace(r, weights=w) for r, w in zip(rollouts, weights, strict=True)]
        loss_fn = GRPOLoss(self.epsilon_low, self.epsilon_high, self.beta, self.entropy_coef,
                           use_bias_correction_kl=self.args.use_bias_correction_kl, delta=self.args.delta,
                           entropy_tokens=float(mask.sum()) * accumulation, loss_type=self.loss_type,
                           sapo_temperature_pos=self.args.sapo_temperature_pos,
                           sapo_temperature_neg=self.args.sapo_temperature_neg)
        trees, order = self._arranged(*prompt_trees(inputs, rollouts, model), model)
        with self.accelerator.autocast():
            result = replay_backward(model, trees, loss_fn, temperature=self.temperature, engine=self.engine,
                                     trusted=self._trusted)
        every, zeros = torch.ones(mask.shape, dtype=torch.bool), torch.zeros(mask.shape, dtype=torch.float64)
        logps, entropies = (on_rows(in_row_order(values, order), rollouts, lengths, every, zeros)
                            for values in (result.logprobs, result.entropy))
        self._log_loss_metrics(inputs, mask.double().cpu(), logps, entropies, result)
        return result.loss

    def _loss_reads_whole_rows(self) -> bool:
        """Whether TRL's loss of this config is not a sum of per-token terms known before the forward pass (the
        two-pass path)."""
        return (self.importance_sampling_level == "sequence" or self.loss_type == "vespo"
                or self.top_entropy_quantile < 1.0 or self.off_policy_mask_threshold is not None
                or self.use_adaptive_entropy or self.aux_loss_enabled)

    def _refusals(self) -> list[tuple[bool, str]]:
        return super()._refusals() + [
            (self.loss_type not in SUPPORTED_LOSS_TYPES,
             f"loss_type='{self.loss_type}' is not implemented over trees; use one of "
             f"{', '.join(SUPPORTED_LOSS_TYPES)}"),
        ]

    def _log_loss_metrics(self, inputs, mask, logps, entropies, result) -> None:
        """TRL's `_compute_loss` metrics, with its formulas and its reductions over the processes, from the tree's
        per-row logprobs and entropies ([B, C] float64, 0 past each completion), plus the tree's sizes."""
        metrics = self._metrics["train"]
        advantages = inputs["advantages"].double().cpu()
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        old = inputs.get("old_per_token_logps")
        ratio = torch.exp(logps - (logps if old is None else old.double().cpu()))

        def masked_mean(x):  # TRL's global_masked_mean: the sums and counts of every process
            totals = torch.stack([(x * mask).sum(), mask.sum()]).to(self.accelerator.device)
            totals = self.accelerator.reduce(totals, reduction="sum")
            return float(totals[0] / totals[1].clamp(min=1.0))

        def gathered_row_means(x):  # TRL's gathered masked_seq_mean: NaN for a row without a trained token
            return self.accelerator.gather(((x * mask).sum(-1) / mask.sum(-1)).to(self.accelerator.device))

        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"].double().cpu()
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            metrics["kl"].append(masked_mean(kl * ratio if self.args.use_bias_correction_kl else kl))
        metrics["entropy"].append(masked_mean(entropies))
        if self.loss_type == "cispo":
            metrics["cispo_clip_ratio"].append(masked_mean(((ratio > self.epsilon_high) & (advantages > 0)).double()))
        elif self.loss_type != "sapo":
            if self.args.delta is not None:  # TRL's clip metrics see the ratio after two-sided clipping
                ratio = ratio.clamp(max=self.args.delta)
            low = ((ratio < 1 - self.epsilon_low) & (advantages < 0)).double()
            high = ((ratio > 1 + self.epsilon_high) & (advantages > 0)).double()
            metrics["clip_ratio/low_mean"].append(masked_mean(low))
            metrics["clip_ratio/high_mean"].append(masked_mean(high))
            metrics["clip_ratio/region_mean"].append(masked_mean(((low + high) > 0).double()))
            metrics["clip_ratio/low_min"].append(float(nanmin(gathered_row_means(low))))
            metrics["clip_ratio/high_max"].append(float(nanmax(gathered_row_means(high))))
        if self._entropy_bonus_enabled:
            accumulation = self.current_gradient_accumulation_steps
            policy_loss = result.loss + self.entropy_coef * masked_mean(entropies) / accumulation
            if self.loss_type not in ("dapo", "cispo"):  # TRL logs these before dividing by the accumulation
                policy_loss *= accumulation
            gathered = self.accelerator.gather(torch.tensor([policy_loss], device=self.accelerator.device))
            metrics["policy_loss"].append(float(gathered.nanmean()))
            if self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
        self._log_tree_metrics(result)
