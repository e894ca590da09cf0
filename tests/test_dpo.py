"""DPO over prefix trees (`losses.dpo_loss` through `engine.sequence.replay_sequence_backward`): the prompt is one
node, chosen and rejected are branches (sharing a node where their responses share a prefix). The gradient and the
loss equal the naive per-pair computation: each sequence alone through the Hugging Face forward, its completion
logprobs summed under autograd, the same DPO loss, `.backward()`."""

import pytest
import torch

from branchreplay.check.reference import max_rel_grad_err
from branchreplay.engine import EngineConfig
from branchreplay.engine.sequence import replay_sequence_backward
from branchreplay.losses import DPO_LOSS_TYPES, dpo_loss
from branchreplay.tree import Rollout, RolloutTree
from conftest import grads


def _pairs(vocab: int, seed: int = 0):
    """Two pairs: (prompt, chosen, rejected); the first pair's responses share their first 4 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g)  # noqa: E731
    shared = ids(4)
    return [(ids(12), torch.cat([shared, ids(6)]), torch.cat([shared, ids(3)])), (ids(7), ids(5), ids(9))]


def _rollouts(pairs) -> list[Rollout]:
    """chosen, rejected, chosen, rejected, ...: prompt + response, the loss mask on the response."""
    out = []
    for prompt, chosen, rejected in pairs:
        for response in (chosen, rejected):
            out.append(Rollout(torch.cat([prompt, response]), loss_mask=[0.0] * len(prompt) + [1.0] * len(response)))
    return out


def _loss(loss_type, ref, lengths):
    def loss(s):  # [2B] summed logprobs, chosen at even positions
        return dpo_loss(s[0::2], s[1::2], ref[0::2], ref[1::2], beta=0.3, loss_type=loss_type, label_smoothing=0.1,
                        chosen_tokens=lengths[0::2], rejected_tokens=lengths[1::2]).mean()
    return loss


def _naive(model, rollouts, loss):
    sums = []
    for r in rollouts:
        logits = model(input_ids=r.token_ids[None]).logits[0, :-1]
        logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, r.token_ids[1:, None])[:, 0]
        sums.append((logp * r.loss_mask[1:]).sum())
    value = loss(torch.stack(sums))
    value.backward()
    return value.item()


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2-sliding", "lfm2"])
def test_dpo_over_pair_trees_equals_naive_per_pair(arch, loss_type, tiny64):
    model = tiny64(arch)
    rollouts = _rollouts(_pairs(model.config.vocab_size))
    trees = [RolloutTree(rollouts[0:2]), RolloutTree(rollouts[2:4])]
    assert trees[0].stats.physical_tokens == 12 + 4 + 6 + 3  # the prompt and the shared response prefix once
    ref = torch.tensor([-40.0, -35.0, -30.0, -45.0], dtype=torch.float64)
    lengths = torch.tensor([10.0, 7.0, 5.0, 9.0], dtype=torch.float64)
    loss = _loss(loss_type, ref, lengths)
    expected_value = _naive(model, rollouts, loss)
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    value, sums, _ = replay_sequence_backward(model, trees, loss, engine=EngineConfig(max_pack_tokens=4))
    assert abs(value - expected_value) <= 1e-6 * abs(expected_value)
    err = max_rel_grad_err(grads(model), expected)
    assert err <= 1e-10, f"{arch} {loss_type}: max relative gradient error {err:.2e}"  # measured about 3e-15


def test_dpo_float32_within_1e_4_of_naive():
    from branchreplay.models import tiny_model

    model = tiny_model("llama", dtype=torch.float32)
    rollouts = _rollouts(_pairs(model.config.vocab_size, seed=1))
    ref = torch.tensor([-40.0, -35.0, -30.0, -45.0], dtype=torch.float64)
    loss = _loss("sigmoid", ref, torch.tensor([10.0, 7.0, 5.0, 9.0], dtype=torch.float64))
    _naive(model, rollouts, loss)
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    replay_sequence_backward(model, [RolloutTree(rollouts[0:2]), RolloutTree(rollouts[2:4])], loss)
    assert max_rel_grad_err(grads(model), expected) <= 1e-4


def test_dpo_loss_refuses_bad_input_by_name():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type 'kto' is unknown"):
        dpo_loss(x, x, x, x, loss_type="kto")
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        dpo_loss(x, x, x, x, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="ipo' needs chosen_tokens"):
        dpo_loss(x, x, x, x, loss_type="ipo")
