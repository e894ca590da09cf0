"""Run configuration: one dataclass per concern, composed into `Config`.

    algorithm: grpo | ppo | rloo | reinforce_pp | dpo   (top level) what the advantages and the loss are
    model:    ModelConfig      which causal LM, in which dtype, on which device
    sampling: SamplingConfig   (from sampling.py) how completions are sampled
    task:     TaskConfig       (from tasks.py) which reasoning-gym dataset, split sizes
    agent:    AgentConfig      (from agent.py) a multi-turn environment and its limits; null = single-turn
    grpo:     GRPOConfig       sampling counts, clip range and optimizer of every algorithm (TRL GRPOConfig names)
    ppo:      PPOConfig        the critic, GAE and the value loss (algorithm: ppo; TRL PPOConfig names)
    rloo:     RLOOConfig       RLOO's options (algorithm: rloo; TRL RLOOConfig names)
    reinforce_pp: ReinforcePPConfig  REINFORCE++'s options (algorithm: reinforce_pp; verl's names)
    dpo:      DPOConfig        the preference file and the DPO loss (algorithm: dpo; TRL DPOConfig names)
    engine:   EngineConfig     (from engine/config.py) packing, chunking, replay; passed to every engine call
    parallel: ParallelConfig   data parallelism over torchrun's processes (FSDP2 or DDP semantics)
    train:    TrainConfig      steps, seed, run folder, checkpoint and eval cadence

Precedence: command line > YAML file > dataclass defaults (as torchtitan's config manager). A YAML file holds one
mapping per section (and `algorithm: NAME`); the command line overrides one field with `--section.field value` or
`--section.field=value`, and the algorithm with `--algorithm NAME`. Each algorithm starts from TRL's defaults for
its trainer where they differ from GRPO's (`ALGORITHM_DEFAULTS`).
Values are parsed to the field's declared type (bool: true/false/yes/no/1/0; a closed choice must be one of its
Literal values; tuples, lists and dicts as YAML, e.g. `--sampling.branching "[[0,2],[8,2]]"`). Unknown sections and
keys are errors that list the valid ones. `parse_args` is the one parser of `train` and `eval`; every field's help
is its metadata (`fields.help_of`), printed by `help_text`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from ..engine import EngineConfig
from ..fields import accepted, check, choice, help_of, nearest
from ..loss_types import DPOLossType, LossType
from .agent_config import AgentConfig
from .sampling_config import SamplingConfig, turn_factor
from .task_config import TaskConfig
from .trl_names import TRL_NAMES, from_trl_names, help_lines

DType = Literal["float32", "bfloat16", "float16", "float64"]
ScaleRewards = Literal["group", "batch", "none"]
LRScheduler = Literal["cosine", "linear", "constant"]
ParallelStrategy = Literal["auto", "fsdp2", "ddp"]
ParallelLayout = Literal["auto", "whole-or-split", "context-parallel"]  # engine.sharding.LAYOUTS
FsdpMode = Literal["auto", "gather-once", "resharded"]  # engine.distributed.FsdpMode
ImportanceSamplingLevel = Literal["token", "sequence"]
Algorithm = Literal["grpo", "ppo", "rloo", "reinforce_pp", "dpo"]
KLEstimator = Literal["k1", "k3"]


@dataclass
class ModelConfig:
    """The policy model (the reference model for the KL penalty is a frozen copy of its initial weights)."""

    spec: str = field(default="smollm2", metadata=help_of(
        "model to train, as models.load_model: 'smollm2' (default, SmolLM2-135M-Instruct), 'tiny:<arch>', a "
        "save_pretrained folder, a .gguf file or a hub id 'org/name'"))
    dtype: DType = field(default="float32", metadata=help_of(
        "float32 or float64: parameters and compute in that dtype; bfloat16: mixed precision, float32 parameters "
        "(master weights), gradients and AdamW state with the forwards under torch.autocast (as Hugging Face "
        "Trainer's bf16=True on a float32 model; models.autocast); float16: evaluation only (training it needs "
        "loss scaling)"))
    device: str = field(default="auto", metadata=help_of("torch device; 'auto' = cuda if available, else cpu"))
    lora_r: int = field(default=0, metadata=help_of(
        "LoRA rank through peft (models.apply_lora; TRL's ModelConfig lora_r), >= 0; 0 = train every parameter. "
        "The adapters are then the only trained parameters, checkpoints hold the adapter only (peft's "
        "adapter_model.safetensors), the KL reference is the model with its adapter off, and "
        "`branchreplay export` merges it"))
    lora_alpha: float = field(default=32.0, metadata=help_of("LoRA scaling numerator (scale = alpha / r), > 0"))
    lora_target_modules: str | None = field(default=None, metadata=help_of(
        "modules that get adapters: a comma list of names or suffixes (e.g. q_proj,v_proj), 'all-linear', or null "
        "for peft's default of the architecture"))

    def __post_init__(self):
        choice("model.dtype", self.dtype, DType)
        check("model.lora_r", isinstance(self.lora_r, int) and self.lora_r >= 0, "a whole number >= 0", self.lora_r)
        check("model.lora_alpha", self.lora_alpha > 0, "> 0", self.lora_alpha)
        if self.lora_target_modules is not None and not self.lora_r:
            raise ValueError("model.lora_target_modules is set but model.lora_r is 0 (LoRA off): set model.lora_r, "
                             "e.g. 16")

    def lora_targets(self) -> list[str] | str | None:
        """lora_target_modules as peft's target_modules: 'all-linear', a list of names, or None."""
        if self.lora_target_modules in (None, "all-linear"):
            return self.lora_target_modules
        return [name.strip() for name in self.lora_target_modules.split(",") if name.strip()]


