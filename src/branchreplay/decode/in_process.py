"""The in-process sampler back-end: the trained policy's own model draws a step's rollouts in this process.

A back-end answers four things, the same for the vLLM server's (`rl/rollouts/vllm/backend.py`):

    groups(step, prompts)   single-turn: G samples of each prompt, {group k: its Samples}, and what failed
    items(step, items)      multi-turn: each item's trajectories, turn by turn, through the environment
    sync(weights)           the policy's new weights (nothing to do here: the model is the policy's own)
    keeps_logprobs          whether a batch keeps the logprobs it was drawn with (a sampler process's do)

Group (item) k of a step draws from its own generator (`generator(step, k)`, seeded by the caller), so its samples
do not depend on the other groups, the world size or a resume. Under torchrun rank r draws the groups k with
k % world == r (`ranks.mine`), each wave of `sampling.max_num_seqs` rows in one decoding loop.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch

from ..engine.parallel.distributed import raise_together
from .config import SamplingConfig
from .loop import sample_groups
from .packed_linears import packed_linears
from .turns import InProcessTurns


class InProcess:
    """The policy's model samples (module docstring). `policy`: the `rl.policy.Policy` that samples (its model, FSDP2
    gathering and mixed precision); `generator(step, k)`: group k's torch.Generator; `trajectories(turn, items=,
    timings=)`: the multi-turn driver (`rl.rollouts.trajectories.sample_trajectories_turnwise` bound to the run's
    environment), None for a single-turn run; `status`: called with the progress bar's phase text."""

    def __init__(self, sampling: SamplingConfig, num_generations: int, policy, eos_ids: set[int],
                 generator: Callable[[int, int], torch.Generator], trajectories=None, ranks=None,
                 status=lambda text: None):
        self.sampling, self.G, self.policy, self.eos_ids = sampling, num_generations, policy, eos_ids
        self.generator, self.trajectories, self.ranks, self.status = generator, trajectories, ranks, status
        self.keeps_logprobs = False

    def sync(self, weights) -> None:
        """Nothing: the model samples with the policy's own weights."""

    def groups(self, step: int, prompts: list[list[int]]) -> tuple[dict, tuple | None]:
        """This rank's groups sampled in one decoding loop per wave, each from its own generator: ({k: samples},
        None), or ({}, ("rank", what failed)) on a rank of a data-parallel run (re-raised on every rank)."""
        mine = self.mine(len(prompts))
        with self.sampling_context(mine):
            try:
                drawn = []
                for wave in self.waves(mine):
                    self.status(f"step {step}: sampling {len(drawn) + len(wave)}/{len(mine)} groups")
                    drawn += sample_groups(self.policy.model, [prompts[k] for k in wave], self.G, self.sampling,
                                           self.eos_ids, [self.generator(step, k) for k in wave])
                return dict(zip(mine, drawn, strict=True)), None
            except Exception as e:  # noqa: BLE001 (re-raised on every rank)
                if self.ranks is None:
                    raise
                return {}, ("rank", f"rank {self.ranks.rank}: {type(e).__name__}: {e}")

    def items(self, step: int, items: list[dict]) -> tuple[dict, dict, list[str]]:
        """This rank's items' trajectories ({k: its trajectories}; items whose environment failed are left out with
        a warning), gathered from every rank under torchrun; {"env_s": this rank's environment seconds}; and why
        the items left out were (every rank's)."""
        groups, timings, errors, failure = {}, {"env_s": 0.0}, [], None
        mine = self.mine(len(items))
        with self.sampling_context(mine):
            try:
                started = 0
                for wave in self.waves(mine):
                    started += len(wave)
                    self.status(f"step {step}: sampling {started}/{len(mine)} items")
                    generators = [self.generator(step, k) for k in wave]
                    turns = InProcessTurns(self.policy.model, self.sampling, self.eos_ids,
                                           lambda i, path, generators=generators: generators[i])
                    drawn, failed = self.trajectories(turns, items=[items[k] for k in wave], timings=timings)
                    groups.update({wave[i]: trajectories for i, trajectories in drawn.items()})
                    errors += failed
            except Exception as e:  # noqa: BLE001 (re-raised on every rank: the others would wait)
                if self.ranks is None:
                    raise
                failure = e
        for error in errors:
            warnings.warn(f"step {step}: an item was skipped: {error}", RuntimeWarning, stacklevel=3)
        if self.ranks is not None:
            with self.ranks.waiting():
                raise_together(failure, "sampling the trajectories")
            parts = self.ranks.gather((groups, errors))
            errors = [e for _, part in parts for e in part]
            for part, _ in parts:
                groups.update(part)
        return groups, timings, errors

    def mine(self, n: int) -> list[int]:
        """The groups (items) of `n` this rank samples: k with k % world == rank (all in one process)."""
        return self.ranks.mine(n) if self.ranks is not None else list(range(n))

    def waves(self, groups: list[int]) -> list[list[int]]:
        """`groups` (or items) in the waves sampled together (`sampling.max_num_seqs` rows at most)."""
        limit = self.sampling.max_num_seqs
        size = len(groups) if limit is None else max(1, limit // self.G)
        return [groups[i : i + size] for i in range(0, len(groups), max(size, 1))]

    @contextlib.contextmanager
    def sampling_context(self, mine: list[int]):
        """The full parameters (FSDP2), mixed precision and MKL-packed weights for a wave's rows at most."""
        rows = max(map(len, self.waves(mine)), default=0) * self.G
        model = self.policy.model
        with self.policy.gathered(), self.policy.autocast(), packed_linears(model, self.sampling.pack_weights, rows):
            yield
