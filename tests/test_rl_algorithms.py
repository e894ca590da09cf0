"""PPO (with its critic), RLOO and REINFORCE++ over prefix trees.

Exactness: each algorithm's gradients, losses and logprobs (a critic's values) equal the naive per-rollout
computation (`reference.naive`: each rollout alone through the Hugging Face forward) on an attention, a
sliding-window and a recurrent family, on trees whose completions share a response prefix; float64 1e-6 (measured
about 1e-14), float32 1e-4. Formulas: the estimators against padded-batch transcriptions of TRL's (RLOO: TRL 1.16's
own `_compute_loss`; PPO: TRL 0.24's PPOTrainer steps 4-6, PPO having left TRL in 1.x) and of verl's REINFORCE++.
Trainer: every algorithm trains, PPO resumes to the straight run, a bad critic is refused by name.
"""

import types
from collections import defaultdict

import pytest
import torch

from branchreplay.engine import EngineConfig, replay_backward, replay_logprobs
from branchreplay.engine.sequence import replay_sequence_backward, sequence_sums
from branchreplay.losses import GRPOLoss, ValueLoss, rloo_loss
from branchreplay.reference.naive import max_rel_grad_err, naive_backward, naive_sequence_backward
from branchreplay.rl.algorithms.ppo import ppo
from branchreplay.rl.algorithms.reinforce_pp import reinforce_pp
from branchreplay.rl.algorithms.rloo import rloo
from branchreplay.rl.config import Config, PPOConfig
from branchreplay.rl.run.step import write
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import Rollout, RolloutTree
from branchreplay.value import ValueModel, check_critic
from helpers import grads
from test_rl_run_trainer import generate

ARCHS = ["llama", "qwen2-sliding", "lfm2"]  # attention, sliding window, recurrent (conv + attention hybrid)
PACKS = EngineConfig(max_pack_tokens=4, chunk_tokens=8)  # several packs and chunked nodes on a tiny tree
TOL = {torch.float64: 1e-6, torch.float32: 1e-4}
VALUE_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}  # a critic's values, relative to the largest


def _noise(n: int, g: torch.Generator) -> torch.Tensor:
    """[n] float64 noise, uniform in [-0.15, 0.15), drawn with `g`."""
    return 0.3 * (torch.rand(n, generator=g, dtype=torch.float64) - 0.5)