@dataclass
class GRPOConfig:
    """The GRPO objective and its optimizer. Names and meanings follow TRL's GRPOConfig (trl/trainer/grpo_config.py).

    One training step samples `num_generations` completions for each of `prompts_per_step` prompts, then makes
    `num_iterations` optimizer updates on them (TRL's mu).
    """

    num_generations: int = field(default=8, metadata=help_of(
        "G, completions per prompt, >= 2 (a group of one has zero advantage: nothing to learn; TRL also requires "
        "2); must equal the product of sampling.branching"))
    prompts_per_step: int = field(default=4, metadata=help_of("prompts (groups) per step, >= 1"))
    loss_type: LossType = field(default="dapo", metadata=help_of(
        "loss normalisation (TRL meanings; see losses.token_weights)"))
    scale_rewards: ScaleRewards = field(default="group", metadata=help_of(
        "advantage scaling: 'group' divides by the group's reward std, 'batch' by the step's, 'none' not at all "
        "(Dr. GRPO)"))
    epsilon: float = field(default=0.2, metadata=help_of("lower clip range of the ratio, in (0, 1)"))
    epsilon_high: float | None = field(default=None, metadata=help_of(
        "upper clip range, > 0; default (null) = epsilon; DAPO uses 0.28; loss_type cispo: the largest importance "
        "weight (MiniMax-M1's eps_max)"))
    beta: float = field(default=0.0, metadata=help_of(
        "k3 KL coefficient against the initial model, >= 0 (0 = no reference model is kept)"))
    entropy_coef: float = field(default=0.0, metadata=help_of(
        "entropy bonus coefficient, >= 0 (0 = off); the bonus is the mean entropy over the step's completion tokens "
        "for every loss_type, as TRL's"))
    use_bias_correction_kl: bool = field(default=True, metadata=help_of(
        "multiply the k3 KL by the importance ratio (TRL's default; DeepSeek-V3.2): the KL gradient changes even "
        "on-policy; false gives plain k3"))
    delta: float | None = field(default=None, metadata=help_of(
        "two-sided clipping (TRL delta; INTELLECT-2): the unclipped ratio is capped at delta, > 0, best above "
        "1 + epsilon_high; null = off"))
    sapo_temperature_pos: float = field(default=1.0, metadata=help_of(
        "loss_type sapo: the gate's temperature where the advantage is positive, > 0 (TRL)"))
    sapo_temperature_neg: float = field(default=1.05, metadata=help_of(
        "loss_type sapo: the gate's temperature elsewhere, > 0 (TRL)"))
    importance_sampling_level: ImportanceSamplingLevel = field(default="token", metadata=help_of(
        "token: one ratio per token; sequence: every token of a completion takes the exp of its mean log-ratio "
        "(GSPO, Zheng et al. 2025; TRL's option; losses.gspo_loss, one extra forward without a graph per update)"))
    top_entropy_quantile: float = field(default=1.0, metadata=help_of(
        "keep in the policy term only the tokens whose entropy is in the top quantile of the step's completion "
        "tokens, in [0, 1] (TRL; Wang et al. 2025, Beyond the 80/20 rule, recommend 0.2; 1 = every token)"))
    num_iterations: int = field(default=1, metadata=help_of(
        "optimizer updates per batch of samples (TRL mu), >= 1; > 1 computes old logprobs before the first one"))
    mask_truncated_completions: bool = field(default=False, metadata=help_of(
        "exclude completions that hit sampling.max_new_tokens without EOS from the loss and its normaliser"))
    max_grad_norm: float = field(default=1.0, metadata=help_of("gradient clipping norm, > 0"))
    learning_rate: float = field(default=1e-6, metadata=help_of("peak AdamW learning rate, > 0"))
    weight_decay: float = field(default=0.0, metadata=help_of("AdamW weight decay, >= 0"))
    warmup_steps: int = field(default=0, metadata=help_of("linear warmup, in optimizer updates, >= 0"))
    lr_scheduler: LRScheduler = field(default="cosine", metadata=help_of(
        "learning-rate decay after warmup (cosine and linear decay to 0 at the end; transformers' schedules)"))
    micro_batch_prompts: int = field(default=0, metadata=help_of(
        "prompt groups per forward/backward call, >= 0 (0 = all of the step's); the gradient does not depend "
        "on it, only memory does"))

    def __post_init__(self):
        choice("grpo.loss_type", self.loss_type, LossType)
        choice("grpo.scale_rewards", self.scale_rewards, ScaleRewards)
        choice("grpo.lr_scheduler", self.lr_scheduler, LRScheduler)
        choice("grpo.importance_sampling_level", self.importance_sampling_level, ImportanceSamplingLevel)
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        check("grpo.num_generations", self.num_generations >= 2, ">= 2", self.num_generations)
        check("grpo.prompts_per_step", self.prompts_per_step >= 1, ">= 1", self.prompts_per_step)
        check("grpo.epsilon", 0 < self.epsilon < 1, "in (0, 1)", self.epsilon)
        check("grpo.epsilon_high", self.epsilon_high > 0, "> 0", self.epsilon_high)
        check("grpo.beta", self.beta >= 0, ">= 0", self.beta)
        check("grpo.entropy_coef", self.entropy_coef >= 0, ">= 0", self.entropy_coef)
        if self.delta is not None:
            check("grpo.delta", self.delta > 0, "> 0", self.delta)
        check("grpo.num_iterations", self.num_iterations >= 1, ">= 1", self.num_iterations)
        check("grpo.sapo_temperature_pos", self.sapo_temperature_pos > 0, "> 0", self.sapo_temperature_pos)
        check("grpo.sapo_temperature_neg", self.sapo_temperature_neg > 0, "> 0", self.sapo_temperature_neg)
        check("grpo.top_entropy_quantile", 0 <= self.top_entropy_quantile <= 1, "in [0, 1]",
              self.top_entropy_quantile)
        check("grpo.max_grad_norm", self.max_grad_norm > 0, "> 0", self.max_grad_norm)
        check("grpo.learning_rate", self.learning_rate > 0, "> 0", self.learning_rate)
        check("grpo.weight_decay", self.weight_decay >= 0, ">= 0", self.weight_decay)
        check("grpo.warmup_steps", self.warmup_steps >= 0, ">= 0", self.warmup_steps)
        check("grpo.micro_batch_prompts", self.micro_batch_prompts >= 0, ">= 0", self.micro_batch_prompts)


