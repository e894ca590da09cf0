"""The LM head's own transforms (engine/head.py): every final-logit transform of a ForCausalLM forward is applied by
the engine's head, and one it does not know is refused by name instead of run.

Reference: `naive_backward` (the model's own ForCausalLM forward on each rollout alone). On the main branch before
the fix, Granite's `logits_scaling` was ignored under `force`: gradient error 8.9, logprob error 5.0 nats.
"""

import pytest
import torch
from transformers import CohereConfig, CohereForCausalLM, GraniteConfig, GraniteForCausalLM

from branchreplay.check.reference import max_rel_grad_err, naive_backward
from branchreplay.check.shapes import make_rollouts, shared_prompt
from branchreplay.engine import replay_backward, replay_logprobs
from branchreplay.engine.head import HeadMismatchError, LogitTransform, decoder_and_head
from branchreplay.losses import GRPOLoss
from branchreplay.models import tiny_model
from branchreplay.tree import RolloutTree
from conftest import grads

TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, initializer_range=0.2, pad_token_id=0)



MODELS = {
    "granite": lambda: GraniteForCausalLM(GraniteConfig(**TINY, logits_scaling=8.0, embedding_multiplier=4.0,
                                                        residual_multiplier=0.5, attention_multiplier=0.25)),
    "cohere": lambda: CohereForCausalLM(CohereConfig(**TINY, logit_scale=0.25)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logit_scaling_of_unregistered_families_is_applied(name, keep64):
    torch.manual_seed(0)
    model = keep64(MODELS[name]().double().eval())
    g = torch.Generator().manual_seed(1)
    rollouts = make_rollouts(shared_prompt(24, 4, 20, 256, g), g)
    loss = GRPOLoss(entropy_coef=0.01)
    model.zero_grad(set_to_none=True)
    naive = naive_backward(model, rollouts, loss)
    g_naive = grads(model)
    model.zero_grad(set_to_none=True)
    replay = replay_backward(model, RolloutTree(rollouts), loss, force=True)
    lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive.logprobs))
    grad_err = max_rel_grad_err(grads(model), g_naive)
    assert grad_err <= 1e-6 and lp_err <= 1e-9, (grad_err, lp_err)
    assert decoder_and_head(model)[2] != LogitTransform()


def test_an_unknown_logit_transform_is_refused_by_name():
    """A ForCausalLM that changes its logits in a way the head does not read fails the engine's first-use check."""
    model = tiny_model("llama")
    forward = type(model).forward

    def shifted(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 3.0
        return out

    model.forward = shifted.__get__(model)
    g = torch.Generator().manual_seed(2)
    with pytest.raises(HeadMismatchError, match="llama: .*relative difference"):
        replay_logprobs(model, RolloutTree(make_rollouts(shared_prompt(8, 2, 4, 256, g), g)))


def test_transform_order_and_neutral_values():
    logits = torch.tensor([[3.0, -6.0]], dtype=torch.float64)
    assert torch.equal(LogitTransform()(logits), logits)
    out = LogitTransform(multiplier=2.0, divisor=4.0, softcap=1.0)(logits)
    torch.testing.assert_close(out, torch.tanh(logits * 2.0 / 4.0))
