"""The TRL drop-in: `TreeGRPOTrainer`, TRL's `GRPOTrainer` whose training step runs the execution stack.

    from branchreplay.trl import TreeGRPOTrainer   # was: from trl import GRPOTrainer
    trainer = TreeGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    trainer.train()

Everything but the loss's forward and backward is TRL's own: generation, reward functions, advantages, old and
reference logprobs, the optimizer, logging, checkpoints. Each micro-batch TRL hands to `compute_loss` (left-padded
prompt ids, right-padded completion ids and mask, advantages, old / reference logprobs) becomes one rollout tree per
prompt (its rows unpadded: the prompt once, completions sharing their common starts), and `engine.replay_backward`
puts into `param.grad` the gradient of TRL's loss (`losses.GRPOLoss` with `losses.token_weights`: TRL 1.16's
`_compute_loss`, tests/test_trl.py). `compute_loss` then returns the loss value as a leaf tensor, so transformers'
`Trainer.training_step`, which calls `accelerator.backward` on it, adds nothing more.

The logged metrics are TRL's (`entropy`, `kl`, `clip_ratio/*`, `cispo_clip_ratio`, `policy_loss`, rewards, ...)
plus `tree/logical_tokens`, `tree/physical_tokens` and `tree/token_ratio` (rollout positions over computed ones).

TreeGRPOTrainer's rows are unpadded, which TRL's padded rows equal: tests/test_trl_trainer.py compares the two
gradients on TRL's own micro-batches (left-padded prompts, completions of several lengths, tool masks), float32.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from packaging.version import Version

from .engine import EngineConfig, replay_backward
from .losses import GRPOLoss, token_weights
from .tree import Rollout, RolloutTree

TRL_RANGE = ("1.16", "1.17")
"""The TRL versions this module was written against and tested with: >= 1.16, < 1.17."""

try:
    import trl
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("branchreplay.trl needs TRL 1.16: pip install 'branchreplay[trl]'") from e

if not Version(TRL_RANGE[0]) <= Version(trl.__version__) < Version(TRL_RANGE[1]):
    raise ImportError(
        f"branchreplay.trl supports TRL >= {TRL_RANGE[0]}, < {TRL_RANGE[1]}; this environment has TRL "
        f"{trl.__version__}: pip install 'trl>={TRL_RANGE[0]},<{TRL_RANGE[1]}' (or 'branchreplay[trl]')"
    )

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
"""GRPOConfig.loss_type values the tree runs exactly as TRL (vespo is not implemented)."""


class TreeGRPOTrainer(trl.GRPOTrainer):
    """TRL 1.16's `GRPOTrainer` with the padded forward and backward of each micro-batch replaced by the execution
    stack over one rollout tree per prompt: the same gradient (to floating-point tolerance), each shared position
    computed once.

    Args:
        *args, **kwargs: exactly `trl.GRPOTrainer`'s (model, reward_funcs, args=GRPOConfig, datasets, ...).
        engine: packing, chunking and replay options (`branchreplay.engine.EngineConfig`); None for the defaults.

    Supported GRPOConfig settings: every `loss_type` in `SUPPORTED_LOSS_TYPES`, `beta` (the k3 KL, with or without
    `use_bias_correction_kl`), a fixed `entropy_coef`, `epsilon` / `epsilon_high`, `delta`, `num_iterations`,
    `steps_per_generation`, gradient accumulation, `temperature`, `bf16` autocast, `gradient_checkpointing` (the
    tree keeps its own activations, so it is switched off: a notice says so), TRL's tools (`tool_mask`), and vLLM's
    importance-sampling correction (every mode).

    Raises:
        ValueError: naming the GRPOConfig field, for what the tree does not run: loss_type vespo,
            importance_sampling_level 'sequence' (GSPO), top_entropy_quantile < 1, off_policy_mask_threshold,
            use_adaptive_entropy, active dropout (set disable_dropout=True), fp16 (its loss scaler would
            not scale the tree's gradients), use_liger_kernel, cast_lm_head_to_fp32, an MoE router aux loss,
            DeepSpeed, FSDP, more than one process, and images (vision-language models).
    """

    def __init__(self, *args, engine: EngineConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine = engine if engine is not None else EngineConfig()
        _refuse_unsupported(self)
        if not self.args.disable_dropout and any(isinstance(m, torch.nn.Dropout) and m.p > 0
                                                 for m in self.model.modules()):
            raise ValueError("TreeGRPOTrainer: the model has active dropout (e.g. a LoraConfig's lora_dropout), which "
                             "draws other masks in the tree than in each rollout: set GRPOConfig(disable_dropout=True) "
                             "or the dropout to 0")
        if self.args.activation_checkpointing:
            # the tree keeps each pack's activations or replays the pack (engine.replay); transformers' per-layer
            # checkpoints would drop the prefix cache the children run against
            warnings.warn("TreeGRPOTrainer: gradient_checkpointing (TRL's default) is replaced by the execution "
                          "stack's own replay of packs under engine.memory_budget", stacklevel=2)
            self.args.activation_checkpointing = False
            if self.model.is_activation_checkpointing:
                self.model.activation_checkpointing_disable()
            if hasattr(self.model, "peft_config"):  # TRL's hook for checkpointed adapters: grads through frozen layers
                self.model.disable_input_require_grads()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Training: the tree's forward and backward (gradients into `param.grad`); returns TRL's loss value as a
        0-dim float32 leaf tensor that requires grad, so the trainer's own backward on it is a no-op. Evaluation
        (no grad): TRL's own padded loss."""
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        if not (self.model.training and torch.is_grad_enabled()):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = self._tree_backward(self.accelerator.unwrap_model(model), inputs)
        return torch.tensor(loss, dtype=torch.float32, device=self.accelerator.device, requires_grad=True)

    def _tree_backward(self, model, inputs) -> float:
        if any(inputs.get(name) is not None for name in ("pixel_values", "image_grid_thw", "num_images")):
            raise ValueError("TreeGRPOTrainer: prompts with images (vision-language models) are not run over trees; "
                             "use trl.GRPOTrainer")
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
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
        rollouts = [dataclasses.replace(r, weights=w) for r, w in zip(rollouts, weights)]
        loss_fn = GRPOLoss(self.epsilon_low, self.epsilon_high, self.beta, self.entropy_coef,
                           use_bias_correction_kl=self.args.use_bias_correction_kl, delta=self.args.delta,
                           entropy_tokens=float(mask.sum()) * accumulation, loss_type=self.loss_type,
                           sapo_temperature_pos=self.args.sapo_temperature_pos,
                           sapo_temperature_neg=self.args.sapo_temperature_neg)
        groups = prompt_groups(inputs["prompt_ids"], inputs["prompt_mask"])
        trees = [RolloutTree([rollouts[i] for i in group]) for group in groups]
        with self.accelerator.autocast():
            result = replay_backward(model, trees, loss_fn, temperature=self.temperature, engine=self.engine)
        logps, entropies = (torch.zeros(mask.shape, dtype=torch.float64) for _ in range(2))
        for k, i in enumerate(i for group in groups for i in group):
            n = lengths[i]
            logps[i, :n] = result.logprobs[k][len(rollouts[i]) - n:]
            entropies[i, :n] = result.entropy[k][len(rollouts[i]) - n:]
        self._log_loss_metrics(inputs, mask.double().cpu(), logps, entropies, result)
        return result.loss

    def _log_loss_metrics(self, inputs, mask, logps, entropies, result) -> None:
        """TRL's `_compute_loss` metrics, with its formulas, from the tree's per-row logprobs and entropies ([B, C]
        float64, 0 past each completion), plus the tree's sizes."""
        metrics = self._metrics["train"]
        advantages = inputs["advantages"].double().cpu()
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        old = inputs.get("old_per_token_logps")
        ratio = torch.exp(logps - (logps if old is None else old.double().cpu()))

        def masked_mean(x):
            return float((x * mask).sum() / mask.sum().clamp(min=1.0))

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
            rows = mask.sum(-1) > 0  # TRL's nanmin / nanmax over rows: NaN when no row has a trained token
            low_rows, high_rows = ((x * mask).sum(-1)[rows] / mask.sum(-1)[rows] for x in (low, high))
            metrics["clip_ratio/low_min"].append(float(low_rows.min()) if rows.any() else float("nan"))
            metrics["clip_ratio/high_max"].append(float(high_rows.max()) if rows.any() else float("nan"))
        if self._entropy_bonus_enabled:
            accumulation = self.current_gradient_accumulation_steps
            policy_loss = result.loss + self.entropy_coef * masked_mean(entropies) / accumulation
            if self.loss_type not in ("dapo", "cispo"):  # TRL logs these before dividing by the accumulation
                policy_loss *= accumulation
            metrics["policy_loss"].append(policy_loss)
            if self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
        metrics["tree/logical_tokens"].append(float(result.stats.logical_tokens))
        metrics["tree/physical_tokens"].append(float(result.stats.physical_tokens))
        metrics["tree/token_ratio"].append(result.stats.token_ratio)


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Rows of a left-padded [B, P] prompt batch grouped by their unpadded prompt, in order of first appearance:
    one rollout tree per group."""
    groups: dict[tuple, list[int]] = {}
    for i, (ids, keep) in enumerate(zip(prompt_ids.tolist(), prompt_mask.tolist())):
        groups.setdefault(tuple(t for t, k in zip(ids, keep) if k), []).append(i)
    return list(groups.values())


def batch_rollouts(inputs: dict, mask: torch.Tensor, ratio: torch.Tensor | None = None
                   ) -> tuple[list[Rollout], list[int]]:
    """TRL's padded micro-batch as unpadded rollouts, one per row: the prompt ids where `prompt_mask` is 1, then the
    completion's ids (the leading ones of `completion_mask`, TRL's mask up to the first EOS); loss mask `mask`
    [B, C] (completion_mask x tool_mask) on the completion; advantages [B] or [B, C], old and reference logprobs
    [B, C] moved onto the completion's positions; and each row's completion length (tokens). `ratio` ([B, C] or
    [B, 1], >= 0): vLLM's importance-sampling weights, which TRL multiplies into each token's policy term (not the
    KL, not the entropy bonus): the term is linear in the advantage, so they go into the advantages. The weights
    are the caller's. Raises ValueError for a completion_mask with a gap (a zero before a one)."""
    prompt_ids, prompt_mask = inputs["prompt_ids"].cpu(), inputs["prompt_mask"].cpu().bool()
    completion_ids, completion_mask, mask = inputs["completion_ids"].cpu(), inputs["completion_mask"].cpu(), mask.cpu()
    B, C = completion_ids.shape
    advantages = inputs["advantages"].cpu()
    advantages = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(B, C)
    if ratio is not None:
        advantages = advantages * ratio.cpu().expand(B, C)
    old, ref = inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps")
    rollouts, lengths = [], []
    for i in range(B):
        n = int(completion_mask[i].sum())
        if n and not bool(completion_mask[i, :n].all()):
            raise ValueError(f"completion_mask row {i} has a gap: TreeGRPOTrainer needs each row's completion first, "
                             "then padding (tool results are masked out by tool_mask)")
        prompt = prompt_ids[i][prompt_mask[i]]
        T = len(prompt) + n
        rollouts.append(Rollout(
            torch.cat([prompt, completion_ids[i, :n]]),
            loss_mask=torch.cat([torch.zeros(len(prompt)), mask[i, :n].float()]),
            advantages=on_rollout(advantages[i], T, n),
            old_logprobs=None if old is None else on_rollout(old[i].cpu(), T, n),
            ref_logprobs=None if ref is None else on_rollout(ref[i].cpu(), T, n)))
        lengths.append(n)
    return rollouts, lengths


