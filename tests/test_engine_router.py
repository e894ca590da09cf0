"""The MoE router load-balancing loss over a tree (`engine.router.RouterLoss`) against the naive rollouts: each
rollout run alone by the Hugging Face model with `output_router_logits=True`, its router logits concatenated over
the rollouts as the padded batch's, and the Switch Transformer formula (transformers' `load_balancing_loss_func`)
taken over them in float64."""

import pytest
import torch

from branchreplay.reference.naive import max_rel_grad_err
from branchreplay.engine import EngineConfig
from branchreplay.engine.router import RouterLoss
from branchreplay.engine.sequence import replay_function_backward
from branchreplay.tree import Rollout, RolloutTree
from conftest import grads

COEF = 0.5  # large enough that the router term moves the gradient well past the tolerance


def _rollouts(vocab: int) -> list[Rollout]:
    """Two prompts (9 and 4 tokens), three and two completions; two of the first prompt's share 3 response tokens."""
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g)  # noqa: E731
    long, short, start = ids(9), ids(4), ids(3)
    completions = [(long, torch.cat([start, ids(4)])), (long, torch.cat([start, ids(2)])), (long, ids(5)),
                   (short, ids(6)), (short, ids(3))]
    return [Rollout(torch.cat([p, c]), loss_mask=torch.cat([torch.zeros(len(p)), torch.ones(len(c))]))
            for p, c in completions]


def switch_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """The load-balancing loss of per-layer router logits [N, E] (every position counted), in their dtype:
    E * sum_e (top-k counts_e / N_all) * (probability sums_e / N_all), N_all = layers x N."""
    probs = [torch.softmax(z, dim=-1) for z in router_logits]
    E = probs[0].shape[-1]
    counts = sum(torch.nn.functional.one_hot(torch.topk(p, top_k, dim=-1).indices, E).sum((0, 1)) for p in probs)
    rows = sum(p.shape[0] for p in probs)
    return E * (counts.to(probs[0].dtype) / rows * sum(p.sum(0) for p in probs) / rows).sum()


def _token_loss(logprobs: list[torch.Tensor], rollouts: list[Rollout]) -> torch.Tensor:
    """A loss coupling each rollout's tokens (the square of its mean logprob), so both passes matter."""
    return sum(((lp * r.loss_mask).sum() / r.loss_mask.sum()) ** 2 for lp, r in zip(logprobs, rollouts))


def _naive(model, rollouts: list[Rollout], top_k: int) -> float:
    """The reference: each rollout alone, unpadded; gradients into param.grad; returns the router loss's value."""
    logprobs, per_layer = [], None
    for r in rollouts:
        out = model(input_ids=r.token_ids[None], output_router_logits=True)
        lp = torch.log_softmax(out.logits[0, :-1], dim=-1).gather(-1, r.token_ids[1:, None])[:, 0]
        logprobs.append(torch.cat([lp.new_zeros(1), lp]))
        layers = [z.reshape(-1, z.shape[-1]) for z in out.router_logits]
        per_layer = layers if per_layer is None else [torch.cat([a, b]) for a, b in zip(per_layer, layers)]
    aux = switch_loss(per_layer, top_k)
    (_token_loss(logprobs, rollouts) + COEF * aux).backward()
    return aux.item()


ENGINES = {"packs": EngineConfig(max_pack_tokens=8),  # packs of several nodes, and nodes alone
           "replayed-chunks": EngineConfig(replay="replay", chunk_tokens=4)}  # every pack run twice, in chunks


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_router_loss_over_trees_equals_the_naive_rollouts(arch, engine, tiny64):
    """float64: the loss value and the gradient of a loss plus COEF x the router loss, over two trees with shared
    prompts and a shared response start, equal the naive rollouts'; leaving the router term out (or counting a
    shared position once) is far outside the tolerance."""
    torch.manual_seed(0)
    model = tiny64(arch)
    top_k = model.config.num_experts_per_tok
    rollouts = _rollouts(model.config.vocab_size)
    aux_naive = _naive(model, rollouts, top_k)
    reference = grads(model)
    model.zero_grad(set_to_none=True)

    trees = [RolloutTree(rollouts[:3]), RolloutTree(rollouts[3:])]
    assert trees[0].stats.token_ratio > 1.5
    router = RouterLoss(model)
    value, _, _ = replay_function_backward(
        model, trees, lambda lp, ent: _token_loss(lp, rollouts) + COEF * router.aux, engine=ENGINES[engine],
        router=router)
    assert router.aux.item() == pytest.approx(aux_naive, rel=1e-12)
    error = max_rel_grad_err(grads(model), reference)
    print(f"{arch} {engine}: router loss {router.aux.item():.6f}, gradient {error:.1e} from the naive rollouts'")
    assert error < 1e-9

    model.zero_grad(set_to_none=True)  # the same without pass 2's router term: a different gradient
    replay_function_backward(model, trees, lambda lp, ent: _token_loss(lp, rollouts), engine=EngineConfig())
    assert max_rel_grad_err(grads(model), reference) > 1e-3


def test_a_model_without_routers_is_refused():
    from branchreplay.tiny_models import tiny_model

    with pytest.raises(ValueError, match="records no router logits"):
        RouterLoss(tiny_model("llama"))


def test_a_config_with_router_logits_on_trains_only_with_the_router_loss():
    """config.output_router_logits=True: a forward-only pass (reference or old-policy logprobs) runs, training
    without a `RouterLoss` is refused by name (the loss transformers would add is not computed), with one runs."""
    from branchreplay.engine import UnsupportedModelError, replay_backward, replay_logprobs
    from branchreplay.losses import GRPOLoss
    from branchreplay.tiny_models import tiny_model

    model = tiny_model("qwen3_moe", dtype=torch.float32)
    model.config.output_router_logits = True
    rollouts = _rollouts(model.config.vocab_size)
    for r in rollouts:
        r.advantages = torch.ones(len(r), dtype=torch.float64)
    tree = RolloutTree(rollouts[:3])
    replay_logprobs(model, tree)
    with pytest.raises(UnsupportedModelError, match="output_router_logits"):
        replay_backward(model, tree, GRPOLoss())
    router = RouterLoss(model)
    replay_function_backward(model, tree, lambda lp, ent: router.aux, router=router)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
