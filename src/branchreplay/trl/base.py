"""What the tree trainers share: the checks when they are built, and TRL's own loss run over the tree's rows.

`TreeTrainerMixin` goes before TRL's trainer in the bases (`class TreeRLOOTrainer(TreeTrainerMixin,
trl.RLOOTrainer)`). Its training step computes TRL's `_compute_loss` as a function of the rows' per-token logprobs
and entropies, exactly, in two passes of the execution stack (`engine.sequence.replay_function_backward`):

    pass 1  the tree's logprobs and entropies of every row (no graph), handed to TRL's `_compute_loss` as the
            [B, C] tensors its `_get_per_token_logps_and_entropies` would have returned (float64 leaves): TRL's
            formula, its metrics and its state (the adaptive entropy controller) run once, as in TRL;
    pass 2  the derivatives of that loss with respect to the leaves, back-propagated through the tree.

So any loss TRL computes from those tensors runs exactly, whatever couples a row's tokens (sequence ratios, masks
read from the entropies or the logprobs); the cost over a token-level loss is one forward pass without a graph.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings

import torch

from ..engine import EngineConfig, UnsupportedModelError
from ..engine.families import family_of
from ..engine.router import RouterLoss
from ..engine.self_check import PROCESS_VERDICTS, ensure_supported
from ..engine.sequence import replay_function_backward
from ..engine.vision import is_vision_language, language_model
from ..rl.data.rewards import with_timeout
from ..tree import ReplayResult
from .options import DropInOptions
from .processes import WrapperStep, launch_refusals, watching_ranks
from .rows import batch_rollouts, in_row_order, on_rows, prompt_trees, trained_mask
from .split_groups import arranged, split_groups_refusal
from .zero import GradientInjection


class TreeTrainerMixin:
    """TRL's trainer with each training micro-batch's forward and backward run over one rollout tree per prompt.

    Args (keywords, besides TRL's own): the fields of `branchreplay.trl.options.DropInOptions` (engine,
        unknown_family, split_groups), listed with their types and defaults on the config reference page.

    Raises (when the trainer is built, before anything is generated):
        ValueError: naming the config field, for what the tree does not run: active dropout (set
            disable_dropout=True), fp16 (its loss scaler would not scale the tree's gradients), use_liger_kernel,
            DeepSpeed, FSDP, processes that would not train together (`processes.launch_refusals`), and what a
            subclass adds.
        UnsupportedModelError (a ValueError): the model's family, when the engine cannot run it (recurrent layers
            of an unregistered family, ALiBi, an attention implementation without a tree mask) or its self-check
            fails.
    Vision-language models: Gemma3 and Qwen2-VL (images in each tree's prompt node, `engine.vision`); others are
    refused by name when the trainer is built.
    """

    trl_name = "GRPOTrainer"  # TRL's class, for messages
    config_name = "GRPOConfig"

    def __init__(self, *args, **kwargs):
        name = type(self).__name__
        try:
            options = DropInOptions.pop_from(kwargs)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        self._tree_outputs = None  # the [B, C] logprobs and entropies (and router aux loss) TRL's loss reads
        self._zero3 = GradientInjection()  # the gradient handed to DeepSpeed ZeRO-3 (zero.py)
        self.split_groups = options.split_groups
        if options.reward_timeout_s is not None and kwargs.get("reward_funcs") is not None:
            kwargs["reward_funcs"] = timed_rewards(kwargs["reward_funcs"], options.reward_timeout_s)
        super().__init__(*args, **kwargs)
        if self.aux_loss_enabled and not RouterLoss.exists(self.model):
            # TRL turns the aux loss on from the config alone; Llama 4, Gemma 4 and DeepSeek-V3 compute none (TRL's
            # own class then fails adding None to its loss): there is nothing to add
            self.aux_loss_enabled = False
        self.engine = options.engine if options.engine is not None else EngineConfig()
        self._trusted = check_family(self.model, options.unknown_family, name, router_loss=self.aux_loss_enabled)
        if getattr(self.args, "cast_lm_head_to_fp32", False):  # TRL cast the head; its fused head runs in float32
            self.engine = dataclasses.replace(self.engine, head_float32=True)
        for refused, why in self._refusals():
            if refused:
                raise ValueError(f"{name}: {why}")
        if not self.args.disable_dropout and any(isinstance(m, torch.nn.Dropout) and m.p > 0
                                                 for m in self.model.modules()):
            raise ValueError(f"{name}: the model has active dropout (e.g. a LoraConfig's lora_dropout), which draws "
                             f"other masks in the tree than in each rollout: set {self.config_name}("
                             "disable_dropout=True) or the dropout to 0")
        if self.args.activation_checkpointing:
            # the tree keeps each pack's activations or replays the pack (engine.replay); transformers' per-layer
            # checkpoints would drop the prefix cache the children run against
            warnings.warn(f"{name}: gradient_checkpointing (TRL's default) is replaced by the execution stack's own "
                          "replay of packs under engine.memory_budget", stacklevel=3)
            self.args.activation_checkpointing = False
            if self.model.is_activation_checkpointing:
                self.model.activation_checkpointing_disable()
            if hasattr(self.model, "peft_config"):  # TRL's hook for checkpointed adapters: grads through frozen layers
                self.model.disable_input_require_grads()

    def _refusals(self) -> list[tuple[bool, str]]:
        """(refused, why) of every setting or setup the tree does not run; a subclass adds its own."""
        args = self.args
        return [
            (args.fp16, "fp16=True: its loss scaler would not scale the tree's gradients; use bf16=True or neither"),
            (args.use_liger_kernel, "use_liger_kernel=True replaces the model's forward; set it to False"),
        ] + launch_refusals(self.accelerator, self.model, type(self).__name__, self.config_name) + [
            (bool(why := split_groups_refusal(self.split_groups, self._language_config(),
                                              is_vision_language(self._base_model()), self.aux_loss_enabled)), why),
        ]

    def _base_model(self) -> torch.nn.Module:
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def _language_config(self):
        """The config of the model's language model (a vision-language model's text tower)."""
        return language_model(self._base_model()).config

    def _arranged(self, trees: list, order: list[int], model: torch.nn.Module) -> tuple[list, list[int]]:
        """`split_groups.arranged` of the micro-batch's prompt trees under the trainer's `split_groups` (the K/V's
        bytes per element priced as the parameters')."""
        return arranged(trees, order, self.split_groups, self._language_config(),
                        next(model.parameters()).element_size(), self.aux_loss_enabled, self.engine.forest)

    def train(self, *args, **kwargs):
        """TRL's `train`; on several processes, a rank that dies stops the others with `processes.RankDied`."""
        with watching_ranks(self.accelerator, type(self).__name__, lambda: self.state.global_step + 1):
            return super().train(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Training: the tree's forward and backward; returns TRL's loss value as a 0-dim float32 tensor on which
        the trainer's own `accelerator.backward` hands the gradient to the launch's wrapper
        (`processes.WrapperStep`: on one process, DDP and FSDP2 a leaf, the gradient already in `param.grad`;
        under DeepSpeed a loss that carries it). Evaluation (no grad): TRL's own padded loss."""
        if not (self.model.training and torch.is_grad_enabled()):  # evaluation (DPO's may ask for outputs)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            raise ValueError(f"{type(self).__name__}: a training step does not return outputs")
        step = WrapperStep(self.accelerator, model, self._zero3)
        with step.running() as module:
            loss = self._tree_backward(module, inputs)
        scale = self._accumulation_divisor()
        return step.loss(loss, scale)

    def _tree_backward(self, model, inputs) -> float:
        """The micro-batch's gradient into `param.grad`; returns the loss value `compute_loss` returns. Here: TRL's
        own loss in two passes (module docstring)."""
        mask = trained_mask(inputs)
        rollouts, lengths = batch_rollouts(inputs, mask)
        return self._two_pass_backward(model, inputs, mask, rollouts, lengths)

    def _two_pass_backward(self, model, inputs, mask: torch.Tensor, rollouts, lengths: list[int]) -> float:
        """TRL's `_compute_loss` as a function of the rows' logprobs and entropies, differentiated through the tree
        (module docstring); the gradient is scaled as transformers' `training_step` scales TRL's loss before its
        backward (divided by the accumulation steps unless the trainer says its loss already is)."""
        trees, order = self._arranged(*prompt_trees(inputs, rollouts, model), model)
        keep = mask.bool()
        old = inputs.get("old_per_token_logps")
        fill = old.detach().double() if old is not None else torch.zeros(mask.shape, dtype=torch.float64)
        divisor = self._accumulation_divisor()
        device = inputs["completion_ids"].device
        router = self._router_loss(model)

        def trl_loss(logprobs: list[torch.Tensor], entropy: list[torch.Tensor]) -> torch.Tensor:
            logps = on_rows(in_row_order(logprobs, order), rollouts, lengths, keep, fill)
            entropies = on_rows(in_row_order(entropy, order), rollouts, lengths, keep, torch.zeros_like(fill))
            self._tree_outputs = (logps.to(device), entropies.to(device), router.aux if router else None)
            try:
                return super(TreeTrainerMixin, self)._compute_loss(model, inputs) / divisor
            finally:
                self._tree_outputs = None

        with self.accelerator.autocast():
            loss, _, result = replay_function_backward(model, trees, trl_loss, temperature=self.temperature,
                                                       engine=self.engine, trusted=self._trusted, router=router)
        self._log_tree_metrics(result)
        return loss * divisor

    def _router_loss(self, model) -> RouterLoss | None:
        """The MoE router load-balancing loss over the micro-batch's trees where TRL adds it (`aux_loss_enabled`:
        the config has output_router_logits and router_aux_loss_coef != 0, and the model has such a loss:
        `RouterLoss.exists`, checked when the trainer is built), else None. TRL computes it over one
        forward of the whole micro-batch, every real prompt and completion token counted (its attention_mask): the
        tree counts each position once per row through it (`engine.router`)."""
        return RouterLoss(model) if self.aux_loss_enabled else None

    def _accumulation_divisor(self) -> float:
        """What transformers' `Trainer.training_step` divides `compute_loss`'s loss by before the backward: 1 when
        the loss is already scaled for gradient accumulation (its rule), else the accumulation steps."""
        if self.loss_is_scaled_for_ga is not None:
            scaled = bool(self.loss_is_scaled_for_ga)
        else:
            scaled = bool(self.model_accepts_loss_kwargs) or self.compute_loss_func is not None
        return 1.0 if scaled else float(self.current_gradient_accumulation_steps)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        """TRL's padded forward, except inside pass 1's call of TRL's loss: the tree's rows then."""
        if self._tree_outputs is None:
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        return self._tree_outputs

    def _log_tree_metrics(self, result: ReplayResult) -> None:
        """tree/logical_tokens, tree/physical_tokens and tree/token_ratio of the pass that trained."""
        metrics = self._metrics["train"]
        metrics["tree/logical_tokens"].append(float(result.stats.logical_tokens))
        metrics["tree/physical_tokens"].append(float(result.stats.physical_tokens))
        metrics["tree/token_ratio"].append(result.stats.token_ratio)


def timed_rewards(reward_funcs, timeout_s: float):
    """TRL's `reward_funcs` (one or a list) with each Python function under `rewards.with_timeout` (its name kept,
    which TRL logs; the message names the rank under a multi-process launch); a model id or a reward model stays as
    it is."""
    where = f" on rank {os.environ['RANK']}" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""

    def timed(func):
        return with_timeout(func, timeout_s, "reward_timeout_s", where) if callable(func) and not isinstance(
            func, torch.nn.Module) else func

    return [timed(f) for f in reward_funcs] if isinstance(reward_funcs, list) else timed(reward_funcs)


def check_family(model, unknown_family: str, trainer: str, router_loss: bool = False):
    """The engine's `trusted` for `model` (a PeftModel's base model is checked): False for a registered family,
    True for an unregistered one that passed its self-check; raises `UnsupportedModelError` naming the
    trainer, the family and the reason otherwise (`engine.self_check.ensure_supported`). `router_loss`: the trainer
    computes the MoE router loss over the trees (`engine.families.family_of`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    log = logging.getLogger("branchreplay").info
    try:
        base = language_model(base)  # a vision-language model's LM; an unsupported one is refused here
        trusted = ensure_supported(base, unknown_family, PROCESS_VERDICTS, log=log)
        family_of(base, trusted=trusted, router_loss=router_loss)  # what every family needs: a tree mask, ...
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{trainer}: {e}") from None
    return trusted