@dataclass
class PPOConfig:
    """PPO with a learned critic (algorithm: ppo). Names and defaults of TRL's PPOConfig (trl 0.24,
    trl/trainer/ppo_config.py; PPO is not in TRL 1.x). The rest of the objective comes from the grpo section:
    num_generations completions per prompt (TRL samples 1; more share the prompt in the tree), prompts_per_step,
    mask_truncated_completions and the optimizer fields; its epsilon, epsilon_high, delta, beta, entropy_coef,
    loss_type, scale_rewards and num_iterations do not apply (cliprange, kl_coef, a token mean, GAE and
    num_ppo_epochs do; TRL's PPO has no entropy bonus)."""

    value_model: str | None = field(default=None, metadata=help_of(
        "the critic's initial decoder, a model spec as model.spec (its own scalar head is drawn fresh); null = a "
        "copy of the policy (value.ValueModel.from_policy)"))
    kl_coef: float = field(default=0.05, metadata=help_of(
        "per-token KL penalty against the reference model in the reward, >= 0 (TRL kl_coef)"))
    kl_estimator: KLEstimator = field(default="k1", metadata=help_of(
        "k1: logp - ref_logp; k3: (r - 1) - log r with r = exp(ref_logp - logp) (Schulman 2020; TRL kl_estimator)"))
    cliprange: float = field(default=0.2, metadata=help_of("policy ratio clip range, in (0, 1)"))
    cliprange_value: float = field(default=0.2, metadata=help_of(
        "value clip range around the values at sampling, > 0"))
    vf_coef: float = field(default=0.1, metadata=help_of("value loss coefficient, > 0"))
    gamma: float = field(default=1.0, metadata=help_of("discount factor per token, in [0, 1]"))
    lam: float = field(default=0.95, metadata=help_of("GAE lambda, in [0, 1]"))
    whiten_rewards: bool = field(default=False, metadata=help_of(
        "whiten the per-token rewards over the step before GAE (TRL whiten_rewards; the mean is kept)"))
    num_ppo_epochs: int = field(default=4, metadata=help_of(
        "optimizer updates on each batch of samples, >= 1 (TRL num_ppo_epochs, with num_mini_batches=1)"))
    missing_eos_penalty: float | None = field(default=None, metadata=help_of(
        "subtracted from the reward of a completion that ends without EOS, >= 0; null = none"))

    def __post_init__(self):
        choice("ppo.kl_estimator", self.kl_estimator, KLEstimator)
        check("ppo.kl_coef", self.kl_coef >= 0, ">= 0", self.kl_coef)
        check("ppo.cliprange", 0 < self.cliprange < 1, "in (0, 1)", self.cliprange)
        check("ppo.cliprange_value", self.cliprange_value > 0, "> 0", self.cliprange_value)
        check("ppo.vf_coef", self.vf_coef > 0, "> 0", self.vf_coef)
        check("ppo.gamma", 0 <= self.gamma <= 1, "in [0, 1]", self.gamma)
        check("ppo.lam", 0 <= self.lam <= 1, "in [0, 1]", self.lam)
        check("ppo.num_ppo_epochs", self.num_ppo_epochs >= 1, ">= 1", self.num_ppo_epochs)
        if self.missing_eos_penalty is not None:
            check("ppo.missing_eos_penalty", self.missing_eos_penalty >= 0, ">= 0", self.missing_eos_penalty)


