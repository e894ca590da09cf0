"""The loss records its own clip, KL and entropy statistics (TRL logs them from the loss's tensors): the same on the
engine and on the naive reference, and equal to token means computed here from the rollouts' own logprobs."""

import torch

from branchreplay.engine import replay_backward, replay_logprobs
from branchreplay.losses import GRPOLoss, LossStats
from branchreplay.reference.naive import naive_backward
from branchreplay.reference.shapes import SHAPES, make_rollouts
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import RolloutTree


def test_loss_statistics_are_token_means_of_the_tensors_the_loss_used():
    model = tiny_model("llama", dtype=torch.float64, seed=2)
    g = torch.Generator().manual_seed(3)
    rollouts = make_rollouts(SHAPES["branches-of-branches"](256, g), g)
    tree = RolloutTree(rollouts)
    current = replay_logprobs(model, tree).logprobs
    for i, (r, lp) in enumerate(zip(rollouts, current,
                                    strict=True)):  # off-policy, both advantage signs: both clip sides
        r.advantages = torch.full_like(r.advantages, 0.5 if i % 2 else -0.5)
        noise = 0.6 * (torch.rand(len(r), generator=g, dtype=torch.float64) - 0.5)
        r.old_logprobs, r.ref_logprobs = (lp.double() + noise) * r.loss_mask, (lp.double() - noise) * r.loss_mask
    loss = GRPOLoss(epsilon_low=0.1, epsilon_high=0.1, beta=0.04)
    result = replay_backward(model, tree, loss)
    ours = loss.stats.metrics()
    loss.stats = LossStats()
    naive_backward(model, rollouts, loss)
    theirs = loss.stats.metrics()
    # independent: TRL's token means over the trained positions, from the rollouts and the engine's float32 logprobs
    mask = torch.cat([r.loss_mask for r in rollouts]).bool()
    logp = torch.cat(result.logprobs).double()[mask]
    adv = torch.cat([r.advantages for r in rollouts])[mask]
    ratio = torch.exp(logp - torch.cat([r.old_logprobs for r in rollouts])[mask])
    low, high = (ratio < 0.9) & (adv < 0), (ratio > 1.1) & (adv > 0)
    delta = torch.cat([r.ref_logprobs for r in rollouts])[mask] - logp
    expected = {"entropy": torch.cat(result.entropy)[mask].mean().item(), "clip_ratio/low_mean": low.double().mean(),
                "clip_ratio/high_mean": high.double().mean(), "clip_ratio/region_mean": (low | high).double().mean(),
                "kl": ((torch.exp(delta) - delta - 1) * ratio).mean().item()}  # bias-corrected, as TRL logs it
    assert low.any() and high.any()
    assert set(ours) == set(theirs) == set(expected)
    for key, value in expected.items():
        assert abs(ours[key] - float(value)) <= 1e-6, (key, ours[key], float(value))
        assert abs(theirs[key] - float(value)) <= 1e-6, (key, theirs[key], float(value))