def on_rollout(values: torch.Tensor, T: int, n: int) -> torch.Tensor:
    """[C] values of a padded row's completion as [T] float64 on the positions of its rollout of T tokens whose
    last n are the completion: 0 on the prompt."""
    return torch.cat([torch.zeros(T - n, dtype=torch.float64), values[:n].double()])


def _refuse_unsupported(trainer: TreeGRPOTrainer) -> None:
    """ValueError naming the first GRPOConfig setting (or setup) the tree does not run, and what to do instead."""
    args = trainer.args
    distributed = trainer.accelerator.distributed_type.value
    refusals = [
        (trainer.loss_type not in SUPPORTED_LOSS_TYPES,
         f"loss_type='{trainer.loss_type}' is not implemented over trees; use one of "
         f"{', '.join(SUPPORTED_LOSS_TYPES)}"),
        (trainer.importance_sampling_level != "token",
         f"importance_sampling_level='{trainer.importance_sampling_level}' (GSPO) is not run by TreeGRPOTrainer; "
         "use 'token', or branchreplay train --grpo.importance_sampling_level sequence"),
        (trainer.top_entropy_quantile < 1.0,
         "top_entropy_quantile < 1 needs the entropies before the loss; set it to 1.0, or use branchreplay train "
         "--grpo.top_entropy_quantile"),
        (trainer.off_policy_mask_threshold is not None,
         "off_policy_mask_threshold needs the current logprobs before the loss; set it to None"),
        (trainer.use_adaptive_entropy, "use_adaptive_entropy is not run by TreeGRPOTrainer; set a fixed entropy_coef"),
        (args.fp16, "fp16=True: its loss scaler would not scale the tree's gradients; use bf16=True or neither"),
        (args.use_liger_kernel, "use_liger_kernel=True replaces the model's forward; set it to False"),
        (args.cast_lm_head_to_fp32, "cast_lm_head_to_fp32=True replaces the LM head's forward; set it to False"),
        (trainer.aux_loss_enabled, "an MoE router aux loss is not run over trees; TRL turns it on for every config "
         "that has output_router_logits, so set GRPOConfig(router_aux_loss_coef=0.0) to train without it"),
        (distributed in ("DEEPSPEED", "FSDP"),
         f"{distributed} is not supported by TreeGRPOTrainer (ZeRO-3 / FSDP shard the parameters the tree's "
         "backward writes into); run on one process, or use branchreplay train with torchrun"),
        (trainer.accelerator.num_processes > 1,
         f"{trainer.accelerator.num_processes} processes: TreeGRPOTrainer runs on one; for data parallelism use "
         "branchreplay train with torchrun"),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"TreeGRPOTrainer: {why}")