@dataclass
class RLOOConfig:
    """RLOO (algorithm: rloo), as TRL 1.16's RLOOTrainer (trl/trainer/rloo_trainer.py): a leave-one-out baseline
    per group, the KL in the reward (grpo.beta times the summed k1 of the sampling policy against the reference;
    TRL RLOOConfig.beta defaults to 0.05), a sequence-level clipped ratio (grpo.epsilon, epsilon_high), the loss a
    mean over the completions. grpo.delta, entropy_coef, use_bias_correction_kl and loss_type do not apply (TRL's
    RLOO has none of them)."""

    normalize_advantages: bool = field(default=False, metadata=help_of(
        "divide the advantages by their std over the step after centring them (TRL normalize_advantages)"))


@dataclass
class ReinforcePPConfig:
    """REINFORCE++ (algorithm: reinforce_pp; Hu et al. 2025), as verl's `compute_reinforce_plus_plus_outcome_
    advantage` and OpenRLHF's `reinforce` estimator: per-token rewards (the task's reward at the last token, minus
    grpo.beta times the per-token k1 KL against the reference), discounted returns, whitened over every completion
    token of the step; the token-level clipped loss of the grpo section (epsilon, loss_type)."""

    gamma: float = field(default=1.0, metadata=help_of("discount factor per token, in [0, 1] (verl algorithm.gamma)"))

    def __post_init__(self):
        check("reinforce_pp.gamma", 0 <= self.gamma <= 1, "in [0, 1]", self.gamma)


@dataclass
class DPOConfig:
    """DPO over prefix trees (algorithm: dpo): no sampling, preference pairs from a file (`preferences.py`), the
    prompt one node and chosen / rejected its branches. Names and defaults of TRL 1.16's DPOConfig
    (trl/trainer/dpo_config.py); simpo as TRL's CPOTrainer (cpo_alpha 0). The optimizer fields come from the grpo
    section (TRL's DPO learning rate is 1e-6, as ours)."""

    dataset: str | None = field(default=None, metadata=help_of(
        "local JSONL, JSON or Parquet file of rows with prompt, chosen, rejected (text, or lists of messages); "
        "required with algorithm=dpo (scripts/make_preference_set.py builds one from the task)"))
    loss_type: DPOLossType = field(default="sigmoid", metadata=help_of(
        "sigmoid (DPO), hinge, ipo, robust (label smoothing), simpo (reference-free): losses.dpo_loss"))
    beta: float = field(default=0.1, metadata=help_of("> 0; the KL strength (ipo: the regulariser tau)"))
    label_smoothing: float = field(default=0.0, metadata=help_of(
        "robust and simpo: the probability that a label is flipped, in [0, 0.5)"))
    simpo_gamma: float = field(default=0.5, metadata=help_of("simpo's target reward margin (TRL CPOConfig)"))
    pairs_per_step: int = field(default=8, metadata=help_of(
        "preference pairs per optimizer step, >= 1 (TRL's per_device_train_batch_size)"))
    max_length: int | None = field(default=1024, metadata=help_of(
        "tokens of prompt + response kept, from the start (TRL truncation_mode keep_start); null = no limit"))
    precompute_ref_log_probs: bool = field(default=False, metadata=help_of(
        "compute the reference logprobs of every pair once before training (TRL's option); false: per step"))

    def __post_init__(self):
        choice("dpo.loss_type", self.loss_type, DPOLossType)
        check("dpo.beta", self.beta > 0, "> 0", self.beta)
        check("dpo.label_smoothing", 0 <= self.label_smoothing < 0.5, "in [0, 0.5)", self.label_smoothing)
        check("dpo.pairs_per_step", self.pairs_per_step >= 1, ">= 1", self.pairs_per_step)
        if self.max_length is not None:
            check("dpo.max_length", self.max_length >= 2, ">= 2", self.max_length)


