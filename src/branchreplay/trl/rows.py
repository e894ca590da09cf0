"""TRL's padded micro-batch as rollouts, and the tree's per-rollout values back as TRL's rows.

TRL's GRPO and RLOO batches hold left-padded prompts `prompt_ids` / `prompt_mask` [B, P] and right-padded completions
`completion_ids` / `completion_mask` [B, C] (the mask runs up to the first EOS); a row's rollout is its unpadded
prompt followed by its completion, and the rows of one prompt make one tree.
"""

from __future__ import annotations

import itertools

import torch

from ..engine.vision import ImagePrompt
from ..tree import Rollout, RolloutTree


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  images: list[dict | None] | None = None) -> list[list[int]]:
    """Rows of a left-padded [B, P] prompt batch grouped by their unpadded prompt (and their images, `row_images`:
    equal placeholder tokens with other pixels or grids are another prompt), in order of first appearance: one
    rollout tree per group."""
    groups: dict[tuple, list[int]] = {}
    for i, (ids, keep) in enumerate(zip(prompt_ids.tolist(), prompt_mask.tolist(), strict=True)):
        key = (tuple(t for t, k in zip(ids, keep, strict=True) if k),
               image_key(images[i] if images is not None else None))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def image_key(images: dict | None) -> tuple | None:
    """A hashable key of one row's image inputs (`row_images`): equal for equal tensors, None without images."""
    if images is None:
        return None
    return tuple((name, tuple(v.shape), v.cpu().numpy().tobytes()) for name, v in sorted(images.items()))


REFUSED_IMAGE_KEYS = ("pixel_attention_mask", "spatial_shapes", "image_sizes", "image_position_ids", "num_tiles",
                      "pixel_values_videos", "video_grid_thw")
"""The image and video inputs of other vision-language models, refused by name. The tree reads pixel_values with
num_images (Gemma3), and image_grid_thw and mm_token_type_ids (Qwen2-VL)."""


def row_images(inputs: dict, counts: list[int] | None = None) -> list[dict | None] | None:
    """Each row's image inputs of a vision-language batch, as TRL splits them (`_get_per_token_logps_and_entropies`:
    `counts` images per row, default the batch's `num_images`; pixel_values one row per image, or, with
    image_grid_thw [num_images, 3], t * h * w rows per image), None for a row without images: {"pixel_values":
    [n_i, ...], "image_grid_thw": [images_i, 3] where the batch has it}; None for a batch without images. Raises
    ValueError for an image input the tree does not read, or pixel_values whose rows do not match the images."""
    if inputs.get("pixel_values") is None:
        return None
    other = [key for key in REFUSED_IMAGE_KEYS if inputs.get(key) is not None]
    if other:
        raise ValueError(f"the batch carries {', '.join(other)}: only vision-language models whose images are "
                         "pixel_values (Gemma3), with image_grid_thw (Qwen2-VL), run over trees")
    pixels, grids = inputs["pixel_values"], inputs.get("image_grid_thw")
    counts = counts or inputs.get("num_images") or [1] * inputs["prompt_ids"].shape[0]
    image_starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
    rows = [1] * sum(counts) if grids is None else grids.prod(-1).tolist()  # pixel rows per image
    if grids is not None and grids.shape[0] != sum(counts):
        raise ValueError(f"image_grid_thw has {grids.shape[0]} rows for {sum(counts)} images (num_images)")
    row_starts = [0, *torch.tensor(rows).cumsum(0).tolist()]
    if pixels.shape[0] != row_starts[-1]:
        raise ValueError(f"pixel_values has {pixels.shape[0]} rows for {sum(counts)} images (num_images"
                         f"{', image_grid_thw' if grids is not None else ''}): {row_starts[-1]} expected")
    out = []
    for a, b in itertools.pairwise(image_starts):
        row = None if b == a else {"pixel_values": pixels[row_starts[a]:row_starts[b]]}
        if row is not None and grids is not None:
            row["image_grid_thw"] = grids[a:b]
        out.append(row)
    return out


def image_counts(ids: torch.Tensor, keep: torch.Tensor, image_token_id: int) -> list[int]:
    """[R] the images of each row of ids [R, S] where keep [R, S] (its prompt): the runs of consecutive image
    placeholders (TRL's DPO batch has no num_images: its processor expands one placeholder run per image)."""
    is_image = (ids == image_token_id) & keep.bool()
    starts = is_image & ~torch.nn.functional.pad(is_image[:, :-1], (1, 0))
    return starts.sum(1).tolist()


def check_images_in_prompts(ids: torch.Tensor, prompt: torch.Tensor, completion: torch.Tensor,
                            types: torch.Tensor | None, image_token_id: int) -> None:
    """Raises ValueError when a completion holds an image placeholder (a tool's image; the tree's images sit in the
    prompt), or the batch's mm_token_type_ids `types` are not 1 exactly at the prompt's placeholders and 0
    elsewhere in it (the tree places the images by the id). ids, types [R, S]; prompt, completion [R, S] bool,
    each row's prompt and completion positions."""
    if bool(((ids == image_token_id) & completion).any()):
        raise ValueError(f"a completion holds image placeholders (id {image_token_id}): images inside completions "
                         "(a tool's images) are not run over trees; the tree's images sit in the shared prompt")
    if types is not None and not torch.equal(types.to(ids.device)[prompt],
                                             (ids == image_token_id).to(types.dtype)[prompt]):
        raise ValueError("mm_token_type_ids marks other prompt positions than the image placeholders "
                         f"(image_token_id {image_token_id}; videos are not run over trees)")


