"""The TRL drop-ins: TRL 1.16's trainers whose training step runs the execution stack. One import changes:

    from branchreplay.trl import TreeGRPOTrainer   # was: from trl import GRPOTrainer
    from branchreplay.trl import TreeRLOOTrainer   # was: from trl import RLOOTrainer
    from branchreplay.trl import TreeDPOTrainer    # was: from trl import DPOTrainer

Everything but the loss's forward and backward is TRL's own: generation, reward functions, advantages, old and
reference logprobs, the optimizer, logging, checkpoints. Each micro-batch TRL hands to `compute_loss` becomes one
rollout tree per prompt (`rows.py`), and the execution stack puts into `param.grad` the gradient of TRL's loss
(`base.py`, `grpo.py`). The logged metrics are TRL's plus `tree/logical_tokens`, `tree/physical_tokens` and
`tree/token_ratio` (rollout positions over computed ones). tests/test_trl_grpo.py and tests/test_trl_rloo.py
compare the gradients with TRL's own classes on TRL's micro-batches, float32.
"""

from packaging.version import Version

TRL_RANGE = ("1.16", "1.17")
"""The TRL versions this package was written against and tested with: >= 1.16, < 1.17."""

try:
    import trl
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("branchreplay.trl needs TRL 1.16: pip install 'branchreplay[trl]'") from e

if not Version(TRL_RANGE[0]) <= Version(trl.__version__) < Version(TRL_RANGE[1]):
    raise ImportError(
        f"branchreplay.trl supports TRL >= {TRL_RANGE[0]}, < {TRL_RANGE[1]}; this environment has TRL "
        f"{trl.__version__}: pip install 'trl>={TRL_RANGE[0]},<{TRL_RANGE[1]}' (or 'branchreplay[trl]')"
    )

from .dpo import TreeDPOTrainer  # noqa: E402
from .grpo import TreeGRPOTrainer  # noqa: E402
from .rloo import TreeRLOOTrainer  # noqa: E402

__all__ = ["TreeDPOTrainer", "TreeGRPOTrainer", "TreeRLOOTrainer"]
