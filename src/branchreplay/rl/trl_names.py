"""TRL's flat `GRPOConfig` names in a config file or on the command line, mapped onto our sections.

A TRL user's YAML is one flat mapping (`learning_rate: 1e-6`, `num_generations: 8`, `max_completion_length: 256`,
`max_steps: 500`, ...). `from_trl_names` moves each known TRL name to the field that means the same here
(`TRL_NAMES`; `branchreplay train --help` lists them), converting the values TRL spells differently:

    per_device_train_batch_size x gradient_accumulation_steps   completions per step (TRL's generation batch, one
                                                                process) -> grpo.prompts_per_step = that /
                                                                num_generations, which must divide it (as TRL checks)
    scale_rewards: true / false                                 "group" / "none" (TRL's booleans)
    top_k: null                                                 0 (off)
    lr_scheduler_type                                           cosine, linear, constant (constant_with_warmup too)
    bf16: true                                                  model.dtype bfloat16 (mixed precision)

Other GRPOConfig fields (logging_steps, report_to, use_vllm, ...) have no effect here: they are dropped with one
warning that names them. A name that is neither is an error that suggests the nearest known key.
"""

from __future__ import annotations

import dataclasses
import warnings

from ..fields import nearest

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
    "mask_truncated_completions": "grpo.mask_truncated_completions",
    "importance_sampling_level": "grpo.importance_sampling_level",
    "top_entropy_quantile": "grpo.top_entropy_quantile",
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
    "bf16": "model.dtype",
    "per_device_train_batch_size": "grpo.prompts_per_step",
    "gradient_accumulation_steps": "grpo.prompts_per_step",
}
SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant"}


def from_trl_names(data: dict, sections: dict[str, type]) -> dict:
    """`data` ({section: {...}, and maybe flat TRL names}) with every TRL name moved into its section (module
    docstring). Raises ValueError: a TRL name and its section's field both given, a value TRL allows but we do not
    (naming it), a batch size that num_generations does not divide, or an unknown top-level key (with the nearest
    known one)."""
    flat = {k: v for k, v in data.items() if k not in sections and k != "algorithm"}
    if not flat:
        return data
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items() if k not in flat}
    ignored = []
    for key, value in flat.items():
        if key not in TRL_NAMES:
            if isinstance(value, dict):  # a mapping: a misspelt or unknown section
                raise ValueError(f"unknown config section '{key}'{nearest(key, list(sections))}; valid sections: "
                                 f"{', '.join(sections)} (and the top-level 'algorithm')")
            if key in _trl_fields():
                ignored.append(key)
                continue
            raise ValueError(_unknown(key, sections))
        if key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            continue  # together, below
        section, name = TRL_NAMES[key].split(".")
        value = _convert(key, value)
        if value is None and key == "bf16":
            continue
        target = out.setdefault(section, {})
        if name in target and target[name] != value:
            raise ValueError(f"{key}={value!r} (TRL's name) and {section}.{name}={target[name]!r} disagree: keep one")
        target[name] = value
    if "per_device_train_batch_size" in flat or "gradient_accumulation_steps" in flat:
        completions = int(flat.get("per_device_train_batch_size", 8)) * int(flat.get("gradient_accumulation_steps", 1))
        g = int(out.get("grpo", {}).get("num_generations", 8))
        if completions % g:
            raise ValueError(f"per_device_train_batch_size x gradient_accumulation_steps = {completions} completions "
                             f"per step is not divisible by num_generations={g} (TRL requires it too)")
        out.setdefault("grpo", {})["prompts_per_step"] = completions // g
    if ignored:
        warnings.warn(f"TRL GRPOConfig fields with no effect here, ignored: {', '.join(ignored)}", stacklevel=3)
    return out


def help_lines() -> list[str]:
    """One line per TRL name: `--name  (TRL) -> section.field`, for --help."""
    return [f"--{name}  (TRL GRPOConfig) -> {target}" for name, target in TRL_NAMES.items()]


def _convert(key: str, value):
    if key == "scale_rewards" and isinstance(value, bool):
        return "group" if value else "none"
    if key == "top_k" and value is None:
        return 0
    if key == "lr_scheduler_type":
        if value not in SCHEDULERS:
            raise ValueError(f"lr_scheduler_type={value!r} is not supported here; use one of {', '.join(SCHEDULERS)}")
        return SCHEDULERS[value]
    if key == "bf16":
        return "bfloat16" if value in (True, "true", "True", 1) else None
    return value


def _trl_fields() -> set[str]:
    """GRPOConfig's field names, when TRL is installed (the `trl` extra); else none."""
    try:
        from trl import GRPOConfig
    except ImportError:
        return set()
    return {f.name for f in dataclasses.fields(GRPOConfig)}


def _unknown(key: str, sections: dict[str, type]) -> str:
    known = list(sections) + list(TRL_NAMES) + [f"{s}.{f.name}" for s, cls in sections.items()
                                                for f in dataclasses.fields(cls)]
    return (f"unknown config key '{key}'{nearest(key, known)}; a top-level key is a section ({', '.join(sections)}) "
            "or a TRL GRPOConfig name (listed by --help)")
