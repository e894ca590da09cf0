"""Vision-language prompts: the images of a tree's shared prompt enter its prompt node, run once per tree.

A vision-language model (Gemma3ForConditionalGeneration, Qwen2-VL) replaces the input embeddings at its image
placeholder tokens by image features (the vision tower, then the projector). The placeholders sit in the prompt every
rollout shares: the engine runs the model's `language_model` with its LM head, and `ImageRun` computes a tree's
features once per replay (`ImagePrompt`: the placeholders' positions and the feature function), scatters a leaf copy
into the pack holding those positions, and after the tree's last backward back-propagates the leaf's summed gradient
through the vision tower once. Gemma3 attends bidirectionally inside an image: `blocks` gives each placeholder its
image's block id, ORed into the tree mask (`masks.tree_mask`). Qwen2-VL's multimodal rotary ("mrope"): the prompt's
position ids are computed once and every later position p has p + delta on each axis (transformers' `rope_deltas`).
A length-dependent rotary encoding (`positions.py`) with grid positions is refused.
Design notes and measurements: docs/notes/execution-stack.md.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class VisionFamily:
    """How the engine runs one vision-language model type.

    bidirectional: attends bidirectionally inside each image (Gemma3: `ImagePrompt.blocks`).
    grid_positions: rotary positions follow the image grid (Qwen2-VL's mrope: `ImagePrompt.rope_positions`).
    causal_lm: the transformers class of the language model's causal-LM view, where `AutoModelForCausalLM` has
        none for the text config (Qwen2-VL's text model is a Qwen2 decoder with multimodal rotary).
    """

    bidirectional: bool = False
    grid_positions: bool = False
    causal_lm: str | None = None


VISION_LANGUAGE = {"gemma3": VisionFamily(bidirectional=True),
                   "qwen2_vl": VisionFamily(grid_positions=True, causal_lm="Qwen2ForCausalLM")}
"""The vision-language model types the engine runs."""

_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # vision-language model -> its causal-LM view


def is_vision_language(model) -> bool:
    """Whether `model` is a transformers vision-language model (a config with a vision_config, `get_image_features`)."""
    return hasattr(model, "get_image_features") and getattr(model.config, "vision_config", None) is not None


def check_vision_language(model) -> None:
    """Raises UnsupportedModelError (naming the model type) for a vision-language model the engine does not run."""
    from .families import UnsupportedModelError

    model_type = model.config.model_type
    if model_type not in VISION_LANGUAGE:
        raise UnsupportedModelError(
            f"vision-language model '{model_type}' is not run over trees (supported: "
            f"{', '.join(sorted(VISION_LANGUAGE))}): its image placeholders, attention inside an image and rotary "
            "positions have not been checked against its own forward")


def language_model(model):
    """The causal LM the engine runs for `model`: a vision-language model's language model with its LM head, as a
    `*ForCausalLM` of its text config whose modules ARE the model's (built on the meta device, then given the
    model's decoder and head: nothing is copied, gradients land in the model's parameters); kept per model. Any
    other model is returned as it is. Raises UnsupportedModelError for a vision-language model not supported."""
    if not is_vision_language(model):
        return model
    view = _views.get(model)
    if view is None:
        import transformers
        from transformers import AutoModelForCausalLM

        check_vision_language(model)
        text_config = model.config.get_text_config()
        causal_lm = VISION_LANGUAGE[model.config.model_type].causal_lm
        with torch.device("meta"):
            view = AutoModelForCausalLM.from_config(text_config) if causal_lm is None else \
                getattr(transformers, causal_lm)(text_config)
        view.config = text_config
        setattr(view, view.base_model_prefix, model.model.language_model)
        view.lm_head = model.lm_head
        _views[model] = view
    view.train(model.training)
    return view


@dataclasses.dataclass
class ImagePrompt:
    """The images of a tree's shared prompt (`RolloutTree(..., images=)`).

    positions: [n] int64, the absolute positions of the image placeholder tokens, all inside the prefix every
        rollout of the tree shares (its first node).
    features: () -> [n, H], the image features at those positions, in order (the vision tower and projector of the
        model being trained, differentiable: the engine calls it once per replay, under the replay's grad mode).
    blocks: [n] int64, each position's image (block) id for bidirectional attention inside an image (Gemma3), or
        None for causal attention everywhere.
    rope_positions: [3, P] int64, the rotary position ids (temporal, height, width) of the prompt's P positions
        where they follow the image grid (Qwen2-VL), else None (a token's rotary position is its index).
    rope_delta: with `rope_positions`, a position p >= P has rotary position p + rope_delta on every axis.
    model: the vision-language model whose vision tower `features` runs (`of` sets it); the engine refuses to run
        the tree with another model (a reference model needs its own `ImagePrompt`).
    """

    positions: torch.Tensor
    features: Callable[[], torch.Tensor]
    blocks: torch.Tensor | None = None
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    model: object = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, model, prompt_ids: torch.Tensor, **image_inputs) -> ImagePrompt:
        """The `ImagePrompt` of one unpadded prompt `prompt_ids` [P] for vision-language `model`, from its
        processor's image outputs for that prompt (Gemma3: `pixel_values` [num_images, 3, H, W]; Qwen2-VL:
        `pixel_values` [patches, C * T * patch * patch] and `image_grid_thw` [num_images, 3]): placeholders where
        the ids equal config.image_token_id; blocks from their contiguous runs (transformers'
        `get_block_sequence_ids_for_mask`) where the model attends bidirectionally inside an image; the prompt's
        rotary positions from the model's `get_rope_index` where they follow the image grid.
        `model` may be a peft `PeftModel` (its base model is read). Raises UnsupportedModelError for an unsupported
        vision-language model."""
        from ..models import base_of

        model = base_of(model)
        check_vision_language(model)
        family = VISION_LANGUAGE[model.config.model_type]
        is_image = prompt_ids == model.config.image_token_id
        positions = is_image.nonzero().squeeze(1)
        blocks, rope_positions, rope_delta = None, None, 0
        if family.bidirectional:
            starts = is_image & ~torch.cat([torch.zeros(1, dtype=torch.bool), is_image[:-1]])
            blocks = (torch.cumsum(starts.long(), 0) - 1)[positions]
        if family.grid_positions:  # mm_token_type_ids: 1 at image placeholders, as the processor makes them
            ids, deltas = model.model.get_rope_index(prompt_ids[None], mm_token_type_ids=is_image.int()[None],
                                                     image_grid_thw=image_inputs.get("image_grid_thw"))
            rope_positions, rope_delta = ids[:, 0].cpu(), int(deltas.reshape(-1)[0])

        def features() -> torch.Tensor:
            out = model.get_image_features(**image_inputs, return_dict=True).pooler_output
            out = torch.cat(out) if isinstance(out, (tuple, list)) else out  # Qwen2-VL: one tensor per image
            return out.reshape(-1, out.shape[-1])

        return cls(positions, features, blocks, rope_positions, rope_delta, model)

    def check(self, shared: torch.Tensor) -> None:
        """Raises ValueError when a placeholder lies outside `shared` [S] (the ids of the prefix all the tree's
        rollouts share), when the model's image token (config.image_token_id, where `of` set the model) is not at
        exactly `positions` in it (an ImagePrompt made from another prompt: shifted, or a placeholder replaced),
        or when `blocks` or `rope_positions` does not match `positions`."""
        shared_length = len(shared)
        if self.positions.numel() and int(self.positions.max()) >= shared_length:
            raise ValueError(f"an image placeholder at position {int(self.positions.max())} lies outside the prefix "
                             f"all the tree's rollouts share ({shared_length} tokens): the rollouts of one tree must "
                             "share the prompt that holds the images (one tree per prompt and images)")
        token = getattr(getattr(self.model, "config", None), "image_token_id", None)
        if token is not None:
            wrong = (shared[self.positions] != token).nonzero()
            if len(wrong):
                at = int(self.positions[int(wrong[0])])
                raise ValueError(f"the tree's token at image position {at} is {int(shared[at])}, not the image "
                                 f"placeholder {token}: make the ImagePrompt from the rollouts' own prompt "
                                 "(ImagePrompt.of(model, prompt_ids, ...))")
            count = int((shared == token).sum())
            if count != self.positions.numel():
                raise ValueError(f"the tree's shared prompt holds {count} image placeholders where its ImagePrompt "
                                 f"places {self.positions.numel()}: make the ImagePrompt from the rollouts' own "
                                 "prompt (ImagePrompt.of(model, prompt_ids, ...))")
        if self.blocks is not None and self.blocks.shape != self.positions.shape:
            raise ValueError(f"ImagePrompt.blocks has shape {tuple(self.blocks.shape)}, positions "
                             f"{tuple(self.positions.shape)}: one block id per placeholder")
        rope = self.rope_positions
        if rope is not None and (rope.dim() != 2 or rope.shape[0] != 3
                                 or (self.positions.numel() and rope.shape[1] <= int(self.positions.max()))):
            raise ValueError(f"ImagePrompt.rope_positions has shape {tuple(rope.shape)}: [3, P], the rotary "
                             "position ids of a prompt that holds every placeholder")


class ImageRun:
    """A tree's image features during one replay: computed once (with a graph when training), given to the packs as
    a leaf, whose gradient (summed over the packs that read it) `backward` sends through the vision tower once."""

    def __init__(self, images: ImagePrompt, train: bool, dtype: torch.dtype, device: torch.device):
        with torch.set_grad_enabled(train):
            self.features = images.features().to(device=device, dtype=dtype)  # [n, H], as transformers casts them
        if self.features.shape[0] != images.positions.numel():
            raise ValueError(f"the images give {self.features.shape[0]} feature rows for "
                             f"{images.positions.numel()} placeholder tokens in the prompt")
        self.leaf = self.features.detach().requires_grad_(train)
        self.row = {int(p): k for k, p in enumerate(images.positions)}  # absolute position -> feature row
        self.block = {} if images.blocks is None else {int(p): int(b) for p, b in zip(images.positions,
                                                                                      images.blocks, strict=True)}
        self.rope = None if images.rope_positions is None else images.rope_positions.to(device)
        self.rope_delta = images.rope_delta

    def covers(self, start: int, end: int) -> bool:
        """Whether absolute positions [start, end) hold a placeholder."""
        return any(start <= p < end for p in self.row)

    def embeds(self, embedding: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The input embeddings [S, H] of tokens [S] at absolute `positions` [S]: `embedding(tokens)` with the
        placeholders' rows replaced by the features (the embedding's gradient there is zero, as in transformers'
        `masked_scatter`). A placeholder id outside the vocabulary is looked up as 0, as transformers does."""
        at = [k for k, p in enumerate(positions.tolist()) if p in self.row]
        index = torch.tensor(at, dtype=torch.long, device=tokens.device)
        rows = torch.tensor([self.row[int(positions[k])] for k in at], dtype=torch.long, device=tokens.device)
        vocab = embedding.weight.shape[0]
        embeds = embedding(torch.where(tokens < vocab, tokens, torch.zeros_like(tokens)))
        return embeds.index_put((index,), self.leaf[rows].to(embeds.dtype))

    def rope_positions(self, positions: torch.Tensor) -> torch.Tensor | None:
        """[3, S] int64 the rotary position ids of absolute `positions` [S] where they follow the image grid (the
        prompt's from `ImagePrompt.rope_positions`, later ones p + rope_delta), None where they are the index."""
        if self.rope is None:
            return None
        inside = positions < self.rope.shape[1]
        out = (positions + self.rope_delta).expand(3, -1).clone()
        out[:, inside] = self.rope[:, positions[inside]]
        return out

    def blocks(self, positions: torch.Tensor) -> torch.Tensor | None:
        """[S] the image block id of each absolute position (-1 for text), None without bidirectional images."""
        if not self.block:
            return None
        return torch.tensor([self.block.get(p, -1) for p in positions.tolist()], device=positions.device)

    def check_chunks(self, boundaries: list[int]) -> None:
        """Raises ValueError when a node boundary (absolute positions where the tree's prompt is cut into chunks)
        falls inside a bidirectional image block: its first part would have to see keys of the next chunk."""
        by_block: dict[int, list[int]] = {}
        for p, b in self.block.items():
            by_block.setdefault(b, []).append(p)
        for b, members in by_block.items():
            lo, hi = min(members), max(members)
            cut = next((c for c in boundaries if lo < c <= hi), None)
            if cut is not None:
                raise ValueError(f"image block {b} (positions {lo}..{hi}) is cut at position {cut} by chunking: "
                                 f"raise EngineConfig.chunk_tokens to at least {hi + 1} tokens")

    def backward(self) -> None:
        """Send the leaf's summed gradient through the vision tower and projector (once per tree)."""
        if self.leaf.grad is not None and self.features.requires_grad:
            torch.autograd.backward(self.features, self.leaf.grad)
