"""Qwen2-VL prompts over the tree (`engine/vision.py`): rotary positions on the image grid (multimodal rotary,
"mrope"). A tiny Qwen2VLForConditionalGeneration whose shared prompt holds two images of different grids, its
completions branching, against the naive reference (each rollout alone through the model's own forward with its
pixel_values, image_grid_thw and mm_token_type_ids, which computes the 3-D positions itself), float64: logprobs and
every parameter's gradient, the vision tower's included; packs kept, replayed, and the prompt chunked."""

import pytest
import torch

from branchreplay.check.reference import max_rel_grad_err, naive_backward
from branchreplay.engine import EngineConfig, replay_backward, replay_logprobs
from branchreplay.engine.vision import ImagePrompt
from branchreplay.losses import GRPOLoss
from branchreplay.models import tiny_qwen2_vl_model
from branchreplay.tree import Rollout, RolloutTree
from conftest import grads

pytestmark = pytest.mark.usefixtures("one_thread")

IMAGE, START = 250, 251
GRIDS = torch.tensor([[1, 4, 4], [1, 2, 6]])  # patches (frames, height, width): 4 and 3 placeholder tokens


class WithImages(torch.nn.Module):
    """The naive reference's model: `vlm` on each rollout alone with the prompt's images and the mm_token_type_ids
    Qwen2-VL's processor makes (1 at the image placeholders)."""

    def __init__(self, vlm, pixel_values):
        super().__init__()
        self.vlm, self.pixel_values = vlm, pixel_values

    @property
    def device(self):
        return self.vlm.device

    def get_output_embeddings(self):
        return self.vlm.get_output_embeddings()

    def forward(self, input_ids, **kwargs):
        return self.vlm(input_ids=input_ids, pixel_values=self.pixel_values, image_grid_thw=GRIDS,
                        mm_token_type_ids=(input_ids == IMAGE).int(), **kwargs)


def _rollouts(g: torch.Generator) -> tuple[torch.Tensor, list[Rollout]]:
    """A prompt (text, an image, text, a second image, text: 20 tokens) and 4 completions, two sharing a stem."""
    text = lambda n: torch.randint(3, 200, (n,), generator=g)  # noqa: E731
    image = lambda n: torch.tensor([START] + [IMAGE] * n)  # noqa: E731
    prompt = torch.cat([text(3), image(4), text(2), image(3), text(6)])
    stem = text(3)
    tails = [torch.cat([stem, text(2)]), torch.cat([stem, text(4)]), text(6), text(7)]
    rollouts = [Rollout(torch.cat([prompt, t]), torch.cat([torch.zeros(len(prompt)), torch.ones(len(t))]).double(),
                        advantages=float(torch.rand((), generator=g) * 2 - 1)) for t in tails]
    return prompt, rollouts


@pytest.fixture
def case(keep64):
    """(model, pixel_values [28, 24], prompt, rollouts) in float64."""
    g = torch.Generator().manual_seed(0)
    model = keep64(tiny_qwen2_vl_model(torch.float64))
    pixel_values = torch.randn(int(GRIDS.prod(-1).sum()), 24, generator=g, dtype=torch.float64)
    return (model, pixel_values, *_rollouts(g))


def _tree(model, pixel_values, prompt, rollouts, **change) -> RolloutTree:
    images = ImagePrompt.of(model, prompt, pixel_values=pixel_values, image_grid_thw=GRIDS)
    for name, value in change.items():
        setattr(images, name, value)
    return RolloutTree(rollouts, images=images)


ENGINES = {"kept": EngineConfig(), "replayed": EngineConfig(replay="replay"),
           "chunked": EngineConfig(chunk_tokens=6, replay="replay")}


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_grid_positions_in_the_prompt_node_equal_the_naive_rollouts(case, engine):
    model, pixel_values, prompt, rollouts = case
    loss = GRPOLoss(beta=0.0)
    naive = naive_backward(WithImages(model, pixel_values), rollouts, loss)
    expected = grads(model)
    vision = [g for (name, _), g in zip(model.named_parameters(), expected) if "visual" in name]
    assert vision and all(float(g.abs().sum()) > 0 for g in vision[:4])  # the vision tower learns
    model.zero_grad(set_to_none=True)
    tree = _tree(model, pixel_values, prompt, rollouts)
    assert tree.images.rope_delta < 0  # 7 placeholders on grids of 2 x 2 and 1 x 3 merged patches
    result = replay_backward(model, tree, loss, engine=engine)
    assert result.stats.physical_tokens < result.stats.logical_tokens
    for ours, theirs in zip(result.logprobs, naive.logprobs):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    # transformers runs the vision tower's rotary in float32 (`apply_rotary_pos_emb_vision` casts q and k), so its
    # gradient, summed once over the completions here and per rollout in the reference, agrees to that rounding
    ours = grads(model)
    is_vision = ["visual" in name for name, _ in model.named_parameters()]
    pick = lambda gs, v: [g for g, w in zip(gs, is_vision) if w == v]  # noqa: E731
    assert max_rel_grad_err(pick(ours, False), pick(expected, False)) <= 1e-10
    assert max_rel_grad_err(pick(ours, True), pick(expected, True)) <= 1e-6
    forward = replay_logprobs(model, _tree(model, pixel_values, prompt, rollouts), engine=engine)
    for ours, theirs in zip(forward.logprobs, naive.logprobs):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def test_index_positions_are_caught(case):
    """Control: the token index as the rotary position (what the engine did for text models) must differ."""
    model, pixel_values, prompt, rollouts = case
    naive = naive_backward(WithImages(model, pixel_values), rollouts, None)
    result = replay_logprobs(model, _tree(model, pixel_values, prompt, rollouts, rope_positions=None))
    assert max(float((a - b).abs().max()) for a, b in zip(result.logprobs, naive.logprobs)) > 1e-4


def test_rotary_positions_that_miss_a_placeholder_are_refused(case):
    model, pixel_values, prompt, rollouts = case
    images = ImagePrompt.of(model, prompt, pixel_values=pixel_values, image_grid_thw=GRIDS)
    images.rope_positions = images.rope_positions[:, :5]
    with pytest.raises(ValueError, match="rope_positions has shape"):
        RolloutTree(rollouts, images=images)