def _rollouts(vocab: int, dtype=torch.float64, seed: int = 0) -> list[Rollout]:
    """Two groups of 4 (prompt 12 and 9 tokens); in each, three completions share their first 4 tokens. Off-policy
    old logprobs and reference logprobs, as after a sampling pass and an update."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for group, P in enumerate((12, 9)):
        prompt, shared = torch.randint(3, vocab, (P,), generator=g), torch.randint(3, vocab, (4,), generator=g)
        for i in range(4):
            tail = torch.randint(3, vocab, (3 + 2 * i,), generator=g)
            ids = torch.cat([prompt, shared, tail] if i < 3 else [prompt, tail])
            mask = torch.tensor([0.0] * P + [1.0] * (len(ids) - P))
            old, ref = (-5.5 + _noise(len(ids), g)) * mask, (-5.5 + _noise(len(ids), g)) * mask
            out.append(Rollout(ids, mask, old_logprobs=old, ref_logprobs=ref, group=group))
    return out


def _trees(rollouts):
    return [RolloutTree(rollouts[:4]), RolloutTree(rollouts[4:])]


def _critic(arch, dtype, keep64):
    critic = ValueModel.from_policy(tiny_model(arch, dtype=dtype)).eval()
    return keep64(critic) if dtype == torch.float64 else critic


def _engine_vs_naive(model, rollouts, make_loss):
    """(engine result, naive result, max relative gradient error) of the same loss (a fresh one each side)."""
    model.zero_grad(set_to_none=True)
    expected = naive_backward(model, rollouts, make_loss())
    reference = grads(model)
    model.zero_grad(set_to_none=True)
    result = replay_backward(model, _trees(rollouts), make_loss(), engine=PACKS)
    return result, expected, max_rel_grad_err(grads(model), reference)


# -- exactness over trees -----------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("arch, dtype", [(arch, torch.float64) for arch in ARCHS] + [("llama", torch.float32)])
def test_ppo_critic_and_policy_equal_naive(arch, dtype, keep64):
    """The whole PPO update: the critic's values over the tree (one per unique position), ppo()'s GAE
    targets from them, then the value loss on the critic and the clipped policy loss on the policy."""
    critic = _critic(arch, dtype, keep64)
    policy = tiny_model(arch, dtype=dtype)
    policy = keep64(policy) if dtype == torch.float64 else policy
    rollouts = _rollouts(critic.config.vocab_size)
    values = replay_logprobs(critic, _trees(rollouts), engine=PACKS).values
    naive_values = naive_backward(critic, rollouts, None).values
    scale = max(v.abs().max().item() for v in naive_values)
    assert max((a - b).abs().max().item() for a, b in zip(values, naive_values,
                                                          strict=True)) <= VALUE_TOL[dtype] * scale
    scores = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.0])
    fields, metrics = ppo(rollouts, scores, [True] * 7 + [False], values,
                          PPOConfig(kl_estimator="k3", missing_eos_penalty=0.5))
    write(rollouts, fields)
    assert set(metrics) >= {"objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward"}
    g = torch.Generator().manual_seed(1)
    for r in rollouts:  # a later epoch: the critic has moved away from its values at sampling, some clip
        r.old_values = r.old_values + 0.1 * torch.randn(len(r), generator=g, dtype=torch.float64) * r.loss_mask
    result, expected, err = _engine_vs_naive(critic, rollouts, lambda: ValueLoss(cliprange_value=0.05, coef=0.1))
    print(f"critic {arch} {dtype}: {err:.1e}")
    assert err <= TOL[dtype], f"critic {arch}: {err:.2e}"
    assert abs(result.loss - expected.loss) <= TOL[dtype] * abs(expected.loss)
    clipped = ValueLoss(cliprange_value=0.05)
    replay_backward(critic, _trees(rollouts), clipped)
    assert 0 < clipped.value_metrics()["val/clipfrac_avg"] < 1  # the clipped branch is exercised
    result, expected, err = _engine_vs_naive(policy, rollouts, lambda: GRPOLoss(0.2, 0.2))
    print(f"policy {arch} {dtype}: {err:.1e}")
    assert err <= TOL[dtype], f"policy {arch}: {err:.2e}"
    assert abs(result.loss - expected.loss) <= TOL[dtype] * abs(expected.loss)


@pytest.mark.parametrize("arch, dtype", [(arch, torch.float64) for arch in ARCHS] + [("llama", torch.float32)])
def test_rloo_sequence_loss_equals_naive(arch, dtype, tiny64):
    """RLOO's sequence-level clipped ratio, off-policy (the sums moved away from the old ones: some ratios clip)."""
    model = tiny64(arch, dtype)
    rollouts = _rollouts(model.config.vocab_size)
    write(rollouts, {"advantages": rloo(rollouts, torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.0]), beta=0.05,
                                        normalize_advantages=True)[0]})
    advantages = torch.tensor([float(r.advantages[0]) for r in rollouts], dtype=torch.float64)
    sums = sequence_sums(replay_logprobs(model, _trees(rollouts)).logprobs, rollouts)
    old = sums + torch.linspace(-0.4, 0.4, len(rollouts), dtype=torch.float64)

    def loss(s):
        return rloo_loss(s, old, advantages, epsilon_low=0.2, epsilon_high=0.28)

    ratio = torch.exp(sums - old)
    assert ((ratio < 0.8) | (ratio > 1.28)).any() and ((ratio > 0.8) & (ratio < 1.28)).any()
    expected_value, expected_sums = naive_sequence_backward(model, rollouts, loss)
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    value, s, _ = replay_sequence_backward(model, _trees(rollouts), loss, engine=PACKS)
    assert (s - expected_sums).abs().max() <= (1e-9 if dtype == torch.float64 else 1e-3)  # sums of ~20 logprobs
    # in float32 bound by the terms' scale: the loss nearly cancels (normalised advantages: 0.005 from terms near 1)
    scale = abs(expected_value) if dtype == torch.float64 else advantages.abs().mean()
    assert abs(value - expected_value) <= TOL[dtype] * scale
    err = max_rel_grad_err(grads(model), expected)
    print(f"rloo {arch} {dtype}: {err:.1e}")
    assert err <= TOL[dtype], f"{arch}: {err:.2e}"


