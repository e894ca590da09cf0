"""TRL's flat `GRPOConfig` names in a config file or on the command line, mapped onto our sections.

A TRL user's YAML is one flat mapping (`learning_rate: 1e-6`, `num_generations: 8`, `max_completion_length: 256`,
`max_steps: 500`, ...). `from_trl_names` moves each known TRL name to the field that means the same here
(`TRL_NAMES`; `branchreplay train --help` lists them), converting the values TRL spells differently (listed in its
docstring). TRL counts `max_steps`, `save_steps` and `eval_steps` in optimizer steps; ours count sampling rounds of
grpo.num_iterations updates each, so they are divided by num_iterations. Command-line TRL names (`--learning_rate
1e-6`) win over the file. Fields that change nothing computed here (logging, vLLM, hub: `NO_EFFECT`) are dropped
with one warning; any other TRL field is an error, since ignoring it would change the run silently. A name that is
neither is an error that suggests the nearest known key.
"""

from __future__ import annotations

import dataclasses
import warnings

from ...fields import nearest
from .trl_fields import TRL_GRPO_FIELDS

TRL_NAMES: dict[str, str] = {
    "model_name_or_path": "model.spec",
    "learning_rate": "grpo.learning_rate",
    "num_generations": "grpo.num_generations",
    "beta": "grpo.beta",
    "epsilon": "grpo.epsilon",
    "epsilon_high": "grpo.epsilon_high",
    "delta": "grpo.delta",
    "loss_type": "grpo.loss_type",
    "scale_rewards": "grpo.scale_rewards",
    "num_iterations": "grpo.num_iterations",
    "max_staleness": "grpo.max_staleness",  # AsyncGRPOConfig's (TRL 1.16 trl.experimental.async_grpo)
    "mask_truncated_completions": "grpo.mask_truncated_completions",
    "importance_sampling_level": "grpo.importance_sampling_level",
    "top_entropy_quantile": "grpo.top_entropy_quantile",
    "entropy_coef": "grpo.entropy_coef",
    "use_bias_correction_kl": "grpo.use_bias_correction_kl",
    "sapo_temperature_pos": "grpo.sapo_temperature_pos",
    "sapo_temperature_neg": "grpo.sapo_temperature_neg",
    "weight_decay": "grpo.weight_decay",
    "max_grad_norm": "grpo.max_grad_norm",
    "warmup_steps": "grpo.warmup_steps",
    "lr_scheduler_type": "grpo.lr_scheduler",
    "max_completion_length": "sampling.max_new_tokens",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "reward_weights": "task.reward_weights",
    "max_steps": "train.steps",
    "seed": "train.seed",
    "output_dir": "train.output_dir",
    "save_steps": "train.save_steps",
    "save_total_limit": "train.keep_checkpoints",
    "eval_steps": "train.eval_steps",
    "log_completions": "train.log_completions",
    "report_to": "train.report_to",
    "bf16": "model.dtype",
    "per_device_train_batch_size": "grpo.prompts_per_step",
    "gradient_accumulation_steps": "grpo.prompts_per_step",
    "use_peft": "model.lora_r",
    "lora_r": "model.lora_r",
    "lora_alpha": "model.lora_alpha",
    "lora_target_modules": "model.lora_target_modules",
    "lora_dropout": "(0 only)",
}
BATCH_NAMES = ("per_device_train_batch_size", "gradient_accumulation_steps")  # together: grpo.prompts_per_step
PEFT_NAMES = ("use_peft", "lora_r", "lora_alpha", "lora_target_modules", "lora_dropout")  # together: model.lora_*
TRL_LORA_R = 16  # TRL ModelConfig's lora_r default, when use_peft is true
SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant"}
UPDATE_COUNTS = ("max_steps", "save_steps", "eval_steps", "max_staleness")  # TRL counts optimizer steps; ours rounds
NO_EFFECT = {
    "logging_steps", "logging_first_step", "logging_dir", "logging_strategy", "run_name", "log_level",
    "disable_tqdm", "gradient_checkpointing", "gradient_checkpointing_kwargs", "use_vllm", "vllm_mode",
    "vllm_gpu_memory_utilization", "vllm_server_host", "vllm_server_port", "save_strategy", "eval_strategy",
    "push_to_hub", "hub_model_id", "dataloader_num_workers", "remove_unused_columns", "save_only_model",
    "num_completions_to_print", "wandb_log_unique_prompts", "overwrite_output_dir", "ddp_find_unused_parameters",
    "per_device_eval_batch_size", "bf16_full_eval", "seed_data", "data_seed", "log_on_each_node",
}
"""TRL / TrainingArguments fields that change nothing a run computes here (logging, vLLM, hub, dataloader): dropped
with one warning. Any other TRL field we do not map (warmup_ratio, num_train_epochs, steps_per_generation,
min_p, repetition_penalty, ...) would change the run, so it is an error, never silently ignored."""


