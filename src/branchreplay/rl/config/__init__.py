"""The run configuration: `Config` (run.py) composed of one dataclass per section (sections.py, with task.py and
agent.py beside it, and decode/config.py's sampling section), TRL's flat names (trl_names.py), values and overrides
(values.py), the one parser of `train` and `eval` (`parse_args`) and their help (help.py). Torch-free, so that
--help and config errors come before torch loads."""

from .help import full_help, short_help
from .run import ALGORITHM_DEFAULTS, Config, parse_args, run_config
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
from .values import apply_overrides

__all__ = ["ALGORITHM_DEFAULTS", "SECTIONS", "Config", "DPOConfig", "GRPOConfig", "ModelConfig", "ParallelConfig",
           "PPOConfig", "ReinforcePPConfig", "RLOOConfig", "TrainConfig", "apply_overrides", "full_help",
           "parse_args", "run_config", "short_help"]