@pytest.mark.parametrize("arch, dtype", [(arch, torch.float64) for arch in ARCHS] + [("llama", torch.float32)])
def test_reinforce_pp_per_token_advantages_equal_naive(arch, dtype, tiny64):
    model = tiny64(arch, dtype)
    rollouts = _rollouts(model.config.vocab_size)
    write(rollouts, {"advantages": reinforce_pp(rollouts, torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.0]),
                                                beta=0.05, gamma=0.9)[0]})
    assert len(set(rollouts[0].advantages[rollouts[0].loss_mask > 0].tolist())) > 1  # per token, not per rollout
    result, expected, err = _engine_vs_naive(model, rollouts, lambda: GRPOLoss(0.2, 0.28))
    print(f"reinforce_pp {arch} {dtype}: {err:.1e}")
    assert err <= TOL[dtype], f"{arch}: {err:.2e}"
    assert abs(result.loss - expected.loss) <= TOL[dtype] * abs(expected.loss)


@pytest.mark.parametrize("arch", ARCHS)
def test_gspo_sequence_ratio_equals_naive(arch, tiny64):
    """GSPO (`losses.gspo_loss`: every token of a rollout takes its mean log-ratio) with the KL corrected by that
    ratio and the entropy bonus, through `engine.sequence.replay_function_backward`, against each rollout alone."""
    from branchreplay.engine.sequence import replay_function_backward
    from branchreplay.losses import gspo_loss, token_weights
    from branchreplay.reference.naive import naive_function_backward

    model = tiny64(arch)
    rollouts = _rollouts(model.config.vocab_size)
    weights = token_weights([r.loss_mask for r in rollouts], "grpo")
    for r, w, a in zip(rollouts, weights, [1.0, -0.5, 0.3, -0.8, 0.7, -0.2, 0.1, -0.6], strict=True):
        r.weights, r.advantages = w, torch.full((len(r),), a, dtype=torch.float64)
    tokens = sum(float(r.loss_mask.sum()) for r in rollouts)

    def loss(lps, ents):
        return gspo_loss(lps, ents, rollouts, GRPOLoss(0.2, 0.28, beta=0.05, entropy_coef=0.01, entropy_tokens=tokens))

    expected_value = naive_function_backward(model, rollouts, loss)
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    value, _, _ = replay_function_backward(model, _trees(rollouts), loss, engine=PACKS)
    assert abs(value - expected_value) <= 1e-9 * abs(expected_value)
    err = max_rel_grad_err(grads(model), expected)
    print(f"gspo {arch}: {err:.1e}")
    assert err <= 1e-6, f"{arch}: {err:.2e}"


# -- the estimators against TRL's and verl's formulas ---------------------------------------------------------------

def _padded(rollouts):
    """The rollouts' completions as TRL pads them: [B, C] old / ref logprobs and the completion mask."""
    lengths = [int(r.loss_mask.sum()) for r in rollouts]
    C = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (C - n) for n in lengths], dtype=torch.float64)

    def pad(values):  # a Rollout field's name, or per-rollout [T] tensors
        values = [getattr(r, values) for r in rollouts] if isinstance(values, str) else values
        return torch.stack([torch.cat([v[r.loss_mask > 0], torch.zeros(C - n, dtype=torch.float64)])
                            for v, r, n in zip(values, rollouts, lengths, strict=True)])

    return mask, pad


def _trl_masked_whiten(values, mask, shift_mean=True):
    """trl/core.py (0.24) masked_whiten, verbatim in substance."""
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