@dataclass
class TrainConfig:
    """The run: how long, where it is written, how often it is saved and evaluated."""

    steps: int = field(default=100, metadata=help_of("training steps (sampling rounds), >= 1"))
    seed: int = field(default=0, metadata=help_of(
        "seed of prompt order and sampling; the same seed gives the same run, resumed or not"))
    output_dir: str = field(default="runs/default", metadata=help_of(
        "run folder: config.yaml, metrics.jsonl, checkpoints/, plot; must not hold another run's checkpoints"))
    save_steps: int = field(default=50, metadata=help_of(
        "checkpoint every this many steps, >= 0 (0 = only at the end and on interruption)"))
    keep_checkpoints: int = field(default=2, metadata=help_of(
        "newest checkpoints kept, >= 1 (a SmolLM2 checkpoint with AdamW state is about 1.6 GB)"))
    eval_steps: int = field(default=50, metadata=help_of(
        "held-out evaluation every this many steps (0 = only before and after training, -1 = never)"))
    log_completions: bool = field(default=False, metadata=help_of(
        "write every sampled completion (prompt, completion or conversation, reward, advantage) of each step to "
        "RUN_DIR/completions.jsonl (TRL's log_completions)"))
    max_failed_steps: int = field(default=3, metadata=help_of(
        "stop the run with an error after this many consecutive steps skipped because the reward (or every item's "
        "environment) failed, >= 0 (0 = never stop); the last good step is checkpointed first"))

    def __post_init__(self):
        check("train.steps", self.steps >= 1, ">= 1", self.steps)
        check("train.save_steps", self.save_steps >= 0, ">= 0", self.save_steps)
        check("train.keep_checkpoints", self.keep_checkpoints >= 1, ">= 1", self.keep_checkpoints)
        check("train.eval_steps", self.eval_steps >= -1, ">= -1", self.eval_steps)
        check("train.max_failed_steps", self.max_failed_steps >= 0, ">= 0", self.max_failed_steps)


@dataclass
class ParallelConfig:
    """Data parallelism over the processes torchrun starts (engine/distributed.py, engine/sharding.py)."""

    strategy: ParallelStrategy = field(default="auto", metadata=help_of(
        "'fsdp2' (fully_shard per decoder layer, the rest replicated), 'ddp' (every parameter replicated), or "
        "'auto': fsdp2 when started by torchrun with more than one process, else one process. Gradients are reduced "
        "once per optimizer update; groups go to ranks by predicted cost. fsdp2 / ddp need torchrun's environment"))
    layout: ParallelLayout = field(default="auto", metadata=help_of(
        "how a step's trees go to the ranks (engine/sharding.py): 'auto' (the cost model's choice: whole trees, "
        "trees split by their branches, or a long shared prompt computed once across the ranks with its K/V "
        "all-gathered per layer, 'context-parallel'), or one of 'whole-or-split' and 'context-parallel' forced "
        "(context-parallel where a tree's prompt has a position per rank and the family is full attention, the "
        "other trees whole). Every layout gives the same gradient"))
    fsdp_mode: FsdpMode = field(default="auto", metadata=help_of(
        "FSDP2 during the step (engine/distributed.py): 'gather-once' (every layer all-gathered once per step, full "
        "parameters and gradients held through it, the gradient reduce-scattered once: fewest bytes moved), "
        "'resharded' (each layer gathered when a pack runs it and freed after, its gradient reduce-scattered per "
        "backward, the ranks' packs in lock-step: one layer's full parameters at a time), or 'auto': gather-once "
        "when 2 x the parameter bytes take at most a quarter of a rank's memory (its GPU's, or the machine's over "
        "the local ranks), else resharded. Both give the same gradient"))
    timeout_s: float = field(default=600.0, metadata=help_of(
        "seconds a collective waits for the other ranks before the run stops with an error, > 0 (a rank that dies "
        "stops the others within it, gloo at once, with an error naming the dead rank (rl/parallel.py's heartbeat); "
        "checkpoints are written atomically, so none is left half-written)"))

    def __post_init__(self):
        choice("parallel.strategy", self.strategy, ParallelStrategy)
        choice("parallel.layout", self.layout, ParallelLayout)
        choice("parallel.fsdp_mode", self.fsdp_mode, FsdpMode)
        check("parallel.timeout_s", self.timeout_s > 0, "> 0 seconds", self.timeout_s)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "sampling": SamplingConfig,
    "task": TaskConfig,
    "agent": AgentConfig,
    "grpo": GRPOConfig,
    "ppo": PPOConfig,
    "rloo": RLOOConfig,
    "reinforce_pp": ReinforcePPConfig,
    "dpo": DPOConfig,
    "engine": EngineConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
}

TRL_COMMAND_LINE = "_trl_names_from_the_command_line"  # apply_overrides -> from_dict, never in a file
RUN_DEFAULTS = {"engine": {"unknown_family": "self-check"}}
"""Defaults of a run that differ from the section's own (a library call of the engine refuses an unregistered family;
`train` checks it against the naive reference first)."""


ALGORITHM_DEFAULTS: dict[str, dict[str, dict]] = {
    "rloo": {"grpo": {"beta": 0.05, "num_generations": 2}},  # TRL 1.16 RLOOConfig (trl/trainer/rloo_config.py)
}
"""Defaults of an algorithm that differ from GRPO's, where TRL's trainer for it has other ones (a value in the
YAML file or on the command line wins)."""


