"""The run configuration's sections: one dataclass per concern, each field's help in its metadata (`fields.help_of`).

    model:    ModelConfig      which causal LM, in which dtype, on which device, LoRA
    grpo:     GRPOConfig       sampling counts, clip range and optimizer of every algorithm (TRL GRPOConfig names)
    ppo:      PPOConfig        the critic, GAE and the value loss (algorithm: ppo; TRL PPOConfig names)
    rloo:     RLOOConfig       RLOO's options (algorithm: rloo; TRL RLOOConfig names)
    reinforce_pp: ReinforcePPConfig  REINFORCE++'s options (algorithm: reinforce_pp; verl's names)
    dpo:      DPOConfig        the preference file and the DPO loss (algorithm: dpo; TRL DPOConfig names)
    train:    TrainConfig      steps, seed, run folder, checkpoint and eval cadence, how gradients are computed
    parallel: ParallelConfig   data parallelism over torchrun's processes (FSDP2 or DDP semantics)
and, from their own modules, sampling (decode/config.py), task (task.py), agent (agent.py) and engine
(engine/config.py). `SECTIONS` maps each section's name to its class. Torch-free.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal

from ...decode.config import SamplingConfig
from ...engine.config import EngineConfig
from ...fields import check, choice, help_of
from ...loss_types import DPOLossType, LossType
from .agent import AgentConfig
from .task import TaskConfig

DType = Literal["float32", "bfloat16", "float16", "float64"]
ScaleRewards = Literal["group", "batch", "none"]
LRScheduler = Literal["cosine", "linear", "constant"]
ParallelStrategy = Literal["auto", "fsdp2", "ddp"]
ParallelLayout = Literal["auto", "whole-or-split", "context-parallel"]  # engine.parallel.sharding.LAYOUTS
FsdpMode = Literal["auto", "gather-once", "resharded"]  # engine.parallel.distributed.FsdpMode
ImportanceSamplingLevel = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k3"]
Method = Literal["branchreplay", "naive", "padded"]
UnknownFamily = Literal["refuse", "self-check"]


@dataclass
class ModelConfig:
    """The policy model (the reference model for the KL penalty is a frozen copy of its initial weights)."""

    spec: str = field(default="smollm2", metadata=help_of(
        "the model: 'smollm2' (default, SmolLM2-135M-Instruct), a save_pretrained folder with its tokenizer, a "
        ".gguf file or a hub id 'org/name'"))
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
    max_staleness: int = field(default=0, metadata=help_of(
        "rollouts ahead: how many sampling rounds the weights that drew a step's batch may lag the weights that "
        "train it, >= 0 (TRL's max_staleness, counted in rounds as train.steps is); 0 = sample then train, as "
        "always; >= 1 = the next steps' batches are drawn in a sampler process while this step trains, and the "
        "sampler's logprobs are the old ones (rl/rollouts/ahead.py)"))
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
        check("grpo.max_staleness", self.max_staleness >= 0, ">= 0", self.max_staleness)
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


REPORT_TARGETS = ("tensorboard", "wandb")
"""What train.report_to may name (and 'all', 'none')."""


def report_targets(report_to: str) -> list[str]:
    """The loggers of a train.report_to comma list: 'all' is every one of `REPORT_TARGETS` ('wandb' only when it
    is installed), 'none' none."""
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    if "all" in names:
        return ["tensorboard"] + (["wandb"] if importlib.util.find_spec("wandb") is not None else [])
    return [n for n in names if n != "none"]


@dataclass
class TrainConfig:
    """The run: how long, where it is written, how often it is saved and evaluated, how its gradients are computed
    and what it does with a model family outside the engine's registry."""

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
    method: Method = field(default="branchreplay", metadata=help_of(
        "how the logprobs and gradients are computed, all equal to floating-point tolerance: 'branchreplay' (the "
        "execution stack over the prefix tree), 'naive' (each rollout alone, unpadded: the reference) or 'padded' "
        "(TRL's padded batch); the two references run GRPO / REINFORCE++ / PPO token losses, for side by side runs "
        "(scripts/compare_methods.py; rl/policy.py)"))
    unknown_family: UnknownFamily = field(default="self-check", metadata=help_of(
        "a model family outside the engine's registry (engine/families.py): 'self-check' it before the first step "
        "(engine/self_check.py: the engine against the naive reference on a small random tree of the model itself, "
        "refused when its error is above the dtype's bound; the verdict is cached in the run folder) or "
        "'refuse' it. Recurrent or hybrid layers of an unknown family are always refused. A direct "
        "replay_backward call refuses an unknown family unless force=True (the package's: check, then run)"))
    report_to: str = field(default="tensorboard", metadata=help_of(
        "where metrics.jsonl is mirrored, a comma list (TRL's report_to): 'tensorboard' (RUN_DIR/tb, when "
        "tensorboard is installed), 'wandb' (Weights & Biases: project $WANDB_PROJECT or 'branchreplay', the run "
        "named after its folder and resumed with it; WANDB_MODE=offline works without a network), 'all' or 'none'"))
    max_failed_steps: int = field(default=3, metadata=help_of(
        "stop the run with an error after this many consecutive steps skipped because the reward (or every item's "
        "environment) failed, and fail a run whose every step was skipped, >= 0 (0 = never stop); the last good "
        "step is checkpointed first. A reward's traceback goes to RUN_DIR/errors.log"))

    def __post_init__(self):
        check("train.steps", self.steps >= 1, ">= 1", self.steps)
        check("train.save_steps", self.save_steps >= 0, ">= 0", self.save_steps)
        check("train.keep_checkpoints", self.keep_checkpoints >= 1, ">= 1", self.keep_checkpoints)
        check("train.eval_steps", self.eval_steps >= -1, ">= -1", self.eval_steps)
        check("train.max_failed_steps", self.max_failed_steps >= 0, ">= 0", self.max_failed_steps)
        choice("train.method", self.method, Method)
        choice("train.unknown_family", self.unknown_family, UnknownFamily)
        unknown = {n.strip() for n in self.report_to.split(",") if n.strip()} - {*REPORT_TARGETS, "all", "none"}
        if unknown or not self.report_to.strip():
            raise ValueError(f"train.report_to={self.report_to!r}: accepted values are a comma list of "
                             f"{', '.join(REPORT_TARGETS)}, or 'all' or 'none'")
        if "wandb" in report_targets(self.report_to) and importlib.util.find_spec("wandb") is None:
            raise ValueError("train.report_to asks for wandb, which is not installed: pip install wandb, or drop it "
                             "from train.report_to")