@pytest.mark.parametrize("kl_estimator, whiten_rewards", [("k1", False), ("k3", True)])
def test_ppo_advantages_match_trl_padded_loop(kl_estimator, whiten_rewards):
    """TRL 0.24 PPOTrainer steps 3-6 on the padded batch (transcribed here), with one departure on purpose: TRL adds
    the score one position past the last token (`actual_end = sequence_lengths_p1`, a padding slot whose value it
    also trains); an unpadded rollout has no such position, so ours is at the last token, and the reference here
    does the same."""
    rollouts = _rollouts(256)
    values = [torch.randn(len(r), generator=torch.Generator().manual_seed(i), dtype=torch.float64) * r.loss_mask
              for i, r in enumerate(rollouts)]
    scores = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    ended = [True, True, False, True, True, True, True, False]
    cfg = PPOConfig(kl_coef=0.05, kl_estimator=kl_estimator, gamma=0.99, lam=0.9, whiten_rewards=whiten_rewards,
                    missing_eos_penalty=1.0)
    fields, metrics = ppo(rollouts, scores, ended, values, cfg)
    write(rollouts, fields)

    mask, pad = _padded(rollouts)
    logprobs, ref_logprobs = pad("old_logprobs"), pad("ref_logprobs")
    v = pad(values)
    s = scores - 1.0 * torch.tensor([not e for e in ended], dtype=torch.float64)
    logr = ref_logprobs - logprobs
    kl = (-logr if kl_estimator == "k1" else (logr.exp() - 1) - logr) * mask
    rewards = -0.05 * kl
    last = mask.sum(1).long() - 1
    rewards[torch.arange(len(s)), last] += s
    if whiten_rewards:
        rewards = _trl_masked_whiten(rewards, mask, shift_mean=False) * mask
    lastgaelam, reversed_ = 0, []
    for t in reversed(range(mask.shape[1])):
        nextvalues = v[:, t + 1] if t < mask.shape[1] - 1 else 0.0
        delta = rewards[:, t] + 0.99 * nextvalues - v[:, t]
        lastgaelam = delta + 0.99 * 0.9 * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], 1)
    returns = advantages + v
    advantages = _trl_masked_whiten(advantages, mask) * mask
    for i, r in enumerate(rollouts):
        n = int(r.loss_mask.sum())
        torch.testing.assert_close(r.advantages[r.loss_mask > 0], advantages[i, :n], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r.returns[r.loss_mask > 0], returns[i, :n], rtol=1e-12, atol=1e-12)
    assert metrics["objective/kl"] == pytest.approx(kl.sum(1).mean().item(), rel=1e-12)
    assert metrics["objective/entropy"] == pytest.approx((-logprobs * mask).sum(1).mean().item(), rel=1e-12)
    assert metrics["objective/rlhf_reward"] == pytest.approx((-0.05 * kl).sum(1).mean().item() + s.mean().item())


def test_rloo_matches_trl_compute_loss_and_advantages():
    """TRL 1.16 RLOOTrainer: the advantages as its `_generate_and_score_completions` computes them (transcribed:
    the method needs a whole trainer), the loss and its gradient from its own `_compute_loss`, given our per-token
    logprobs through a stub of the trainer's attributes."""
    trl = pytest.importorskip("trl", reason="TRL is a dev dependency (pip install -e '.[dev]')")
    rollouts = _rollouts(256)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    write(rollouts, {"advantages": rloo(rollouts, rewards, beta=0.05, normalize_advantages=True)[0]})
    mask, pad = _padded(rollouts)
    old, ref = pad("old_logprobs"), pad("ref_logprobs")
    kl = ((old - ref) * mask).sum(-1)
    grouped = (rewards - 0.05 * kl).view(-1, 4)
    expected = (grouped - (grouped.sum(1, keepdim=True) - grouped) / 3).view(-1)
    expected = (expected - expected.mean()) / (expected.std() + 1e-4)
    ours = torch.tensor([float(r.advantages[0]) for r in rollouts], dtype=torch.float64)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)

    current = (old + 0.25 * torch.linspace(-1, 1, old.numel(), dtype=torch.float64).view_as(old)) * mask
    leaf_trl = current.clone().requires_grad_(True)
    stub = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf_trl, torch.zeros_like(leaf_trl), None),
        epsilon_low=0.2, epsilon_high=0.28, aux_loss_enabled=False, model=types.SimpleNamespace(training=True),
        accelerator=types.SimpleNamespace(reduce=lambda x, reduction: x, gather=lambda x: x),
        _metrics={"train": defaultdict(list)})
    B = len(rollouts)
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask,
              "old_logps": (old * mask).sum(1), "advantages": ours}
    trl_loss = trl.RLOOTrainer._compute_loss(stub, None, inputs)
    trl_loss.backward()
    leaf = current.clone().requires_grad_(True)
    loss = rloo_loss((leaf * mask).sum(1), (old * mask).sum(1), ours, epsilon_low=0.2, epsilon_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-12)
    torch.testing.assert_close(leaf.grad, leaf_trl.grad, rtol=1e-12, atol=1e-15)
    assert stub._metrics["train"]["clip_ratio/region_mean"][0] > 0  # the batch clips, so the clip branch is tested


