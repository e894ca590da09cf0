"""Run configuration: one dataclass per concern, composed into `Config`.

    model:    ModelConfig      which causal LM, in which dtype, on which device
    sampling: SamplingConfig   (from sampling.py) how completions are sampled
    task:     TaskConfig       (from tasks.py) which reasoning-gym dataset, split sizes
    grpo:     GRPOConfig       the objective and the optimizer (TRL GRPOConfig names)
    train:    TrainConfig      steps, seed, run folder, checkpoint and eval cadence

Precedence: command line > YAML file > dataclass defaults (as torchtitan's config manager). A YAML file holds one
mapping per section; the command line overrides one field with `--section.field value` or `--section.field=value`.
Values are parsed to the field's declared type (bool: true/false/yes/no/1/0; tuples, lists and dicts as YAML, e.g.
`--sampling.branching "[[0,2],[8,2]]"`). Unknown sections and keys are errors that list the valid ones.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .losses import LOSS_TYPES
from .sampling import SamplingConfig
from .tasks import TaskConfig

DTYPES = ("float32", "bfloat16", "float16", "float64")
SCALE_REWARDS = ("group", "batch", "none")
LR_SCHEDULERS = ("cosine", "constant")


def _help(text: str):
    return {"help": text}


@dataclass
class ModelConfig:
    """The policy model (the reference model for the KL penalty is a frozen copy of its initial weights)."""

    spec: str = field(default="smollm2", metadata=_help(
        "model to train, as models.load_model: 'smollm2' (default, SmolLM2-135M-Instruct), 'tiny:<arch>', a "
        "save_pretrained folder, a .gguf file or a hub id 'org/name'"))
    dtype: str = field(default="float32", metadata=_help(f"parameter dtype, one of {', '.join(DTYPES)}"))
    device: str = field(default="auto", metadata=_help("torch device; 'auto' = cuda if available, else cpu"))

    def __post_init__(self):
        _choice("model.dtype", self.dtype, DTYPES)


@dataclass
class GRPOConfig:
    """The GRPO objective and its optimizer. Names and meanings follow TRL's GRPOConfig (trl/trainer/grpo_config.py).

    One training step samples `num_generations` completions for each of `prompts_per_step` prompts, then makes
    `num_iterations` optimizer updates on them (TRL's mu).
    """

    num_generations: int = field(default=8, metadata=_help(
        "G, completions per prompt, >= 2 (a group of one has zero advantage: nothing to learn; TRL also requires "
        "2); must equal the product of sampling.branching"))
    prompts_per_step: int = field(default=4, metadata=_help("prompts (groups) per step, >= 1"))
    loss_type: str = field(default="dapo", metadata=_help(
        f"loss normalisation, one of {', '.join(LOSS_TYPES)} (TRL meanings; see losses.token_weights)"))
    scale_rewards: str = field(default="group", metadata=_help(
        "advantage scaling: 'group' divides by the group's reward std, 'batch' by the step's, 'none' not at all "
        "(Dr. GRPO)"))
    epsilon: float = field(default=0.2, metadata=_help("lower clip range of the ratio, in (0, 1)"))
    epsilon_high: float | None = field(default=None, metadata=_help(
        "upper clip range, > 0; default (null) = epsilon; DAPO uses 0.28"))
    beta: float = field(default=0.0, metadata=_help(
        "k3 KL coefficient against the initial model, >= 0 (0 = no reference model is kept)"))
    entropy_coef: float = field(default=0.0, metadata=_help("entropy bonus coefficient, >= 0 (0 = off)"))
    num_iterations: int = field(default=1, metadata=_help(
        "optimizer updates per batch of samples (TRL mu), >= 1; > 1 computes old logprobs before the first one"))
    mask_truncated_completions: bool = field(default=False, metadata=_help(
        "exclude completions that hit sampling.max_new_tokens without EOS from the loss and its normaliser"))
    max_grad_norm: float = field(default=1.0, metadata=_help("gradient clipping norm, > 0"))
    learning_rate: float = field(default=1e-6, metadata=_help("peak AdamW learning rate, > 0"))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay, >= 0"))
    warmup_steps: int = field(default=0, metadata=_help("linear warmup, in optimizer updates, >= 0"))
    lr_scheduler: str = field(default="cosine", metadata=_help(
        f"learning-rate decay after warmup, one of {', '.join(LR_SCHEDULERS)} (cosine decays to 0 at the end)"))
    micro_batch_prompts: int = field(default=0, metadata=_help(
        "prompt groups per forward/backward call, >= 0 (0 = all of the step's); the gradient does not depend "
        "on it, only memory does"))

    def __post_init__(self):
        _choice("grpo.loss_type", self.loss_type, LOSS_TYPES)
        _choice("grpo.scale_rewards", self.scale_rewards, SCALE_REWARDS)
        _choice("grpo.lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        _check("grpo.num_generations", self.num_generations >= 2, ">= 2", self.num_generations)
        _check("grpo.prompts_per_step", self.prompts_per_step >= 1, ">= 1", self.prompts_per_step)
        _check("grpo.epsilon", 0 < self.epsilon < 1, "in (0, 1)", self.epsilon)
        _check("grpo.epsilon_high", self.epsilon_high > 0, "> 0", self.epsilon_high)
        _check("grpo.beta", self.beta >= 0, ">= 0", self.beta)
        _check("grpo.entropy_coef", self.entropy_coef >= 0, ">= 0", self.entropy_coef)
        _check("grpo.num_iterations", self.num_iterations >= 1, ">= 1", self.num_iterations)
        _check("grpo.max_grad_norm", self.max_grad_norm > 0, "> 0", self.max_grad_norm)
        _check("grpo.learning_rate", self.learning_rate > 0, "> 0", self.learning_rate)
        _check("grpo.weight_decay", self.weight_decay >= 0, ">= 0", self.weight_decay)
        _check("grpo.warmup_steps", self.warmup_steps >= 0, ">= 0", self.warmup_steps)
        _check("grpo.micro_batch_prompts", self.micro_batch_prompts >= 0, ">= 0", self.micro_batch_prompts)


@dataclass
class TrainConfig:
    """The run: how long, where it is written, how often it is saved and evaluated."""

    steps: int = field(default=100, metadata=_help("training steps (sampling rounds), >= 1"))
    seed: int = field(default=0, metadata=_help(
        "seed of prompt order and sampling; the same seed gives the same run, resumed or not"))
    output_dir: str = field(default="runs/default", metadata=_help(
        "run folder: config.yaml, metrics.jsonl, checkpoints/, plot; must not hold another run's checkpoints"))
    save_steps: int = field(default=50, metadata=_help(
        "checkpoint every this many steps, >= 0 (0 = only at the end and on interruption)"))
    keep_checkpoints: int = field(default=2, metadata=_help(
        "newest checkpoints kept, >= 1 (a SmolLM2 checkpoint with AdamW state is about 1.6 GB)"))
    eval_steps: int = field(default=50, metadata=_help(
        "held-out evaluation every this many steps (0 = only before and after training, -1 = never)"))

    def __post_init__(self):
        _check("train.steps", self.steps >= 1, ">= 1", self.steps)
        _check("train.save_steps", self.save_steps >= 0, ">= 0", self.save_steps)
        _check("train.keep_checkpoints", self.keep_checkpoints >= 1, ">= 1", self.keep_checkpoints)
        _check("train.eval_steps", self.eval_steps >= -1, ">= -1", self.eval_steps)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "sampling": SamplingConfig,
    "task": TaskConfig,
    "grpo": GRPOConfig,
    "train": TrainConfig,
}


@dataclass
class Config:
    """The whole run configuration. Raises ValueError when sections disagree (the message names both fields)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        product = 1
        for _, factor in self.sampling.branching:
            product *= factor
        if self.sampling.branching and product != self.grpo.num_generations:
            raise ValueError(
                f"sampling.branching={[list(b) for b in self.sampling.branching]} makes {product} samples per prompt "
                f"but grpo.num_generations={self.grpo.num_generations}: make them equal")

    @classmethod
    def from_dict(cls, data: dict | None) -> Config:
        """Build from {section: {field: value}}; values are coerced to the field types. Raises ValueError for an
        unknown section or key (listing the valid ones) or a value of the wrong type (naming the field)."""
        data = data or {}
        if not isinstance(data, dict):
            raise ValueError(f"a config must be a mapping of sections, got {type(data).__name__}")
        for name in data:
            if name not in SECTIONS:
                raise ValueError(f"unknown config section '{name}'; valid sections: {', '.join(SECTIONS)}")
        sections = {}
        for name, section_cls in SECTIONS.items():
            values = data.get(name) or {}
            if not isinstance(values, dict):
                raise ValueError(f"config section '{name}' must be a mapping, got {values!r}")
            hints, known = _field_types(section_cls), [f.name for f in dataclasses.fields(section_cls)]
            for key in values:
                if key not in hints:
                    raise ValueError(f"unknown key '{name}.{key}'; valid keys of '{name}': {', '.join(known)}")
            sections[name] = section_cls(**{k: _coerce(v, hints[k], f"{name}.{k}") for k, v in values.items()})
        return cls(**sections)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> Config:
        """Load a YAML file, then apply `--section.field value` overrides (see `apply_overrides`)."""
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        return cls.from_dict(apply_overrides(data, overrides or []))

    def to_dict(self) -> dict:
        """{section: {field: value}} with YAML-friendly values (tuples become lists)."""
        return _plain(dataclasses.asdict(self))

    def save(self, path: str | Path) -> None:
        """Write the resolved config as YAML (what `from_yaml` reads back to an equal Config)."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `--section.field value` / `--section.field=value` arguments to {section: {field: value}} (a copy).

    Raises ValueError for an argument that is not of that form, a missing value, or an unknown section or key."""
    data = {k: dict(v or {}) for k, v in data.items()}
    i = 0
    while i < len(overrides):
        arg = overrides[i]
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
            raise ValueError(f"unknown key '{key}'; valid keys of '{section}': {', '.join(hints)}")
        data.setdefault(section, {})[name] = _parse_cli(value, hints[name])
        i += 1
    return data


def help_text() -> str:
    """One line per field: `--section.field  (type, default) help`, for the command's --help."""
    lines = []
    for section, cls in SECTIONS.items():
        hints = _field_types(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kind = getattr(hints[f.name], "__name__", str(hints[f.name]))
            lines.append(f"--{section}.{f.name}  ({kind}, default {_plain(default)!r})  {field_help(cls, f)}")
    return "\n".join(lines)


def field_help(cls: type, f: dataclasses.Field) -> str:
    """A field's help: its metadata 'help', else its `name: ...` entry of the class docstring (reused classes), with
    its continuation lines (indented deeper) and without reST markup (``x`` and :func:`x` become x)."""
    if "help" in f.metadata:
        return f.metadata["help"]
    lines = (cls.__doc__ or "").splitlines()
    for i, line in enumerate(lines):
        match = re.match(rf"^(\s*){f.name}:\s*(.+)$", line)
        if match:
            indent, text = len(match.group(1)), [match.group(2).strip()]
            for more in lines[i + 1:]:
                if not more.strip() or len(more) - len(more.lstrip()) <= indent:
                    break
                text.append(more.strip())
            return re.sub(r"(:\w+:)?`+([^`]+)`+", r"\2", " ".join(text))
    return ""


# -- helpers ------------------------------------------------------------------------------------------------------

def _choice(name: str, value, accepted: tuple) -> None:
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not valid; accepted values: {', '.join(accepted)}")


def _check(name: str, ok: bool, accepted: str, value) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is out of range; it must be {accepted}")


def _field_types(cls: type) -> dict[str, type]:
    return typing.get_type_hints(cls)


def _parse_cli(text: str, tp) -> object:
    """A command-line string for a field of type `tp`: strings stay strings, everything else is read as YAML."""
    if tp is str:
        return text
    return yaml.safe_load(text)


def _coerce(value, tp, name: str):
    """`value` as type `tp` (int, float, bool, str, X | None, tuple/list/dict); ValueError naming the field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
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
