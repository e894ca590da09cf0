"""DPO over prefix trees (TRL 1.16's DPOTrainer; Rafailov et al. 2023): no sampling, preference pairs from a file
(`data.preferences`), a pair's prompt one node and its chosen and rejected responses branches (a common response
prefix one node too; pairs of one prompt in one tree). The loss (`losses.dpo_loss`: sigmoid, hinge, ipo, robust and
the reference-free simpo) is a function of each response's summed logprob, so its exact gradient over the trees
takes two passes (`Policy.function_backward`); under torchrun chosen and rejected may even run on different ranks.
The reference's summed logprobs come from the frozen reference each step, or once for every pair
(dpo.precompute_ref_log_probs, TRL's option). One optimizer update per step of dpo.pairs_per_step pairs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...engine.sequence import sequence_sums
from ...losses import dpo_loss, dpo_metrics
from ..data.preferences import PairBatches, load_preferences
from .base import Algorithm, Estimate

if TYPE_CHECKING:
    from ..config import Config
    from ..data.preferences import PairBatch
    from ..policy import Policy
    from ..shards import Shards
    from .base import Passes


@dataclass
class Prepared:
    """What DPO's update needs: the `shards` of the pair trees, the reference's summed logprobs [2 x pairs] (None for
    simpo) and each response's trained tokens [2 x pairs], float64, chosen and rejected interleaved."""

    shards: object
    ref: torch.Tensor | None
    lengths: torch.Tensor


class DPO(Algorithm):
    """DPO as a part of the loop (module docstring). It brings its own batches (`batches`)."""

    name = "dpo"
    samples = False

    def __init__(self, config: Config, policy: Policy, reference: Policy | None = None):
        super().__init__(config, policy, reference)
        self.ref_sums: dict[int, tuple[float, float]] = {}  # by row, when precomputed
        self.status = lambda text: None

    @classmethod
    def needs_reference(cls, config: Config) -> bool:
        return config.dpo.loss_type != "simpo"  # simpo is reference-free

    def batches(self, tokenizer) -> PairBatches:
        """The run's preference pairs (dpo.dataset, tokenized), dpo.pairs_per_step a step (all of them, with a
        warning, when there are fewer)."""
        d = self.config.dpo
        pairs, _ = load_preferences(d.dataset, tokenizer, d.max_length)
        if len(pairs) < d.pairs_per_step:  # as TRL's data loader, a batch holds at most the data
            warnings.warn(f"dpo.dataset {d.dataset} has {len(pairs)} pairs, fewer than dpo.pairs_per_step="
                          f"{d.pairs_per_step}: a step trains on all {len(pairs)}", RuntimeWarning, stacklevel=2)
        return PairBatches(pairs, min(d.pairs_per_step, len(pairs)), self.config.train.seed)

    def needs_old_logprobs(self) -> bool:
        return False  # one update a step, on-policy

    def needs_ref_logprobs(self) -> bool:
        return False  # the reference's summed logprobs are the estimate's (`reference_sums`)

    def estimate(self, batch: PairBatch, shards: Shards, passes: Passes) -> Estimate:
        """Nothing per rollout: a pair's preference is its signal."""
        return Estimate([], {})

    def prepare(self, batch: PairBatch, shards: Shards, passes: Passes) -> Prepared:
        lengths = torch.tensor([float(r.loss_mask.sum()) for r in shards.rollouts], dtype=torch.float64)
        return Prepared(shards, self.reference_sums(batch, shards) if self.reference is not None else None, lengths)

    def reference_sums(self, batch: PairBatch, shards: Shards) -> torch.Tensor:
        """[2 x pairs] float64 summed completion logprobs of the frozen reference, chosen and rejected interleaved
        as the trees' rollouts. dpo.precompute_ref_log_probs: every pair's once, on the first call, sharded over the
        ranks as a step is, then looked up by row."""
        def compute(shards: Shards):
            return sequence_sums(shards.everywhere(self.reference.logprobs(shards.local).logprobs), shards.rollouts)

        if not self.config.dpo.precompute_ref_log_probs:
            return compute(shards)
        if not self.ref_sums:
            self.status("precomputing the reference logprobs of every preference pair")
            every = batch.everything()
            for p, c, r in zip(every.pairs, *compute(shards.of_trees(every.trees)).view(-1, 2).unbind(1), strict=True):
                self.ref_sums[p.row] = (float(c), float(r))
        return torch.tensor([v for p in batch.pairs for v in self.ref_sums[p.row]], dtype=torch.float64)

    def backward(self, update: int, prepared: Prepared):
        """The step's one update. Metrics: TRL DPOTrainer's rewards/chosen, rewards/rejected (beta x the policy-minus-
        reference summed logprob; simpo: beta x the mean logprob, as TRL's CPOTrainer), rewards/accuracies,
        rewards/margins, logps/chosen, logps/rejected (summed)."""
        d, shards, ref, lengths = self.config.dpo, prepared.shards, prepared.ref, prepared.lengths
        rollouts = shards.rollouts
        pairs = len(rollouts) // 2

        def loss(logprobs, entropy):
            s = sequence_sums(logprobs, rollouts)
            per_pair = dpo_loss(s[0::2], s[1::2], ref[0::2] if ref is not None else None,
                                ref[1::2] if ref is not None else None, beta=d.beta, loss_type=d.loss_type,
                                label_smoothing=d.label_smoothing, chosen_tokens=lengths[0::2],
                                rejected_tokens=lengths[1::2], simpo_gamma=d.simpo_gamma)
            return per_pair.sum() / pairs

        _, logprobs, _, result = self.policy.function_backward(shards, loss)
        return result, dpo_metrics(sequence_sums(logprobs, rollouts), ref, lengths, beta=d.beta, loss_type=d.loss_type)
