"""Vision-language prompts over the tree (`engine/vision.py`): a tiny Gemma3ForConditionalGeneration whose shared
prompt holds two images, its completions branching, against the naive reference (each rollout alone through the
model's own forward with its pixel_values and token_type_ids), float64: logprobs and every parameter's gradient,
the vision tower's included; packs kept, replayed, and the prompt chunked."""

import pytest
import torch

from branchreplay.check.reference import max_rel_grad_err, naive_backward
from branchreplay.engine import EngineConfig, replay_backward, replay_logprobs
from branchreplay.engine.vision import ImagePrompt
from branchreplay.losses import GRPOLoss
from branchreplay.models import tiny_vision_model
from branchreplay.tree import Rollout, RolloutTree
from conftest import grads

pytestmark = pytest.mark.usefixtures("one_thread")

IMAGE, BOI, EOI = 250, 251, 252


class WithImages(torch.nn.Module):
    """The naive reference's model: `vlm` called on each rollout alone with the prompt's pixel_values and the
    token_type_ids Gemma3's processor makes (1 at the image placeholders)."""

    def __init__(self, vlm, pixel_values):
        super().__init__()
        self.vlm, self.pixel_values = vlm, pixel_values

    @property
    def device(self):
        return self.vlm.device

    def get_output_embeddings(self):
        return self.vlm.get_output_embeddings()

    def forward(self, input_ids, **kwargs):
        return self.vlm(input_ids=input_ids, pixel_values=self.pixel_values,
                        token_type_ids=(input_ids == IMAGE).long(), **kwargs)


def _prompt(g: torch.Generator) -> torch.Tensor:
    """Text, an image (begin, 4 placeholders, end), text, a second image, text: 21 tokens."""
    text = lambda n: torch.randint(3, 200, (n,), generator=g)  # noqa: E731
    image = torch.tensor([BOI] + [IMAGE] * 4 + [EOI])
    return torch.cat([text(3), image, text(2), image, text(4)])


def _rollouts(prompt: torch.Tensor, g: torch.Generator) -> list[Rollout]:
    """4 completions of the prompt: two share a 3-token stem, lengths 5 to 7."""
    stem = torch.randint(3, 200, (3,), generator=g)
    tails = [torch.cat([stem, torch.randint(3, 200, (n,), generator=g)]) for n in (2, 4)]
    tails += [torch.randint(3, 200, (n,), generator=g) for n in (6, 7)]
    out = []
    for tail in tails:
        ids = torch.cat([prompt, tail])
        mask = torch.cat([torch.zeros(len(prompt)), torch.ones(len(tail))]).double()
        out.append(Rollout(ids, mask, advantages=float(torch.rand((), generator=g) * 2 - 1)))
    return out


@pytest.fixture
def case(keep64):
    """(model, pixel_values [2, 3, 56, 56], rollouts, prompt) in float64; sliding window 3 (< an image's 4
    placeholders: the sliding layers' AND(window, OR(causal, block)) matters)."""
    g = torch.Generator().manual_seed(0)
    model = keep64(tiny_vision_model(torch.float64, sliding_window=3))
    pixel_values = torch.randn(2, 3, 56, 56, generator=g, dtype=torch.float64)
    prompt = _prompt(g)
    return model, pixel_values, _rollouts(prompt, g), prompt


def _tree(model, pixel_values, rollouts, prompt, **change) -> RolloutTree:
    images = ImagePrompt.of(model, prompt, pixel_values=pixel_values)
    for name, value in change.items():
        setattr(images, name, value)
    return RolloutTree(rollouts, images=images)


ENGINES = {"kept": EngineConfig(), "replayed": EngineConfig(replay="replay"),
           "chunked": EngineConfig(chunk_tokens=10, replay="replay")}


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_images_in_the_prompt_node_equal_the_naive_rollouts(case, engine):
    model, pixel_values, rollouts, prompt = case
    loss = GRPOLoss(beta=0.0)
    naive = naive_backward(WithImages(model, pixel_values), rollouts, loss)
    expected = grads(model)
    vision = [g for (name, _), g in zip(model.named_parameters(), expected) if "vision_tower" in name]
    assert all(float(g.abs().sum()) > 0 for g in vision[:4])  # the vision tower learns
    model.zero_grad(set_to_none=True)
    result = replay_backward(model, _tree(model, pixel_values, rollouts, prompt), loss, engine=engine)
    assert result.stats.physical_tokens < result.stats.logical_tokens
    for ours, theirs in zip(result.logprobs, naive.logprobs):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    assert max_rel_grad_err(grads(model), expected) <= 1e-10
    forward = replay_logprobs(model, _tree(model, pixel_values, rollouts, prompt), engine=engine)
    for ours, theirs in zip(forward.logprobs, naive.logprobs):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("wrong", ["causal", "other-images"])
def test_a_wrong_image_setup_is_caught(case, wrong):
    """Controls: causal attention inside the images (no blocks), or another prompt's pixels, must differ."""
    model, pixel_values, rollouts, prompt = case
    naive = naive_backward(WithImages(model, pixel_values), rollouts, None)
    pixels = pixel_values.flip(0) if wrong == "other-images" else pixel_values
    tree = _tree(model, pixels, rollouts, prompt, **({"blocks": None} if wrong == "causal" else {}))
    result = replay_logprobs(model, tree)
    assert max(float((a - b).abs().max()) for a, b in zip(result.logprobs, naive.logprobs)) > 1e-4


def test_chunks_that_cut_an_image_and_images_outside_the_shared_prefix_are_refused(case):
    model, pixel_values, rollouts, prompt = case
    with pytest.raises(ValueError, match="chunk_tokens to at least 8"):
        replay_backward(model, _tree(model, pixel_values, rollouts, prompt), GRPOLoss(),
                        engine=EngineConfig(chunk_tokens=5))
    late = torch.cat([prompt, torch.tensor([IMAGE])])  # a placeholder at the completions' first position
    with pytest.raises(ValueError, match="outside the prefix"):
        RolloutTree(rollouts, images=ImagePrompt.of(model, late, pixel_values=pixel_values[:1]))


def test_trees_with_images_are_not_sharded_across_ranks(case):
    """Data parallelism rebuilds trees per rank: with images it refuses them rather than drop them."""
    from branchreplay.engine.sharding import shard

    model, pixel_values, rollouts, prompt = case
    with pytest.raises(ValueError, match="run on one process"):
        shard([_tree(model, pixel_values, rollouts, prompt)], 2, model.config.get_text_config())