def test_reinforce_pp_matches_verl():
    """verl's compute_reinforce_plus_plus_outcome_advantage on the padded batch (transcribed): token-level rewards
    (score at the last token, minus beta * k1 as `apply_kl_penalty` with kl_penalty="kl"), discounted returns that
    reset after the mask, masked_whiten over the batch."""
    rollouts = _rollouts(256)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    write(rollouts, {"advantages": reinforce_pp(rollouts, rewards, beta=0.05, gamma=0.9)[0]})
    mask, pad = _padded(rollouts)
    token_level = -0.05 * (pad("old_logprobs") - pad("ref_logprobs")) * mask
    token_level[torch.arange(len(rollouts)), mask.sum(1).long() - 1] += rewards
    returns, running = torch.zeros_like(token_level), 0
    for t in reversed(range(mask.shape[1])):
        running = token_level[:, t] + 0.9 * running
        returns[:, t] = running
        running = running * mask[:, t]
    expected = _trl_masked_whiten(returns, mask) * mask
    for i, r in enumerate(rollouts):
        torch.testing.assert_close(r.advantages[r.loss_mask > 0], expected[i, : int(r.loss_mask.sum())],
                                   rtol=1e-12, atol=1e-12)


# -- the trainer --------------------------------------------------------------------------------------------------

