"""`TreeDPOTrainer`: TRL 1.16's `DPOTrainer` whose training step runs the execution stack.

    from branchreplay.trl import TreeDPOTrainer    # was: from trl import DPOTrainer

TRL's DPO batch holds each pair as two right-padded rows, all chosen rows then all rejected ones (`input_ids`,
`attention_mask`, `completion_mask` [2B, S]). Here the rows of one prompt make one tree: a pair's chosen and
rejected share their prompt and any common start of their responses, and pairs of the same prompt share it too.
With a vision-language model the prompt's images ride in its tree's prompt node (`engine.vision`; rows with equal
text and other images are other trees), run once for both responses. TRL's own `_compute_loss` runs on the tree's
rows in two passes (`base.py`; `TreeDPOTrainer` says what each pass gives).
"""

from __future__ import annotations

import contextlib

import torch
import trl
from trl.trainer.utils import FusedCausalLMOutput

from ..engine import replay_logprobs
from ..engine.sequence import replay_function_backward
from ..engine.vision import ImagePrompt
from ..models import base_of
from ..tree import Rollout, RolloutTree
from .base import TreeTrainerMixin
from .processes import gathered
from .rows import check_images_in_prompts, image_counts, image_key, row_images


class TreeDPOTrainer(TreeTrainerMixin, trl.DPOTrainer):
    """TRL 1.16's `DPOTrainer` with the padded forward and backward of each micro-batch replaced by the execution
    stack over one tree per prompt (module docstring): the same gradient (to floating-point tolerance), the prompt
    and each shared response start computed once.

    The loss is a function of each row's summed completion logprobs (every loss type of TRL's, its f-divergences,
    `ld_alpha`, WPO's `use_weighting`, the `sft` term), so TRL's own `_compute_loss` runs on the tree's rows in two
    passes (`base.py`): pass 1 gives every row's per-token logprobs, entropies and the fused head's statistics TRL's
    metrics read (`engine.head.HEAD_STATS`), and TRL's loss sees them as its model's output. The reference model's
    logprobs also come from the tree (a forward without a graph), unless TRL precomputed them or the reference is
    the policy's adapters turned off (then TRL's own padded reference forward runs).

    Args:
        *args, **kwargs: exactly `trl.DPOTrainer`'s (model, ref_model, args=DPOConfig, datasets, ...).
        engine, unknown_family: `base.TreeTrainerMixin`'s.

    Raises: `base.TreeTrainerMixin`'s, when the trainer is built.
    """

    trl_name = "DPOTrainer"
    config_name = "DPOConfig"

    def _tree_backward(self, model, inputs) -> float:
        rollouts, prompts = pair_rollouts(inputs)
        images = pair_images(inputs, model)
        groups: dict[tuple, list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault((prompt, image_key(images[i] if images else None)), []).append(i)
        order = [i for group in groups.values() for i in group]

        def trees_of(m) -> list[RolloutTree]:
            """The trees, their images run by `m` (the policy, or the reference model)."""
            return [RolloutTree([rollouts[i] for i in group],
                                images=image_prompt(m, prompts[group[0]], images, group[0]))
                    for group in groups.values()]

        trees = trees_of(model)
        stats = ("mean_logits", "is_top1") + (("log_sum_sq_probs",) if self.use_weighting else ())
        router = self._router_loss(model)
        with self.accelerator.autocast():
            first = replay_logprobs(model, trees, engine=self.engine, trusted=self._trusted, head_stats=stats,
                                    router=router)
        # the dtype of TRL's fused head outputs: float32, float64 for a float64 model (TRL's alpha-divergence looks
        # up its clamp by this dtype)
        dtype = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
        extra = self._tree_reference(trees_of, order, rollouts, inputs, dtype)
        divisor = self._accumulation_divisor()
        shape = (inputs["input_ids"].shape[0], inputs["input_ids"].shape[1] - 1)
        device = inputs["input_ids"].device

        def rows(values: list[torch.Tensor]) -> torch.Tensor:
            """Per rollout [T] (the trees' order) -> TRL's [2B, S - 1] shifted rows, 0 past each row."""
            out = torch.zeros(shape, dtype=torch.float64, device=device)
            for k, i in enumerate(order):
                out[i, : len(values[k]) - 1] = values[k][1:].to(device)
            return out.to(dtype)

        def trl_loss(logprobs: list[torch.Tensor], entropy: list[torch.Tensor]) -> torch.Tensor:
            outputs = FusedCausalLMOutput(
                log_probs=rows(logprobs), entropy=rows(entropy),
                mean_logits=rows(first.head_stats["mean_logits"]), is_top1=rows(first.head_stats["is_top1"]).bool(),
                log_sum_sq_probs=rows(first.head_stats["log_sum_sq_probs"]) if self.use_weighting else None,
                aux_loss=router.aux if router else None)
            with self._reference_given(bool(extra)):
                return super(TreeTrainerMixin, self)._compute_loss(lambda **kwargs: outputs, {**inputs, **extra},
                                                                   False) / divisor

        with self.accelerator.autocast():
            loss, _, result = replay_function_backward(model, trees, trl_loss, engine=self.engine,
                                                       trusted=self._trusted, first=first, router=router)
        self._log_tree_metrics(result)
        return loss * divisor

    def _tree_reference(self, trees_of, order, rollouts, inputs, dtype: torch.dtype) -> dict:
        """The reference model's summed completion logprobs of the pairs as TRL's precomputed keys
        (ref_chosen_logps, ref_rejected_logps [B] in `dtype`), from a forward of the trees `trees_of(ref_model)`
        (their images through the reference's vision tower); {} where TRL computes them itself (precomputed, no
        separate reference model, or ld_alpha's split of the sums)."""
        if self.precompute_ref_logps or self.ref_model is None or self.ld_alpha is not None:
            return {}
        with self.accelerator.autocast(), gathered(self.accelerator, self.ref_model) as ref_model:
            ref = replay_logprobs(ref_model, trees_of(ref_model), engine=self.engine, trusted=self._trusted)
        sums = torch.zeros(len(rollouts), dtype=torch.float64)
        for k, i in enumerate(order):
            sums[i] = (ref.logprobs[k].double() * rollouts[i].loss_mask).sum()
        chosen, rejected = sums.to(inputs["input_ids"].device, dtype).chunk(2)
        return {"ref_chosen_logps": chosen, "ref_rejected_logps": rejected}

    @contextlib.contextmanager
    def _reference_given(self, given: bool):
        """While TRL's loss runs: read the reference logprobs from the batch when the tree computed them."""
        before = self.precompute_ref_logps
        self.precompute_ref_logps = before or given
        try:
            yield
        finally:
            self.precompute_ref_logps = before


def pair_rollouts(inputs: dict) -> tuple[list[Rollout], list[tuple]]:
    """TRL's DPO batch (right-padded rows: prompt, then completion) as one rollout per row (the tokens where
    attention_mask is 1, loss mask completion_mask on them) and each row's prompt (the tokens before its
    completion), for grouping. Raises ValueError for a row whose attention_mask has a gap."""
    ids, attention, completion = (inputs[k].cpu() for k in ("input_ids", "attention_mask", "completion_mask"))
    rollouts, prompts = [], []
    for i in range(ids.shape[0]):
        n = int(attention[i].sum())
        if not bool(attention[i, :n].all()):
            raise ValueError(f"attention_mask row {i} has a gap: TreeDPOTrainer needs right-padded rows")
        mask = completion[i, :n].double()
        start = int(mask.nonzero()[0]) if mask.any() else n
        rollouts.append(Rollout(ids[i, :n], loss_mask=mask))
        prompts.append(tuple(ids[i, :start].tolist()))
    return rollouts, prompts


def pair_images(inputs: dict, model) -> list[dict | None] | None:
    """Each row's image inputs of TRL's DPO batch (`rows.row_images`; the processor repeats a pair's images for
    its chosen and rejected rows, one placeholder run per image), None without pixel_values. Raises ValueError for
    an image placeholder in a response or mm_token_type_ids that do not mark the prompt's placeholders
    (`rows.check_images_in_prompts`)."""
    if inputs.get("pixel_values") is None:
        return None
    image = base_of(model).config.image_token_id
    ids, attention, completion = (inputs[k].cpu() for k in ("input_ids", "attention_mask", "completion_mask"))
    prompt = attention.bool() & ~completion.bool()
    types = inputs.get("mm_token_type_ids")
    check_images_in_prompts(ids, prompt, completion.bool(), None if types is None else types.cpu(), image)
    return row_images(inputs, image_counts(ids, prompt, image))


def image_prompt(model, prompt: list[int], images: list[dict | None] | None, row: int) -> ImagePrompt | None:
    """The `ImagePrompt` of row `row`'s prompt, its images run by `model`; None for a row without images."""
    image = images[row] if images else None
    return None if image is None else ImagePrompt.of(model, torch.tensor(prompt), **image)