@dataclass
class ParallelConfig:
    """Data parallelism over the processes torchrun starts (engine/parallel/: distributed.py, sharding.py)."""

    strategy: ParallelStrategy = field(default="auto", metadata=help_of(
        "'fsdp2' (fully_shard per decoder layer, the rest replicated), 'ddp' (every parameter replicated), or "
        "'auto': fsdp2 when started by torchrun with more than one process, else one process. Gradients are reduced "
        "once per optimizer update; groups go to ranks by predicted cost. fsdp2 / ddp need torchrun's environment"))
    layout: ParallelLayout = field(default="auto", metadata=help_of(
        "how a step's trees go to the ranks (engine/parallel/sharding.py): 'auto' (the cost model's choice: whole "
        "trees, trees split by their branches, or a long shared prompt computed once across the ranks with its K/V "
        "all-gathered per layer, 'context-parallel'), or one of 'whole-or-split' and 'context-parallel' forced "
        "(context-parallel where a tree's prompt has a position per rank and the family is full attention, the "
        "other trees whole). Every layout gives the same gradient"))
    fsdp_mode: FsdpMode = field(default="auto", metadata=help_of(
        "FSDP2 during the step (engine/parallel/distributed.py): 'gather-once' (every layer all-gathered once per "
        "step, full parameters and gradients held through it, the gradient reduce-scattered once: fewest bytes moved), "
        "'resharded' (each layer gathered when a pack runs it and freed after, its gradient reduce-scattered per "
        "backward, the ranks' packs in lock-step: one layer's full parameters at a time), or 'auto': gather-once "
        "when 2 x the parameter bytes take at most a quarter of a rank's memory (its GPU's, or the machine's over "
        "the local ranks), else resharded. Both give the same gradient"))
    timeout_s: float = field(default=600.0, metadata=help_of(
        "seconds a collective waits for the other ranks before the run stops with an error, > 0 (a rank that dies "
        "stops the others within it, gloo at once, with an error naming the dead rank (rl/run/parallel.py's "
        "heartbeat); checkpoints are written atomically, so none is left half-written)"))

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
