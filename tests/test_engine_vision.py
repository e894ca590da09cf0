"""Vision-language prompts over the tree (`engine/vision.py`): a tiny vision-language model whose shared prompt
holds two images, its completions branching, against the naive reference (each rollout alone through the model's
own forward with its image inputs and token types), float64: logprobs and every parameter's gradient, the vision
tower's included; packs kept, replayed, and the prompt chunked. Two families: Gemma3 (bidirectional attention inside
an image, sliding layers) and Qwen2-VL (rotary positions on the image grid: three ids per token)."""

from dataclasses import dataclass

import pytest
import torch

from branchreplay.engine import EngineConfig, replay_backward, replay_logprobs
from branchreplay.engine.vision import ImagePrompt
from branchreplay.losses import GRPOLoss
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.tiny_models import tiny_vision_model
from branchreplay.tree import Rollout, RolloutTree
from helpers import grads, tiny_qwen2_vl_model

pytestmark = pytest.mark.usefixtures("one_thread")

IMAGE, BOI, EOI = 250, 251, 252  # both tiny models: the placeholder, and the begin / end (Qwen2-VL: vision start)
GRIDS = torch.tensor([[1, 4, 4], [1, 2, 6]])  # Qwen2-VL's images: patches (frames, height, width): 4 and 3 tokens


class WithImages(torch.nn.Module):
    """The naive reference's model: `vlm` called on each rollout alone with the prompt's image inputs and the token
    types its processor makes (1 at the image placeholders): Gemma3's token_type_ids, Qwen2-VL's mm_token_type_ids
    (from which it computes the rotary positions itself)."""

    def __init__(self, vlm, images: dict):
        super().__init__()
        self.vlm, self.images = vlm, images

    @property
    def device(self):
        return self.vlm.device

    def get_output_embeddings(self):
        return self.vlm.get_output_embeddings()

    def forward(self, input_ids, **kwargs):
        types = "token_type_ids" if self.vlm.config.model_type == "gemma3" else "mm_token_type_ids"
        return self.vlm(input_ids=input_ids, **self.images, **{types: (input_ids == IMAGE).long()}, **kwargs)


@dataclass
class Case:
    """A float64 model, its prompt's image inputs, the prompt [P] and its rollouts; `vision`: the bound on the
    vision tower's gradient (transformers computes Qwen2-VL's vision rotary in float32)."""

    model: torch.nn.Module
    images: dict
    prompt: torch.Tensor
    rollouts: list[Rollout]
    vision: float

    def tree(self, **change) -> RolloutTree:
        images = ImagePrompt.of(self.model, self.prompt, **self.images)
        for name, value in change.items():
            setattr(images, name, value)
        return RolloutTree(self.rollouts, images=images)

    def naive(self, loss):
        return naive_backward(WithImages(self.model, self.images), self.rollouts, loss)


def _rollouts(prompt: torch.Tensor, g: torch.Generator) -> list[Rollout]:
    """4 completions of the prompt: two share a 3-token stem and go on 3 tokens each (siblings of one length: the
    batched forward of leaves), lengths 6 to 7."""
    stem = torch.randint(3, 200, (3,), generator=g)
    tails = [torch.cat([stem, torch.randint(3, 200, (n,), generator=g)]) for n in (3, 3)]
    tails += [torch.randint(3, 200, (n,), generator=g) for n in (6, 7)]
    out = []
    for tail in tails:
        ids = torch.cat([prompt, tail])
        mask = torch.cat([torch.zeros(len(prompt)), torch.ones(len(tail))]).double()
        out.append(Rollout(ids, mask, advantages=float(torch.rand((), generator=g) * 2 - 1)))
    return out