def trained_mask(inputs: dict) -> torch.Tensor:
    """[B, C] the completion positions TRL's loss trains: completion_mask, times tool_mask where the batch has one
    (tool results inside a completion)."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


def prompt_trees(inputs: dict, rollouts: list[Rollout], model=None) -> tuple[list[RolloutTree], list[int]]:
    """One tree per prompt of the batch (`prompt_groups`) and the row of each of their rollouts, in the trees'
    order (what a `ReplayResult` over them lists). A vision-language batch's trees carry their prompt's images
    (`engine.vision.ImagePrompt` of `model`, the unwrapped vision-language model)."""
    images = row_images(inputs)
    if images is not None:
        P = inputs["prompt_ids"].shape[1]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        prompt = torch.cat([inputs["prompt_mask"].bool(), torch.zeros_like(inputs["completion_mask"], dtype=bool)], 1)
        completion = torch.cat([torch.zeros_like(prompt[:, :P]), inputs["completion_mask"].bool()], 1)
        types = inputs.get("mm_token_type_ids")  # TRL's: the prompt's, then zeros over the completion
        if types is not None:
            types = torch.nn.functional.pad(types, (0, max(ids.shape[1] - types.shape[1], 0)))[:, :ids.shape[1]]
        check_images_in_prompts(ids, prompt, completion, types, model.config.image_token_id)
    groups = prompt_groups(inputs["prompt_ids"], inputs["prompt_mask"], images)
    trees = []
    for group in groups:
        first = group[0]
        image = images[first] if images is not None else None
        prompt = None if image is None else \
            ImagePrompt.of(model, inputs["prompt_ids"][first][inputs["prompt_mask"][first].bool()].cpu(), **image)
        trees.append(RolloutTree([rollouts[i] for i in group], images=prompt))
    return trees, [i for group in groups for i in group]


def in_row_order(values: list, order: list[int]) -> list:
    """Per-rollout values in the trees' order (row `order[k]` is the k-th) -> in TRL's row order."""
    out = [None] * len(order)
    for k, i in enumerate(order):
        out[i] = values[k]
    return out


def batch_rollouts(inputs: dict, mask: torch.Tensor, ratio: torch.Tensor | None = None
                   ) -> tuple[list[Rollout], list[int]]:
    """TRL's padded micro-batch as unpadded rollouts, one per row: the prompt ids where `prompt_mask` is 1, then the
    completion's ids (the leading ones of `completion_mask`, TRL's mask up to the first EOS); loss mask `mask`
    [B, C] (completion_mask x tool_mask) on the completion; advantages [B] or [B, C], old and reference logprobs
    [B, C] moved onto the completion's positions (those the batch has); and each row's completion length (tokens).
    `ratio` ([B, C] or [B, 1], >= 0): vLLM's importance-sampling weights, which TRL multiplies into each token's
    policy term (not the KL, not the entropy bonus): the term is linear in the advantage, so they go into the
    advantages. The weights are the caller's. Raises ValueError for a completion_mask with a gap (a zero before a
    one)."""
    prompt_ids, prompt_mask = inputs["prompt_ids"].cpu(), inputs["prompt_mask"].cpu().bool()
    completion_ids, completion_mask, mask = inputs["completion_ids"].cpu(), inputs["completion_mask"].cpu(), mask.cpu()
    B, C = completion_ids.shape
    advantages = inputs["advantages"].cpu()
    advantages = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(B, C)
    if ratio is not None:
        advantages = advantages * ratio.cpu().expand(B, C)
    old, ref = inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps")
    rollouts, lengths = [], []
    for i in range(B):
        n = int(completion_mask[i].sum())
        if n and not bool(completion_mask[i, :n].all()):
            raise ValueError(f"completion_mask row {i} has a gap: the tree trainers need each row's completion "
                             "first, then padding (tool results are masked out by tool_mask)")
        prompt = prompt_ids[i][prompt_mask[i]]
        T = len(prompt) + n
        rollouts.append(Rollout(
            torch.cat([prompt, completion_ids[i, :n]]),
            loss_mask=torch.cat([torch.zeros(len(prompt)), mask[i, :n].float()]),
            advantages=on_rollout(advantages[i], T, n),
            old_logprobs=None if old is None else on_rollout(old[i].cpu(), T, n),
            ref_logprobs=None if ref is None else on_rollout(ref[i].cpu(), T, n)))
        lengths.append(n)
    return rollouts, lengths


def on_rollout(values: torch.Tensor, T: int, n: int) -> torch.Tensor:
    """[C] values of a padded row's completion as [T] float64 on the positions of its rollout of T tokens whose
    last n are the completion: 0 on the prompt."""
    return torch.cat([torch.zeros(T - n, dtype=torch.float64), values[:n].double()])


def on_rows(values: list[torch.Tensor], rollouts: list[Rollout], lengths: list[int], keep: torch.Tensor,
            fill: torch.Tensor) -> torch.Tensor:
    """The inverse of `batch_rollouts` for per-rollout values: `values[i]` [T_i] of row i's rollout (the completion
    its last lengths[i] positions) -> [B, C] float64 (differentiable), `fill` [B, C] where `keep` [B, C] is False
    (padding, and positions the loss does not read)."""
    C = keep.shape[1]
    padded = torch.stack([torch.cat([v[len(r) - n:].double(), v.new_zeros(C - n, dtype=torch.float64)])
                          for v, r, n in zip(values, rollouts, lengths, strict=True)])
    return torch.where(keep.to(padded.device), padded, fill.to(padded))