def from_trl_names(data: dict, sections: dict[str, type], overrides: dict | None = None,
                   default_generations: int = 8) -> dict:
    """`data` ({section: {...}, and maybe flat TRL names}) with every TRL name moved into its section (`TRL_NAMES`,
    module docstring). `overrides`: TRL names from the command line, which win over the file's values;
    `default_generations`: grpo.num_generations when neither gives it (the algorithm's default).

    The values TRL spells differently are converted:

        per_device_train_batch_size x gradient_accumulation_steps   completions per step (TRL's generation batch,
                                                                    one process) -> grpo.prompts_per_step = that /
                                                                    num_generations, which must divide it (as TRL
                                                                    checks)
        scale_rewards: true / false                                 "group" / "none" (TRL's booleans)
        report_to: [tensorboard, wandb]                             "tensorboard,wandb" (a list as a comma list)
        top_k: null                                                 0 (off)
        lr_scheduler_type                                           cosine, linear, constant (constant_with_warmup
                                                                    too)
        bf16: true                                                  model.dtype bfloat16 (mixed precision)
        use_peft, lora_r, lora_alpha, lora_target_modules           TRL's ModelConfig: model.lora_* when use_peft
                                                                    is true (lora_r then defaults to TRL's 16;
                                                                    without use_peft they are an error), LoRA off
                                                                    when it is false; lora_dropout only 0

    Raises ValueError: a TRL name and its section's field both in the file with different values, a TRL field we do
    not support (naming it), a value TRL allows but we do not, a batch size that num_generations does not divide, a
    step count that num_iterations does not divide, or an unknown top-level key (with the nearest known one)."""
    flat = {k: v for k, v in data.items() if k not in sections and k != "algorithm"}
    overrides = dict(overrides or {})
    if not flat and not overrides:
        return data
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items() if k not in flat}
    ignored = []
    for key, value in flat.items():
        if key in TRL_NAMES:
            continue
        if isinstance(value, dict):  # a mapping: a misspelt or unknown section
            raise ValueError(f"unknown config section '{key}'{nearest(key, list(sections))}; valid sections: "
                             f"{', '.join(sections)} (and the top-level 'algorithm')")
        if key in NO_EFFECT:
            ignored.append(key)
            continue
        if key in TRL_GRPO_FIELDS:
            raise ValueError(f"TRL's {key} is not supported here (it would change the run); remove it, or see "
                             "--help for the TRL names that are")
        raise ValueError(_unknown(key, sections))
    given = {k: v for k, v in flat.items() if k in TRL_NAMES}
    named = {**given, **overrides}  # the command line's win
    iterations = _int("num_iterations", named.get("num_iterations", out.get("grpo", {}).get("num_iterations", 1)))
    for key, value in [*given.items(), *overrides.items()]:  # the file's first: its own disagreements are errors
        if key in BATCH_NAMES or key in PEFT_NAMES:
            continue  # together, below
        section, name = TRL_NAMES[key].split(".")
        value = _convert(key, value, iterations)
        if value is None and key == "bf16":
            continue
        target = out.setdefault(section, {})
        if key not in overrides and name in target and not _same(target[name], value):
            raise ValueError(f"{key}={value!r} (TRL's name) and {section}.{name}={target[name]!r} disagree: keep one")
        target[name] = value
    if any(k in named for k in BATCH_NAMES):
        completions = (_int("per_device_train_batch_size", named.get("per_device_train_batch_size", 8))
                       * _int("gradient_accumulation_steps", named.get("gradient_accumulation_steps", 1)))
        g = _int("num_generations", out.get("grpo", {}).get("num_generations", default_generations))
        if completions % g:
            raise ValueError(f"per_device_train_batch_size x gradient_accumulation_steps = {completions} completions "
                             f"per step is not divisible by num_generations={g} (TRL requires it too)")
        grpo = out.setdefault("grpo", {})
        if "prompts_per_step" in grpo and not _same(grpo["prompts_per_step"], completions // g):
            raise ValueError(f"per_device_train_batch_size x gradient_accumulation_steps make {completions // g} "
                             f"prompts per step but grpo.prompts_per_step={grpo['prompts_per_step']}: keep one")
        grpo["prompts_per_step"] = completions // g
    if any(k in named for k in PEFT_NAMES):
        _peft(named, out.setdefault("model", {}))
    if ignored:
        warnings.warn(f"TRL fields with no effect here, ignored: {', '.join(ignored)}", stacklevel=3)
    return out


def _peft(named: dict, model: dict) -> None:
    """TRL's ModelConfig LoRA names into model.lora_* (`from_trl_names`); a value the model section also sets
    differently is an error, as for every other TRL name."""
    dropout = named.get("lora_dropout", 0)
    if not _same(dropout, 0):
        raise ValueError(f"lora_dropout={dropout!r}: LoRA runs without dropout here (dropout would break the "
                         "equality with the per-rollout gradient); set lora_dropout: 0")
    if "use_peft" not in named:
        raise ValueError("TRL's lora_* settings without use_peft: true leave LoRA off in TRL; add use_peft: true, or "
                         "remove them")
    use_peft = _bool("use_peft", named["use_peft"])
    values = {"lora_r": 0} if not use_peft else {"lora_r": _int("lora_r", named.get("lora_r", model.get(
        "lora_r", TRL_LORA_R)))}
    if use_peft and "lora_alpha" in named:
        values["lora_alpha"] = named["lora_alpha"]
    targets = named.get("lora_target_modules")
    if use_peft and targets is not None:
        values["lora_target_modules"] = ",".join(targets) if isinstance(targets, (list, tuple)) else targets
    for name, value in values.items():
        if name in model and not _same(model[name], value):
            raise ValueError(f"TRL's LoRA settings give {name}={value!r} but model.{name}={model[name]!r}: keep one")
        model[name] = value


def _bool(key: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1"):
        return True
    if str(value).lower() in ("false", "0"):
        return False
    raise ValueError(f"{key}={value!r} is not true or false")


def help_lines() -> list[str]:
    """One line per TRL name: `--name  (TRL) -> section.field`, for --help."""
    return [f"--{name}  (TRL {'ModelConfig' if name in PEFT_NAMES else 'GRPOConfig'}) -> {target}"
            for name, target in TRL_NAMES.items()]


def _convert(key: str, value, iterations: int = 1):
    if key == "scale_rewards" and isinstance(value, bool):
        return "group" if value else "none"
    if key == "top_k" and value is None:
        return 0
    if key == "report_to" and isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "none"
    if key == "lr_scheduler_type":
        if value not in SCHEDULERS:
            raise ValueError(f"lr_scheduler_type={value!r} is not supported here; use one of {', '.join(SCHEDULERS)}")
        return SCHEDULERS[value]
    if key == "bf16":
        return "bfloat16" if value in (True, "true", "True", 1) else None
    if key in UPDATE_COUNTS:  # TRL's optimizer steps -> our sampling rounds of num_iterations updates each
        steps = _int(key, value)
        if steps % iterations:
            raise ValueError(f"{key}={steps} optimizer steps is not a whole number of sampling rounds of "
                             f"num_iterations={iterations} updates: make it a multiple")
        return steps // iterations
    return value


def _int(key: str, value) -> int:
    try:
        if isinstance(value, bool) or float(value) != int(float(value)):
            raise ValueError
        return int(float(value))
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r} is not a whole number") from None


def _same(a, b) -> bool:
    """Equal values, numbers compared as numbers (YAML reads 1e-6 as a string)."""
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return a == b


def _unknown(key: str, sections: dict[str, type]) -> str:
    known = list(sections) + list(TRL_NAMES) + [f"{s}.{f.name}" for s, cls in sections.items()
                                                for f in dataclasses.fields(cls)]
    return (f"unknown config key '{key}'{nearest(key, known)}; a top-level key is a section ({', '.join(sections)}) "
            "or a TRL GRPOConfig name (listed by --help)")
