"""The MoE router load-balancing loss over a tree (`engine.router.RouterLoss`) against the naive rollouts: each
rollout run alone by the Hugging Face model with `output_router_logits=True`, its router logits concatenated over
the rollouts as the padded batch's, and the Switch Transformer formula taken over them in float64 (equal, to float32
rounding, to the family's own `load_balancing_loss_func` of its transformers model file, which counts in float32),
for every registered MoE family transformers computes the loss for (`ROUTER_LOSS_ARCHS`)."""

import importlib

import pytest
import torch

from branchreplay.engine import EngineConfig
from branchreplay.engine.families import FAMILIES
from branchreplay.engine.router import RouterLoss
from branchreplay.engine.sequence import replay_function_backward
from branchreplay.reference.naive import max_rel_grad_err
from branchreplay.tree import Rollout, RolloutTree
from helpers import grads

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
    return sum(((lp * r.loss_mask).sum() / r.loss_mask.sum()) ** 2 for lp, r in zip(logprobs, rollouts, strict=True))


ROUTER_LOSS_ARCHS = ["qwen3_moe", "mixtral", "jamba", "qwen3_next", "qwen3_5_moe_text", "granitemoehybrid",
                     "minimax_m2", "ernie4_5_moe", "granitemoe_swa", "gpt_oss"]
"""The tiny archs whose family has a router load-balancing loss (`RouterLoss.exists`; gpt-oss's own test adds its
sliding layers and sinks)."""


FLOAT32_ROUTERS = ("minimax_m2", "ernie4_5_moe")
"""Routers transformers computes in float32 whatever the model dtype: they agree with the naive rollouts to float32
rounding, 1e-6; the `Family.float32_kernels` families (SSM scans, delta rules, float32 softmax) to the recurrent
families' bound, 1e-4 (Qwen3-Next measures 5e-6 with nodes replayed in chunks of 4, whose scans restart from a
handed state). A router term counted once per shared position, or left out, moves the gradient by more than 1e-3."""


def test_every_family_with_a_router_loss_is_tested():
    from branchreplay.tiny_models import ALL_TINY_ARCHS, tiny_model

    assert {a for a in ALL_TINY_ARCHS if RouterLoss.exists(tiny_model(a))} == set(ROUTER_LOSS_ARCHS)


def _naive(model, rollouts: list[Rollout], top_k: int) -> float:
    """The reference: each rollout alone, unpadded; gradients into param.grad; returns the router loss's value."""
    logprobs, per_layer = [], None
    for r in rollouts:
        out = model(input_ids=r.token_ids[None], output_router_logits=True)
        lp = torch.log_softmax(out.logits[0, :-1], dim=-1).gather(-1, r.token_ids[1:, None])[:, 0]
        logprobs.append(torch.cat([lp.new_zeros(1), lp]))
        layers = [z.reshape(-1, z.shape[-1]) for z in out.router_logits]
        per_layer = layers if per_layer is None else [torch.cat([a, b]) for a, b in zip(per_layer, layers, strict=True)]
    aux = switch_loss(per_layer, top_k)
    family = importlib.import_module(type(model).__module__).load_balancing_loss_func  # counts in float32
    assert family(tuple(per_layer), per_layer[0].shape[-1], top_k).item() == pytest.approx(aux.item(), rel=1e-6)
    (_token_loss(logprobs, rollouts) + COEF * aux).backward()
    return aux.item()


ENGINES = {"packs": EngineConfig(max_pack_tokens=8),  # packs of several nodes, and nodes alone
           "replayed-chunks": EngineConfig(replay="replay", chunk_tokens=4)}  # every pack run twice, in chunks


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("arch", ROUTER_LOSS_ARCHS[:-1])
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
    kernels = FAMILIES[model.config.model_type].float32_kernels
    bound = 1e-4 if kernels else 1e-6 if arch in FLOAT32_ROUTERS else 1e-9
    assert router.aux.item() == pytest.approx(aux_naive, rel=1e-6 if kernels or arch in FLOAT32_ROUTERS else 1e-12)
    error = max_rel_grad_err(grads(model), reference)
    print(f"{arch} {engine}: router loss {router.aux.item():.6f}, gradient {error:.1e} from the naive rollouts'")
    assert error < bound

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