def _gemma3(g: torch.Generator, keep64) -> Case:
    """Text, an image (begin, 4 placeholders, end), text, a second image, text: 21 tokens; sliding window 3 (< an
    image's 4 placeholders: the sliding layers' AND(window, OR(causal, block)) matters); pixel_values
    [2, 3, 56, 56]."""
    model = keep64(tiny_vision_model(torch.float64, sliding_window=3))
    pixel_values = torch.randn(2, 3, 56, 56, generator=g, dtype=torch.float64)
    text = lambda n: torch.randint(3, 200, (n,), generator=g)  # noqa: E731
    image = torch.tensor([BOI] + [IMAGE] * 4 + [EOI])
    prompt = torch.cat([text(3), image, text(2), image, text(4)])
    return Case(model, {"pixel_values": pixel_values}, prompt, _rollouts(prompt, g), 1e-10)


def _qwen2_vl(g: torch.Generator, keep64) -> Case:
    """Text, an image (vision start, 4 placeholders), text, a second image of another grid (3 placeholders), text:
    20 tokens; pixel_values [28, 24] (a row per patch) and image_grid_thw `GRIDS`."""
    model = keep64(tiny_qwen2_vl_model(torch.float64))
    pixel_values = torch.randn(int(GRIDS.prod(-1).sum()), 24, generator=g, dtype=torch.float64)
    text = lambda n: torch.randint(3, 200, (n,), generator=g)  # noqa: E731
    image = lambda n: torch.tensor([BOI] + [IMAGE] * n)  # noqa: E731
    prompt = torch.cat([text(3), image(4), text(2), image(3), text(6)])
    return Case(model, {"pixel_values": pixel_values, "image_grid_thw": GRIDS}, prompt, _rollouts(prompt, g), 1e-6)


FAMILIES = {"gemma3": _gemma3, "qwen2_vl": _qwen2_vl}


@pytest.fixture(params=FAMILIES.keys())
def case(request, keep64) -> Case:
    return FAMILIES[request.param](torch.Generator().manual_seed(0), keep64)