def _config(tmp_path, algorithm, **sections):
    from test_rl_run_trainer import make_config

    data = make_config(tmp_path, **sections).to_dict()
    data["algorithm"] = algorithm
    return Config.from_dict(data)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, names", [
    ("ppo", ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
             "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg",
             "val/ratio"]),
    ("rloo", ["kl", "entropy", "clip_ratio/region_mean"]),
    ("reinforce_pp", ["kl", "entropy", "clip_ratio/region_mean"]),
])
def test_each_algorithm_trains_and_logs_trl_names(tmp_path, algorithm, names):
    from test_rl_run_trainer import _metrics, make_trainer

    extra = {"grpo": {"beta": 0.05, "num_generations": 4}} if algorithm != "ppo" else {"ppo": {"num_ppo_epochs": 2}}
    trainer = make_trainer(_config(tmp_path, algorithm, train={"steps": 2}, **extra))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    run = trainer.fit()
    records = [r for r in _metrics(run) if r["step"] > 0]
    assert len(records) == 2
    for name in names:
        assert all(torch.isfinite(torch.tensor(r[name])) for r in records), name
    assert any((p - b).abs().max() > 0 for p, b in zip(trainer.model.parameters(), before, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("grpo", [{"importance_sampling_level": "sequence", "num_iterations": 2},
                                  {"top_entropy_quantile": 0.2, "num_iterations": 2},
                                  {"loss_type": "cispo", "epsilon_high": 2.0}, {"loss_type": "sapo"},
                                  {"loss_type": "luspo", "importance_sampling_level": "sequence"}])
def test_grpo_options_train(tmp_path, grpo):
    """GSPO, top_entropy_quantile and TRL's newer loss types run in the trainer (their formulas: test_losses_trl.py)."""
    from test_rl_run_trainer import _metrics, make_config, make_trainer

    run = make_trainer(make_config(tmp_path, grpo=grpo, train={"steps": 2})).fit()
    records = [r for r in _metrics(run) if r["step"] > 0]
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in records)
    if "top_entropy_quantile" in grpo:  # about the top fifth of the step's completion tokens train the policy
        assert all(0.1 <= r["entropy_mask/kept"] <= 0.4 for r in records)


@pytest.mark.slow
def test_ppo_resume_equals_a_straight_run(tmp_path):
    """The critic, its AdamW state and schedule are in the checkpoint (critic/): 1 step + resume = 2 steps."""
    from test_rl_run_trainer import make_trainer

    straight = make_trainer(_config(tmp_path / "a", "ppo", train={"steps": 2}))
    straight.fit()
    first = make_trainer(_config(tmp_path / "b", "ppo", train={"steps": 1}))
    run = first.fit()
    assert (run / "checkpoints" / "step-000001" / "critic" / "model.safetensors").is_file()
    resumed = make_trainer(_config(tmp_path / "b", "ppo", train={"steps": 2}))
    resumed.fit(resume=run)
    for a, b in [(straight.model, resumed.model), (straight.algorithm.critic.model, resumed.algorithm.critic.model)]:
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_bad_critic_refused_by_name():
    policy = tiny_model("llama")
    with pytest.raises(ValueError, match="vocabulary"):
        check_critic(ValueModel.from_policy(tiny_model("llama", vocab_size=300)), policy)
    with pytest.raises(ValueError, match="architecture"):
        check_critic(ValueModel.from_policy(tiny_model("qwen2")), policy)
    with pytest.raises(ValueError, match="value head"):
        check_critic(policy, policy)


def test_algorithm_flag_and_trl_defaults():
    from branchreplay.rl.config import apply_overrides

    config = Config.from_dict(apply_overrides({}, ["--algorithm", "rloo"]))
    assert (config.algorithm, config.grpo.beta, config.grpo.num_generations) == ("rloo", 0.05, 2)  # TRL RLOOConfig
    assert Config.from_dict(config.to_dict()) == config
    set_by_user = Config.from_dict(apply_overrides({"grpo": {"beta": 0.0}}, ["--algorithm=rloo"]))
    assert set_by_user.grpo.beta == 0.0
    assert Config.from_dict({"algorithm": "ppo"}).ppo == PPOConfig()
    with pytest.raises(ValueError, match="accepted values: grpo, ppo, rloo, reinforce_pp"):
        Config.from_dict({"algorithm": "a2c"})
    with pytest.raises(ValueError, match="ppo.cliprange"):
        PPOConfig(cliprange=1.5)


@pytest.mark.parametrize("algorithm, grpo", [("rloo", {"num_iterations": 2}),
                                             ("grpo", {"importance_sampling_level": "sequence"})])
def test_sequence_losses_do_not_depend_on_micro_batching(tmp_path, algorithm, grpo):
    """RLOO's and GSPO's two-pass updates run per micro-batch of trees (`trainer.micro_batches`): one tree at a
    time moves the weights as all at once (one forest of every group). float64: AdamW's first steps move each weight
    by about the learning rate whatever its gradient's size, so float32 rounding in a near-zero gradient shows."""
    from test_rl_run_trainer import make_trainer

    weights = []
    for size in (0, 1):
        trainer = make_trainer(_config(tmp_path / f"{algorithm}{size}", algorithm, train={"steps": 1},
                                       grpo={**grpo, "num_generations": 4, "micro_batch_prompts": size}),
                               dtype=torch.float64)
        trainer.train_step(1)
        weights.append([p.detach().clone() for p in trainer.model.parameters()])
    for a, b in zip(*weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_the_docs_own_algorithm_trains_from_the_current_folder(tmp_path, monkeypatch):
    """docs/algorithms.md's "Write your own algorithm", the file as the page has it, run as `--algorithm
    my_algorithms:LeaveOneOutGRPO` from the current folder: its advantages are each rollout's reward minus the
    mean of the other rewards of its group, two steps train and log its metric; a spec that does not import or is
    not an Algorithm is refused by name."""
    from pathlib import Path

    from test_rl_run_trainer import _metrics, make_trainer, with_advantages

    page = (Path(__file__).parents[1] / "docs" / "algorithms.md").read_text()
    code = page.split("## Write your own algorithm")[1].split("```python\n")[1].split("```")[0]
    (tmp_path / "my_algorithms.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    trainer = make_trainer(_config(tmp_path, "my_algorithms:LeaveOneOutGRPO", train={"steps": 2}))
    batch = with_advantages(trainer, generate(trainer, 1))
    start = 0
    for group in batch.rollouts:
        rewards = batch.rewards[start : start + len(group)].double()
        start += len(group)
        for i, r in enumerate(group):
            others = (rewards.sum() - rewards[i]) / (len(group) - 1)
            assert torch.allclose(r.advantages, torch.full_like(r.advantages, float(rewards[i] - others)))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    records = [r for r in _metrics(trainer.fit()) if r["step"] > 0]
    assert len(records) == 2 and all(r["advantages/abs_mean"] > 0 for r in records)
    assert any((p - b).abs().max() > 0 for p, b in zip(trainer.model.parameters(), before, strict=True))
    for spec, said in (("my_algorithms:Missing", "cannot be imported"), ("os:getcwd", "is not a subclass")):
        with pytest.raises(ValueError, match=f"algorithm='{spec}' {said}"):
            make_trainer(_config(tmp_path / "other", spec))
