"""Run configuration: one dataclass per concern, composed into `Config` (its docstring lists the sections).

The sections are sections.py's classes (decode/config.py, task.py and agent.py hold three of them); values.py parses and
coerces values. Precedence: command line > YAML file > dataclass defaults (as torchtitan's config manager). A YAML
file holds one mapping per section (and `algorithm: NAME`); the command line overrides one field with
`--section.field value` or `--section.field=value`, and the algorithm with `--algorithm NAME`. Each algorithm starts
from TRL's defaults for its trainer where they differ from GRPO's (`ALGORITHM_DEFAULTS`). Values are parsed to the
field's declared type (bool: true/false/yes/no/1/0; a closed choice must be one of its Literal values; tuples, lists
and dicts as YAML, e.g. `--sampling.branching "[[0,2],[8,2]]"`). Unknown sections and keys are errors that list the
valid ones. `parse_args` is the one parser of `train` and `eval`; every field's help is its metadata
(`fields.help_of`), printed by `help.py`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ...decode.config import SamplingConfig, turn_factor
from ...engine.config import EngineConfig
from ...fields import nearest
from ..algorithms import check_algorithm
from .agent import AgentConfig
from .resolve import resolved
from .resume import check_resume, latest_config, launch_free, read
from .sections import (
    SECTIONS,
    DPOConfig,
    GRPOConfig,
    ModelConfig,
    ParallelConfig,
    PPOConfig,
    ReinforcePPConfig,
    RLOOConfig,
    TrainConfig,
)
from .task import TaskConfig
from .trl_names import from_trl_names
from .values import MOVED, TRL_COMMAND_LINE, apply_overrides, coerce, field_types, moved, plain

ALGORITHM_DEFAULTS: dict[str, dict[str, dict]] = {
    "rloo": {"grpo": {"beta": 0.05, "num_generations": 2}},  # TRL 1.16 RLOOConfig (trl/trainer/rloo_config.py)
}
"""Defaults of an algorithm that differ from GRPO's, where TRL's trainer for it has other ones (a value in the
YAML file or on the command line wins)."""


def _section(name: str, values: dict | None = None, algorithm: str = "grpo"):
    """Section `name` built from `values` over the algorithm's defaults and the dataclass ones."""
    defaults = ALGORITHM_DEFAULTS.get(algorithm, {}).get(name, {})
    return SECTIONS[name](**{**defaults, **(values or {})})


