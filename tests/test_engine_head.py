"""The LM head's own transforms (engine/head.py): every final-logit transform of a ForCausalLM forward is applied by
the engine's head, and one it does not know is refused by name instead of run.

Reference: `naive_backward` (the model's own ForCausalLM forward on each rollout alone). On the main branch before
the fix, Granite's `logits_scaling` was ignored under `force`: gradient error 8.9, logprob error 5.0 nats.
"""

import pytest
import torch
from transformers import CohereConfig, CohereForCausalLM, GraniteConfig, GraniteForCausalLM

from branchreplay.engine import replay_backward, replay_logprobs
from branchreplay.engine.head import HeadMismatchError, LogitTransform, decoder_and_head
from branchreplay.losses import GRPOLoss
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.reference.shapes import make_rollouts, shared_prompt
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import Rollout, RolloutTree
from helpers import grads

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
    replay = replay_backward(model, RolloutTree(rollouts), loss, trusted=True)
    lp_err = max((a - b).abs().max().item() for a, b in zip(replay.logprobs, naive.logprobs, strict=True))
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


def test_a_float32_head_runs_outside_autocast():
    """engine.head_float32 (TRL's cast_lm_head_to_fp32): under bfloat16 autocast the projection, logprobs and
    entropy equal float32's; the autocast head is off by bfloat16's rounding (the control)."""
    from branchreplay.engine.head import head_logprobs

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(64, 256, bias=False)
    hidden, targets = torch.randn(16, 64, generator=g).bfloat16(), torch.randint(0, 256, (16,), generator=g)
    exact = head_logprobs(head, hidden.float(), targets, 0.7, LogitTransform(multiplier=0.5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = head_logprobs(head, hidden, targets, 0.7, LogitTransform(multiplier=0.5), float32=True)
        autocast = head_logprobs(head, hidden, targets, 0.7, LogitTransform(multiplier=0.5))
    for a, b in zip(ours, exact, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert (autocast[0] - exact[0]).abs().max() > 1e-3


def test_head_stats_equal_the_models_own_logits_per_rollout():
    """replay_logprobs(head_stats=...) over a tree: TRL's fused-head statistics of each rollout's trained positions
    equal those of the model's own logits on the rollout alone (float64)."""
    from branchreplay.engine.head import HEAD_STATS

    torch.manual_seed(0)
    model = tiny_model("llama", dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    rollouts = make_rollouts(shared_prompt(10, 3, 6, 256, g), g)
    greedy = rollouts[0].token_ids[:10].clone()  # the prompt, then 6 greedy tokens: each is its position's top 1
    with torch.no_grad():
        for _ in range(6):
            greedy = torch.cat([greedy, model(input_ids=greedy[None]).logits[0, -1].argmax()[None]])
    rollouts.append(Rollout(greedy, loss_mask=(torch.arange(16) >= 10).double()))
    result = replay_logprobs(model, RolloutTree(rollouts), temperature=0.7, head_stats=HEAD_STATS)
    assert set(result.head_stats) == set(HEAD_STATS)
    for k, r in enumerate(rollouts):
        with torch.no_grad():
            logits = model(input_ids=r.token_ids[None]).logits[0, :-1].double() / 0.7
        at = r.loss_mask[1:].bool()
        targets = r.token_ids[1:]
        expected = {"mean_logits": logits.mean(-1),
                    "is_top1": (logits.argmax(-1) == targets).double(),
                    "log_sum_sq_probs": torch.logsumexp(2 * torch.log_softmax(logits, -1), -1)}
        for name, values in expected.items():
            ours = result.head_stats[name][k][1:]
            torch.testing.assert_close(ours[at].double(), values[at], rtol=1e-5, atol=1e-6)
            assert not ours[~at].any()
    assert result.head_stats["is_top1"][-1].sum() == 6


def test_a_float32_head_refuses_a_head_that_is_not_a_plain_linear_layer():
    """An adapter on the LM head (a Linear subclass) would be skipped by the float32 projection: refused by name."""

    class AdaptedHead(torch.nn.Linear):
        pass

    from branchreplay.engine import EngineConfig

    model = tiny_model("llama")
    old = model.lm_head
    model.lm_head = AdaptedHead(old.in_features, old.out_features, bias=False)
    g = torch.Generator().manual_seed(2)
    tree = RolloutTree(make_rollouts(shared_prompt(8, 2, 4, 256, g), g))
    with pytest.raises(ValueError, match="engine.head_float32 .* AdaptedHead"):
        replay_logprobs(model, tree, engine=EngineConfig(head_float32=True))


@pytest.mark.parametrize("rows", [(1,), (3,), (64,), (2, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_projection_equals_a_linear_layer_in_float64(rows, bias):
    """The blocked projection computes F.linear's value and gradients (hidden, weight, bias), for any leading shape;
    float64 keeps F.linear (only the CPU's float32 takes blocks), so the blocks are checked in float64 by hand too."""
    from branchreplay.engine.head import VOCAB_BLOCK, _BlockedProjection, projection

    g = torch.Generator().manual_seed(0)
    vocab = 2 * VOCAB_BLOCK + 5  # a last block shorter than the others
    hidden = torch.randn(*rows, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, 16, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(vocab, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    upstream = torch.randn(*rows, vocab, generator=g, dtype=torch.float64)
    results = []
    for project in (torch.nn.functional.linear, projection, _BlockedProjection.apply):
        out = project(hidden, weight, b)
        inputs = [hidden, weight] + ([b] if bias else [])
        results.append([out] + list(torch.autograd.grad(out, inputs, upstream)))
    for theirs, ours in zip(results[0], results[2], strict=True):
        assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-12)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True))
    frozen = _BlockedProjection.apply(hidden, weight.detach(), None)  # a frozen head: the hidden states' gradient
    assert torch.allclose(torch.autograd.grad(frozen, hidden, upstream)[0], results[0][1], rtol=1e-12, atol=1e-12)


@pytest.mark.float32
def test_projection_input_gradient_of_one_row_rounds_like_many_rows():
    """The LM head's input gradient for one row (a 1-token child's pack) is no farther from float64 than for each
    row of a 64-row pack (x 2): over SmolLM2's 49,152 ids the CPU BLAS's one-row kernel, which the plain linear layer
    runs, measured 9.5e-6 against 5e-7 for many rows (issue 50; 10x naive's error on the saved tree,
    test_smollm2.py)."""
    from branchreplay.engine.head import projection

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(49152, 576, generator=g) * 0.05
    hidden = torch.randn(64, 576, generator=g) * 3
    probs = torch.softmax((hidden @ weight.T).double(), -1)
    upstream = -probs  # d logprob / d logits at a target: onehot - p
    upstream[torch.arange(64), torch.randint(0, 49152, (64,), generator=g)] += 1
    exact = upstream @ weight.double()

    def error(rows):
        h = hidden[rows].clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(projection(h, weight, None), h, upstream[rows].float())
        return ((grad.double() - exact[rows]).abs().amax(-1) / exact[rows].abs().amax(-1)).max().item()

    many = error(slice(0, 64))
    one = max(error(slice(i, i + 1)) for i in range(8))
    assert one <= 2 * max(many, 1e-7), (one, many)
