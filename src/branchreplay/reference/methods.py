"""The other ways to compute the execution stack's gradient, by name: one table that `train.method` (rl/policy.py)
and `branchreplay bench` (bench/runner.py) both look up.

    METHODS[name].backward(model, rollouts, loss, temperature=T)   forward + backward; grads into param.grad
    METHODS[name].logprobs(model, rollouts, temperature=T)          per-rollout logprobs (loss None, no backward)
    METHODS[name].work(rollouts)                                    the positions it computes (`work.Work`)
    METHODS[name].peak_bytes(rollouts, config, dtype)               its estimated peak (`memory`), or None

Every method equals the naive per-rollout computation to floating-point tolerance; "branchreplay" itself is the
engine's, above this floor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import memory, work
from .naive import naive_backward
from .padded import padded_backward
from .prompt_sharing import prompt_sharing_backward


@dataclass(frozen=True)
class Method:
    """One reference method: its backward, logprobs, work and peak-bytes model (None: not modelled)."""

    backward: Callable
    work: Callable
    peak_bytes: Callable | None = None

    def logprobs(self, model, rollouts, *, temperature: float = 1.0):
        """The per-rollout logprobs and entropies of `backward` with no loss: a `ReplayResult`, no graph kept."""
        with torch.no_grad():
            return self.backward(model, rollouts, None, temperature=temperature)


METHODS = {
    "naive": Method(naive_backward, work.naive_work),
    "padded": Method(padded_backward, work.padded_work, memory.padded_peak_bytes),
    "prompt-sharing": Method(prompt_sharing_backward, work.prompt_sharing_work, memory.prompt_sharing_peak_bytes),
}