def _section(name: str, values: dict | None = None, algorithm: str = "grpo"):
    """Section `name` built from `values` over the algorithm's defaults, `RUN_DEFAULTS` and the dataclass ones."""
    defaults = {**RUN_DEFAULTS.get(name, {}), **ALGORITHM_DEFAULTS.get(algorithm, {}).get(name, {})}
    return SECTIONS[name](**{**defaults, **(values or {})})


@dataclass
class Config:
    """The whole run configuration. Raises ValueError when sections disagree (the message names both fields).

    An algorithm's TRL defaults (`ALGORITHM_DEFAULTS`) apply when a config is read (`from_dict`, `from_yaml`, the
    command line); `Config(algorithm="rloo")` built in Python keeps the sections it is given."""

    algorithm: Algorithm = "grpo"
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    rloo: RLOOConfig = field(default_factory=RLOOConfig)
    reinforce_pp: ReinforcePPConfig = field(default_factory=ReinforcePPConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    engine: EngineConfig = field(default_factory=lambda: _section("engine"))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        choice("algorithm", self.algorithm, Algorithm)
        if self.algorithm == "dpo" and not self.dpo.dataset:
            raise ValueError("algorithm=dpo trains on preference pairs: set dpo.dataset to a JSONL / Parquet file "
                             "(scripts/make_preference_set.py writes one from the default task)")
        if self.sampling.backend == "vllm":
            self._check_vllm()
        if self.engine.method != "branchreplay":
            self._check_method()
        if self.agent.environment is not None:
            self._check_multi_turn()
        elif self.sampling.turn_branching:
            raise ValueError("sampling.turn_branching forks multi-turn trajectories: set agent.environment, or use "
                             "sampling.branching for a single-turn task")
        product = 1
        for _, factor in self.sampling.branching:
            product *= factor
        if self.sampling.branching and product != self.grpo.num_generations:
            raise ValueError(
                f"sampling.branching={[list(b) for b in self.sampling.branching]} makes {product} samples per prompt "
                f"but grpo.num_generations={self.grpo.num_generations}: make them equal")

    def _check_vllm(self) -> None:
        s = self.sampling
        refused = [(self.agent.environment is not None, "a multi-turn task (agent.environment)"),
                   (bool(s.branching), "sampling.branching (vLLM samples independent completions)"),
                   (self.algorithm == "dpo", "algorithm=dpo (nothing is sampled)"),
                   (self.model.lora_r > 0, "LoRA (model.lora_r; the merged weights are not synced yet)")]
        for is_refused, what in refused:
            if is_refused:
                raise ValueError(f"sampling.backend=vllm does not run {what} yet: use sampling.backend=hf")
        if s.vllm_importance_sampling_cap is not None and (
                self.algorithm != "grpo" or self.grpo.importance_sampling_level == "sequence"):
            raise ValueError("sampling.vllm_importance_sampling_cap scales GRPO's token-level advantages; with "
                             f"algorithm={self.algorithm} (its own advantages) or GSPO's sequence-level loss it is not "
                             "run yet: set it to null")

    def _check_method(self) -> None:
        """The references of `engine.method` (rl/methods.py) run token-level losses of whole rollouts."""
        method = self.engine.method
        refused = [(self.algorithm in ("rloo", "dpo"), f"algorithm={self.algorithm} (a sequence-level loss)"),
                   (self.grpo.importance_sampling_level == "sequence", "GSPO (grpo.importance_sampling_level="
                                                                       "sequence, a sequence-level loss)"),
                   (method == "padded" and self.algorithm == "ppo", "algorithm=ppo (its critic has no padded "
                                                                   "batch; engine.method=naive runs it)")]
        for is_refused, what in refused:
            if is_refused:
                raise ValueError(f"engine.method={method} does not run {what}: use engine.method=branchreplay")

    def _check_multi_turn(self) -> None:
        if self.algorithm == "dpo":
            raise ValueError("algorithm=dpo trains on preference pairs, not on an environment: unset agent.environment")
        if self.sampling.branching:
            raise ValueError("with agent.environment, forks inside a turn are sampling.turn_branching schedules, e.g. "
                             "[[[0, 2], [16, 2]], 2]; unset sampling.branching")
        product = 1
        for entry in self.sampling.turn_branching:
            product *= turn_factor(entry)
        if self.sampling.turn_branching and product != self.grpo.num_generations:
            raise ValueError(
                f"sampling.turn_branching={_plain(self.sampling.turn_branching)} makes up to {product} trajectories "
                f"per item but grpo.num_generations={self.grpo.num_generations}: make them equal")
        if len(self.sampling.turn_branching) > self.agent.max_turns:
            raise ValueError(f"sampling.turn_branching has {len(self.sampling.turn_branching)} turns but "
                             f"agent.max_turns={self.agent.max_turns}: the later forks would never happen; shorten "
                             "it or raise agent.max_turns")
        limit = self.agent.max_context_tokens
        if limit is not None and limit <= self.sampling.max_new_tokens:
            raise ValueError(f"agent.max_context_tokens={limit} leaves no room for a reply of "
                             f"sampling.max_new_tokens={self.sampling.max_new_tokens} after any prompt: raise it")

    @classmethod
    def from_dict(cls, data: dict | None) -> Config:
        """Build from {"algorithm": name, section: {field: value}}; values are coerced to the field types. Raises
        ValueError for an unknown section or key (listing the valid ones) or a value of the wrong type (naming the
        field)."""
        data = data or {}
        if not isinstance(data, dict):
            raise ValueError(f"a config must be a mapping of sections, got {type(data).__name__}")
        data = dict(data)
        algorithm = data.get("algorithm", "grpo")
        choice("algorithm", algorithm, Algorithm)
        generations = ALGORITHM_DEFAULTS.get(algorithm, {}).get("grpo", {}).get(
            "num_generations", GRPOConfig.num_generations)
        # TRL's flat GRPOConfig names, moved into their sections (the command line's win)
        data = from_trl_names(data, SECTIONS, data.pop(TRL_COMMAND_LINE, None), generations)
        data.pop("algorithm", None)
        for name in data:
            if name not in SECTIONS:
                raise ValueError(f"unknown config section '{name}'; valid sections: {', '.join(SECTIONS)} (and "
                                 "the top-level 'algorithm')")
        sections = {}
        for name, section_cls in SECTIONS.items():
            values = data.get(name) or {}
            if not isinstance(values, dict):
                raise ValueError(f"config section '{name}' must be a mapping, got {values!r}")
            hints, known = _field_types(section_cls), [f.name for f in dataclasses.fields(section_cls)]
            for key in values:
                if key not in hints:
                    raise ValueError(f"unknown key '{name}.{key}'{nearest(key, known)}; valid keys of '{name}': "
                                     f"{', '.join(known)}")
            sections[name] = _section(name, {k: _coerce(v, hints[k], f"{name}.{k}") for k, v in values.items()},
                                      algorithm)
        return cls(algorithm=algorithm, **sections)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> Config:
        """Load a YAML file, then apply `--section.field value` overrides (see `apply_overrides`)."""
        with open(path) as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                where = getattr(e, "problem_mark", None)
                at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
                raise ValueError(f"config file {path} is not valid YAML{at}: "
                                 f"{getattr(e, 'problem', None) or e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping of sections (model:, grpo:, ...), not a "
                             f"{type(data).__name__}")
        return cls.from_dict(apply_overrides(data, overrides or []))

    def to_dict(self) -> dict:
        """{"algorithm": name, section: {field: value}} with YAML-friendly values (tuples become lists)."""
        return _plain(dataclasses.asdict(self))

    def save(self, path: str | Path) -> None:
        """Write the resolved config as YAML (what `from_yaml` reads back to an equal Config)."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `--section.field value` / `--section.field=value` (and `--algorithm NAME`) arguments to {section:
    {field: value}} (a copy).

    Raises ValueError for an argument that is not of that form, a missing value, or an unknown section or key."""
    for k, v in data.items():
        if k in SECTIONS and v is not None and not isinstance(v, dict):
            raise ValueError(f"config section '{k}' must be a mapping, got {v!r}")
    data = {k: dict(v or {}) if k in SECTIONS else v for k, v in data.items()}  # others: algorithm, TRL names
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if arg.split("=", 1)[0] == "--algorithm":
            key, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(overrides):
                    raise ValueError("--algorithm needs a value")
                value, i = overrides[i + 1], i + 1
            data["algorithm"] = value
            i += 1
            continue
        flat = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if flat in TRL_NAMES:  # TRL's flat name, e.g. --learning_rate 1e-5 (from_dict maps it; it wins)
            key, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(overrides):
                    raise ValueError(f"--{key} needs a value")
                value, i = overrides[i + 1], i + 1
            data.setdefault(TRL_COMMAND_LINE, {})[key] = yaml.safe_load(value)
            i += 1
            continue
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ValueError(f"unexpected argument '{arg}': overrides look like --section.field=value "
                             f"(sections: {', '.join(SECTIONS)})")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(overrides):
                raise ValueError(f"--{key} needs a value")
            value, i = overrides[i + 1], i + 1
        section, _, name = key.partition(".")
        if section not in SECTIONS:
            raise ValueError(f"unknown config section '{section}' in --{key}; valid sections: {', '.join(SECTIONS)}")
        hints = _field_types(SECTIONS[section])
        if name not in hints:
            raise ValueError(f"unknown key '{key}'{nearest(name, list(hints))}; valid keys of '{section}': "
                             f"{', '.join(hints)}")
        data.setdefault(section, {})[name] = _parse_cli(value, hints[name])
        i += 1
    return data


def help_text() -> str:
    """One line per field: `--section.field  (type, default) help`, for the command's --help (the help is the
    field's metadata, `fields.help_of`)."""
    lines = [f"--algorithm  ({_kind(Algorithm)}, default 'grpo')  what the advantages and the loss are: GRPO's group "
             "baseline, PPO's critic and GAE, RLOO's leave-one-out baseline, REINFORCE++'s global normalisation, "
             "DPO on preference pairs"]
    for section, cls in SECTIONS.items():
        hints = _field_types(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            default = RUN_DEFAULTS.get(section, {}).get(f.name, default)
            lines.append(f"--{section}.{f.name}  ({_kind(hints[f.name])}, default {_plain(default)!r})  "
                         f"{f.metadata.get('help', '')}")
    lines.append("TRL's flat GRPOConfig names are accepted too, in a YAML file or as --name VALUE (rl/trl_names.py):")
    return "\n".join(lines + help_lines())


def parse_args(argv: list[str], options: tuple[str, ...] = ("--config", "--resume")) -> tuple[Config, dict]:
    """`[--config FILE] [--resume RUN_DIR | --checkpoint DIR] [--section.field VALUE ...]` -> (config, {option:
    value or None} for each of `options`), the one parser of `train` (--config, --resume) and `eval` (--config,
    --checkpoint). Options take `--name value` or `--name=value`.

    With --resume and no --config, the run's own config.yaml is the base; train.output_dir becomes RUN_DIR. With
    --checkpoint and no --config, the config.yaml of the run holding it (`run_config`), when there is one.
    Raises ValueError for a bad argument (see `apply_overrides`), FileNotFoundError for a missing file."""
    named, overrides, i = dict.fromkeys(options), [], 0
    while i < len(argv):
        key, eq, value = argv[i].partition("=")
        if key in named:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{key} needs a value")
                value, i = argv[i + 1], i + 1
            named[key] = value
        else:
            overrides.append(argv[i])
        i += 1
    resume, path = named.get("--resume"), named.get("--config")
    if resume is not None and path is None:
        path = Path(resume) / "config.yaml"
    checkpoint = named.get("--checkpoint")
    if checkpoint is not None and path is None:  # eval of a run: its own config, unless --config is given
        path = run_config(checkpoint)
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    if resume is not None and path == Path(resume) / "config.yaml":
        overrides = _keep_objective(path, overrides)
    config = Config.from_yaml(path, overrides) if path else Config.from_dict(apply_overrides({}, overrides))
    if resume is not None:
        config.train.output_dir = str(resume)
    return config, named


def run_config(checkpoint: str | Path) -> Path | None:
    """The config.yaml of the run that holds `checkpoint` (a run folder, or one of its checkpoints/step-N folders),
    or None when there is none (a folder from elsewhere)."""
    folder = Path(checkpoint)
    candidates = [folder] + ([folder.parent.parent] if folder.parent.name == "checkpoints" else [])
    for candidate in candidates:
        if (candidate / "config.yaml").is_file():
            return candidate / "config.yaml"
    return None


def _keep_objective(path: Path, overrides: list[str]) -> list[str]:
    """A resumed run whose config.yaml predates grpo.use_bias_correction_kl (added with TRL 1.16's default, true)
    keeps the plain k3 KL it was trained with, with a warning, unless the command line sets it."""
    saved = (yaml.safe_load(Path(path).read_text()) or {}).get("grpo") or {}
    named = any(arg.split("=", 1)[0] == "--grpo.use_bias_correction_kl" for arg in overrides)
    if "use_bias_correction_kl" in saved or named or not saved.get("beta"):
        return overrides
    warnings.warn(f"{path} predates grpo.use_bias_correction_kl: resuming with false, the plain k3 KL this run "
                  "was trained with (pass --grpo.use_bias_correction_kl true to switch to TRL's default)",
                  stacklevel=3)
    return [*overrides, "--grpo.use_bias_correction_kl=false"]


# -- helpers ------------------------------------------------------------------------------------------------------

def _field_types(cls: type) -> dict[str, type]:
    return typing.get_type_hints(cls)


def _kind(tp) -> str:
    """A field type for people: `int`, `float | None`, `one of 'keep', 'replay', 'auto'`."""
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(v) for v in accepted(tp))
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _parse_cli(text: str, tp) -> object:
    """A command-line string for a field of type `tp`: strings stay strings, everything else is read as YAML."""
    if tp is str:
        return text
    return yaml.safe_load(text)


def _coerce(value, tp, name: str):
    """`value` as type `tp` (int, float, bool, str, X | None, tuple/list/dict); ValueError naming the field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        choice(name, value, tp)
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _coerce(value, tp, name)
    try:
        if tp is bool:
            if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
                return value.lower() in ("true", "yes", "1")
            if isinstance(value, bool):
                return value
        elif tp is int and not isinstance(value, bool):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        elif tp is float and not isinstance(value, bool):
            return float(value)  # also "1e-6", which YAML 1.1 reads as a string
        elif tp is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        elif (origin or tp) in (tuple, list) and isinstance(value, (list, tuple)):
            return value  # the section's __post_init__ normalises and checks the items
        elif (origin or tp) is dict and isinstance(value, dict):
            return value
    except (TypeError, ValueError):
        pass
    kind = getattr(tp, "__name__", str(tp))
    raise ValueError(f"{name}={value!r} is not a valid {kind}")


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x