@dataclass
class Config:
    """The whole run configuration. Raises ValueError when sections disagree (the message names both fields).

    An algorithm's TRL defaults (`ALGORITHM_DEFAULTS`) apply when a config is read (`from_dict`, `from_yaml`, the
    command line); `Config(algorithm="rloo")` built in Python keeps the sections it is given. The sections:

        algorithm: grpo | ppo | rloo | reinforce_pp | dpo   (top level) what the advantages and the loss are
        model:    ModelConfig      which causal LM, in which dtype, on which device
        sampling: SamplingConfig   how completions are sampled
        task:     TaskConfig       which reasoning-gym dataset or prompt file, split sizes, rewards
        agent:    AgentConfig      a multi-turn environment and its limits; null = single-turn
        grpo:     GRPOConfig       sampling counts, clip range and optimizer of every algorithm (TRL GRPOConfig names)
        ppo:      PPOConfig        the critic, GAE and the value loss (algorithm: ppo; TRL PPOConfig names)
        rloo:     RLOOConfig       RLOO's options (algorithm: rloo; TRL RLOOConfig names)
        reinforce_pp: ReinforcePPConfig  REINFORCE++'s options (algorithm: reinforce_pp; verl's names)
        dpo:      DPOConfig        the preference file and the DPO loss (algorithm: dpo; TRL DPOConfig names)
        engine:   EngineConfig     (from engine/config.py) packing, chunking, replay; passed to every engine call
        parallel: ParallelConfig   data parallelism over torchrun's processes (FSDP2 or DDP semantics)
        train:    TrainConfig      steps, seed, run folder, checkpoint and eval cadence, how gradients are computed"""

    algorithm: str = "grpo"
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    rloo: RLOOConfig = field(default_factory=RLOOConfig)
    reinforce_pp: ReinforcePPConfig = field(default_factory=ReinforcePPConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        check_algorithm(self.algorithm)
        if self.algorithm == "dpo" and not self.dpo.dataset:
            raise ValueError("algorithm=dpo trains on preference pairs: set dpo.dataset to a JSONL / Parquet file "
                             "(scripts/make_preference_set.py writes one from the default task)")
        if self.sampling.backend == "vllm":
            self._check_vllm()
        if self.train.method != "branchreplay":
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
        refused = [(self.algorithm == "dpo", "algorithm=dpo (nothing is sampled)")]
        for is_refused, what in refused:
            if is_refused:
                raise ValueError(f"sampling.backend=vllm does not run {what} yet: use sampling.backend=hf")
        if s.vllm_importance_sampling_cap is not None and (
                self.algorithm != "grpo" or self.grpo.importance_sampling_level == "sequence"):
            raise ValueError("sampling.vllm_importance_sampling_cap scales GRPO's token-level advantages; with "
                             f"algorithm={self.algorithm} (its own advantages) or GSPO's sequence-level loss it is not "
                             "run yet: set it to null")

    def _check_method(self) -> None:
        """The references of `train.method` (rl/policy.py) run token-level losses of whole rollouts."""
        method = self.train.method
        refused = [(self.algorithm in ("rloo", "dpo"), f"algorithm={self.algorithm} (a sequence-level loss)"),
                   (self.grpo.importance_sampling_level == "sequence", "GSPO (grpo.importance_sampling_level="
                                                                       "sequence, a sequence-level loss)"),
                   (method == "padded" and self.algorithm == "ppo", "algorithm=ppo (its critic has no padded "
                                                                   "batch; train.method=naive runs it)")]
        for is_refused, what in refused:
            if is_refused:
                raise ValueError(f"train.method={method} does not run {what}: use train.method=branchreplay")

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
                f"sampling.turn_branching={plain(self.sampling.turn_branching)} makes up to {product} trajectories "
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
        check_algorithm(algorithm)
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
            hints, known = field_types(section_cls), [f.name for f in dataclasses.fields(section_cls)]
            for key in values:
                if key not in hints:
                    raise ValueError(f"unknown key '{name}.{key}'{moved(name, key) or nearest(key, known)}; valid "
                                     f"keys of '{name}': {', '.join(known)}")
            sections[name] = _section(name, {k: coerce(v, hints[k], f"{name}.{k}") for k, v in values.items()},
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
        return cls.from_dict(apply_overrides(_moved_keys(data, path), overrides or []))

    def to_dict(self) -> dict:
        """{"algorithm": name, section: {field: value}} with YAML-friendly values (tuples become lists)."""
        return plain(dataclasses.asdict(self))

    def save(self, path: str | Path) -> None:
        """Write the resolved config as YAML (what `from_yaml` reads back to an equal Config)."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def parse_args(argv: list[str], options: tuple[str, ...] = ("--config", "--resume")) -> tuple[Config, dict]:
    """`[--config FILE] [--resume RUN_DIR | --checkpoint DIR] [--section.field VALUE ...]` -> (config, {option:
    value or None} for each of `options`), the one parser of `train` (--config, --resume) and `eval` (--config,
    --checkpoint). Options take `--name value` or `--name=value`.

    With --resume and no --config, the run's newest config is the base (`resume.latest_config`); train.output_dir
    becomes RUN_DIR, and what a resume may not change is refused by name (`resume.check_resume`). With
    --checkpoint and no --config, the config of the run holding it (`run_config`), when there is one.
    Raises ValueError for a bad argument (see `apply_overrides`), FileNotFoundError for a missing file (a config,
    a data file: `check_files`)."""
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
    own = latest_config(resume) if resume is not None else None
    path = path if path is not None else own
    checkpoint = named.get("--checkpoint")
    if checkpoint is not None and path is None:  # eval of a run: its own config, unless --config is given
        path = run_config(checkpoint)
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    if own is not None and Path(path) == own:
        overrides = launch_free(read(own), _keep_objective(own, overrides))
    config = Config.from_yaml(path, overrides) if path else Config.from_dict(apply_overrides({}, overrides))
    if resume is not None:
        config.train.output_dir = str(resume)
        if own.is_file():
            check_resume(resolved(saved_config(resume)).to_dict(), resolved(config).to_dict(), Path(resume))
    check_files(config)
    return config, named


def saved_config(run_dir: str | Path) -> Config:
    """What the run in `run_dir` trained with: its newest config (`resume.latest_config`), read as a resume reads it
    (`_keep_objective`), without the warnings."""
    path = latest_config(run_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Config.from_yaml(path, _keep_objective(path, []))


def check_files(config: Config) -> None:
    """Raise FileNotFoundError naming the field for a data file the run names that does not exist (before torch
    loads: a typo costs no model load)."""
    files = [("task.dataset", config.task.dataset), ("task.eval_dataset", config.task.eval_dataset)]
    if config.algorithm == "dpo":
        files.append(("dpo.dataset", config.dpo.dataset))
    for field_name, path in files:
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{field_name} {path} does not exist")


def run_config(checkpoint: str | Path) -> Path | None:
    """The newest config of the run that holds `checkpoint` (a run folder, or one of its checkpoints/step-N
    folders: `resume.latest_config`), or None when there is none (a folder from elsewhere)."""
    folder = Path(checkpoint)
    candidates = [folder] + ([folder.parent.parent] if folder.parent.name == "checkpoints" else [])
    for candidate in candidates:
        if (candidate / "config.yaml").is_file():
            return latest_config(candidate)
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


def _moved_keys(data: dict, path) -> dict:
    """`data` (a config file's) with the keys of `MOVED` in their new sections, with a warning: a run folder's
    config.yaml written before they moved still resumes."""
    data = dict(data)
    for (old, key), new in MOVED.items():
        section = data.get(old)
        if isinstance(section, dict) and key in section:
            data[old] = {k: v for k, v in section.items() if k != key}
            data[new] = {key: section[key], **(data.get(new) or {})}
            warnings.warn(f"{path}: {old}.{key} is now {new}.{key}; read as {new}.{key}={section[key]!r}",
                          stacklevel=3)
    return data