ENGINES = {"kept": EngineConfig(), "replayed": EngineConfig(replay="replay"),
           "chunked": EngineConfig(chunk_tokens=10, replay="replay")}


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_images_in_the_prompt_node_equal_the_naive_rollouts(case, engine):
    loss = GRPOLoss(beta=0.0)
    naive = case.naive(loss)
    expected = grads(case.model)
    is_vision = [name.startswith(("model.vision_tower", "model.visual")) for name, _ in case.model.named_parameters()]
    pick = lambda gs, v: [g for g, w in zip(gs, is_vision, strict=True) if w == v]  # noqa: E731
    assert all(float(g.abs().sum()) > 0 for g in pick(expected, True)[:4])  # the vision tower learns
    case.model.zero_grad(set_to_none=True)
    result = replay_backward(case.model, case.tree(), loss, engine=engine)
    assert result.stats.physical_tokens < result.stats.logical_tokens
    for ours, theirs in zip(result.logprobs, naive.logprobs, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    ours = grads(case.model)
    assert max_rel_grad_err(pick(ours, False), pick(expected, False)) <= 1e-10
    assert max_rel_grad_err(pick(ours, True), pick(expected, True)) <= case.vision
    forward = replay_logprobs(case.model, case.tree(), engine=engine)
    for ours, theirs in zip(forward.logprobs, naive.logprobs, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("wrong", ["inside-images", "other-images"])
def test_a_wrong_image_setup_is_caught(case, wrong):
    """Controls: causal attention inside Gemma3's images (no blocks), the token index as Qwen2-VL's rotary
    positions, or another prompt's pixels, must differ."""
    naive = case.naive(None)
    if wrong == "other-images":
        case.images = {**case.images, "pixel_values": case.images["pixel_values"].flip(0)}
        tree = case.tree()
    else:
        gemma3 = case.model.config.model_type == "gemma3"
        tree = case.tree(**({"blocks": None} if gemma3 else {"rope_positions": None}))
    result = replay_logprobs(case.model, tree)
    assert max(float((a - b).abs().max()) for a, b in zip(result.logprobs, naive.logprobs, strict=True)) > 1e-4


def test_chunks_that_cut_an_image_and_images_outside_the_shared_prefix_are_refused(keep64):
    case = _gemma3(torch.Generator().manual_seed(0), keep64)
    with pytest.raises(ValueError, match="chunk_tokens to at least 8"):
        replay_backward(case.model, case.tree(), GRPOLoss(), engine=EngineConfig(chunk_tokens=5))
    late = torch.cat([case.prompt, torch.tensor([IMAGE])])  # a placeholder at the completions' first position
    with pytest.raises(ValueError, match="outside the prefix"):
        RolloutTree(case.rollouts, images=ImagePrompt.of(case.model, late,
                                                         pixel_values=case.images["pixel_values"][:1]))


@pytest.mark.parametrize("wrong", ["shifted", "a-placeholder-replaced", "a-placeholder-added"])
def test_an_image_prompt_of_another_prompt_is_refused(case, wrong):
    """The tree's tokens must hold the model's image placeholder exactly where its ImagePrompt puts the features:
    made from the prompt shifted by one, with a placeholder replaced by a text token, or from the prompt while the
    rollouts hold one more placeholder, it is refused by name (the features would overwrite other tokens)."""
    at = int((case.prompt == IMAGE).nonzero()[1])
    if wrong == "shifted":
        other, rollouts = torch.cat([torch.tensor([7]), case.prompt[:-1]]), case.rollouts
    elif wrong == "a-placeholder-replaced":
        other, rollouts = case.prompt, [Rollout(torch.cat([r.token_ids[:at], torch.tensor([7]), r.token_ids[at + 1:]]),
                                                r.loss_mask, advantages=r.advantages) for r in case.rollouts]
    else:
        other, rollouts = case.prompt, [Rollout(torch.cat([torch.tensor([IMAGE]), r.token_ids[1:]]), r.loss_mask,
                                                advantages=r.advantages) for r in case.rollouts]
    with pytest.raises(ValueError, match="make the ImagePrompt from the rollouts' own prompt"):
        RolloutTree(rollouts, images=ImagePrompt.of(case.model, other, **case.images))


def test_rotary_positions_that_miss_a_placeholder_are_refused(keep64):
    case = _qwen2_vl(torch.Generator().manual_seed(0), keep64)
    assert case.tree().images.rope_delta < 0  # 7 placeholders on grids of 2 x 2 and 1 x 3 merged patches
    with pytest.raises(ValueError, match="rope_positions has shape"):
        case.tree(rope_positions=ImagePrompt.of(case.model, case.prompt, **case.images).rope_positions[:, :5])


def test_a_length_dependent_rotary_with_grid_positions_is_refused(keep64):
    """Dynamic NTK picks its frequencies from the largest position id, which the image grid moves: refused."""
    case = _qwen2_vl(torch.Generator().manual_seed(0), keep64)
    case.model.model.language_model.rotary_emb.rope_type = "dynamic"  # as rope_parameters={"rope_type": "dynamic"}
    with pytest.raises(ValueError, match="length-dependent rotary encoding"):
        replay_logprobs(case.model, case.tree())


def test_a_lora_model_reads_its_base_model(keep64):
    """`ImagePrompt.of` on a peft model (the TRL trainers' unwrapped model under LoRA) reads its base model."""
    peft = pytest.importorskip("peft", reason="peft is the lora extra (pip install -e '.[lora]')")
    case = _qwen2_vl(torch.Generator().manual_seed(0), keep64)
    naive = case.naive(None)
    lora = peft.get_peft_model(case.model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    images = ImagePrompt.of(lora, case.prompt, **case.images)
    result = replay_logprobs(lora, RolloutTree(case.rollouts, images=images))
    for ours, theirs in zip(result.logprobs, naive.logprobs,
                            strict=True):  # LoRA's B starts at zero: the base model's values
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def test_trees_with_images_are_not_sharded_across_ranks(case):
    """Data parallelism rebuilds trees per rank: with images it refuses them rather than drop them."""
    from branchreplay.engine.parallel.sharding import shard

    with pytest.raises(ValueError, match="run on one process"):
        shard([case.tree()], 2, case.model.config.get_text_config())
