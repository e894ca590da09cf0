"""`TreeRLOOTrainer`: TRL 1.16's `RLOOTrainer` whose training step runs the execution stack.

    from branchreplay.trl import TreeRLOOTrainer   # was: from trl import RLOOTrainer

RLOO's loss (Ahmadian et al. 2024, "Back to Basics"; TRL's `_compute_loss`) is PPO's clipped objective on each
completion's summed logprob, ratio = exp(sum_t logp_t - old_logp), with the leave-one-out advantages of the group
(and TRL's KL penalty folded into the rewards before them, so the loss has no KL term): a function of whole rows,
which TRL's own `_compute_loss` computes on the tree's rows in two passes (`base.TreeTrainerMixin`).
"""

from __future__ import annotations

import trl

from .base import TreeTrainerMixin


class TreeRLOOTrainer(TreeTrainerMixin, trl.RLOOTrainer):
    """TRL 1.16's `RLOOTrainer` with the padded forward and backward of each micro-batch replaced by the execution
    stack over one rollout tree per prompt (a group's completions share their prompt and common starts): the same
    gradient (to floating-point tolerance), each shared position computed once.

    Args:
        *args, **kwargs: exactly `trl.RLOOTrainer`'s (model, reward_funcs, args=RLOOConfig, datasets, ...).
        engine, unknown_family: `base.TreeTrainerMixin`'s.

    Every RLOOConfig setting of the loss runs as TRL's (`epsilon`, `epsilon_high`, `beta`, `normalize_advantages`,
    `num_iterations`, gradient accumulation, `temperature`, `bf16` autocast); gradient checkpointing is switched off
    with a notice (the stack replays packs under engine.memory_budget).

    Raises: `base.TreeTrainerMixin`'s, when the trainer is built.
    """

    trl_name = "RLOOTrainer"
    config_name = "RLOOConfig"
