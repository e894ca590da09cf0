"""`branchreplay bench --loss ppo | dpo`: the other objectives' exact gradients, naive and over the tree, side by side
in one process on the bench model (`runner.BENCH_MODEL`), with their FLOP ratios.

    ppo  the scenarios' rollouts, one PPO update: the clipped policy loss with per-token advantages on the policy
         and the clipped value loss on a critic (`value.ValueModel`); naive: each rollout alone through both
         models; branchreplay: both over the tree.
    dpo  `pairs` preference pairs (a prompt of P tokens, chosen and rejected responses of R tokens): naive, each
         sequence alone; padded, TRL's concatenated [2 x pairs, P + R] batch; branchreplay, each pair a tree through
         `engine.sequence.replay_sequence_backward` (its graph-free first pass counts 1/3 of a forward + backward).

FLOPs by `reference.work.Work` (the critic's head rows not counted). Times: one timed run after a warm-up of each method
(`measure.measure`): compare ratios within one run.
Design notes: docs/benchmarks.md ("PPO and DPO").
"""

from __future__ import annotations

import functools

import torch

from ..engine import replay_backward
from ..engine.sequence import replay_sequence_backward
from ..losses import GRPOLoss, ValueLoss, dpo_loss, token_weights
from ..reference import work as F
from ..reference.naive import max_rel_grad_err, naive_backward, naive_sequence_backward
from ..reference.shapes import make_rollouts
from ..tiny_models import tiny_model
from ..tree import Rollout, RolloutTree, forests
from ..value import ValueModel
from .measure import measure
from .scenarios import Scenario

OBJECTIVES = ("grpo", "ppo", "dpo")


def run_ppo(scenarios: list[Scenario], model_config: dict, dtype: torch.dtype, seed: int = 0, log=None) -> list[dict]:
    """One row per (scenario configuration, method) for PPO's policy + critic update (module docstring)."""
    policy = tiny_model("llama", dtype=dtype, seed=seed, **model_config)
    critic = ValueModel.from_policy(policy, seed=seed).eval()
    shape = F.ModelShape.of(policy)
    policy_loss, value_loss = GRPOLoss(0.2, 0.2), ValueLoss(0.2, 0.1)
    rows = []
    for scenario in scenarios:
        g = torch.Generator().manual_seed(seed)
        rollouts = _ppo_rollouts(make_rollouts(scenario.sequences(policy.config.vocab_size, g), g), g)
        tree = RolloutTree(rollouts)

        def naive(rollouts=rollouts):
            naive_backward(policy, rollouts, policy_loss)
            naive_backward(critic, rollouts, value_loss)

        def branchreplay(tree=tree):
            replay_backward(policy, tree, policy_loss)
            replay_backward(critic, tree, value_loss)

        works = {"naive": F.naive_work(rollouts), "branchreplay": F.tree_work(tree)}
        flops = {m: w.flops(shape) + F.Work(w.positions, w.attention_keys, 0).flops(shape) for m, w in works.items()}
        positions = {m: w.positions for m, w in works.items()}
        rows += _side_by_side(scenario.name, scenario.label(), {"naive": naive, "branchreplay": branchreplay},
                              flops, positions, [policy, critic], tree.stats, log)
    return rows


def run_dpo(prompt_tokens: list[int], response_tokens: list[int], pairs: int, model_config: dict,
            dtype: torch.dtype, seed: int = 0, log=None) -> list[dict]:
    """One row per (P, R, method) for DPO's sigmoid loss on `pairs` pairs (module docstring)."""
    model = tiny_model("llama", dtype=dtype, seed=seed, **model_config)
    shape = F.ModelShape.of(model)
    rows = []
    for P in prompt_tokens:
        for R in response_tokens:
            g = torch.Generator().manual_seed(seed)
            ids = functools.partial(_random_ids, model.config.vocab_size, g)
            rollouts = []
            for _ in range(pairs):
                prompt = ids(P)
                rollouts += [Rollout(torch.cat([prompt, ids(R)]), loss_mask=[0.0] * P + [1.0] * R) for _ in range(2)]
            # one tree per pair, as the engine runs them (pairs whose random prompts share a first token: one forest)
            trees = forests([RolloutTree(rollouts[i : i + 2]) for i in range(0, len(rollouts), 2)])
            ref = -float(R) * 7.0 + torch.linspace(-3, 3, len(rollouts), dtype=torch.float64)

            def loss(s, ref=ref):
                return dpo_loss(s[0::2], s[1::2], ref[0::2], ref[1::2], beta=0.1).mean()

            methods = {"naive": functools.partial(naive_sequence_backward, model, rollouts, loss),
                       "padded": functools.partial(_padded_dpo, model, rollouts, ref, P),
                       "branchreplay": functools.partial(replay_sequence_backward, model, trees, loss)}
            works = {"naive": F.naive_work(rollouts), "padded": F.padded_work(rollouts),
                     "branchreplay": sum((F.tree_work(t) for t in trees[1:]), F.tree_work(trees[0]))}
            flops = {m: w.flops(shape) for m, w in works.items()}
            flops["branchreplay"] = flops["branchreplay"] * 4 // 3  # + pass 1, a forward without a graph
            stats = sum((t.stats for t in trees[1:]), trees[0].stats)
            rows += _side_by_side("dpo-pairs", f"P={P} R={R} pairs={pairs}", methods, flops,
                                  {m: w.positions for m, w in works.items()}, [model], stats, log)
    return rows


def _ppo_rollouts(rollouts: list[Rollout], g: torch.Generator) -> list[Rollout]:
    """The rollouts with what one PPO update reads: per-token advantages, token-mean weights, old logprobs off the
    current ones (some ratios clip), returns and old values."""
    weights = token_weights([r.loss_mask for r in rollouts], "bnpo")
    out = []
    for r, w in zip(rollouts, weights, strict=True):
        noise = functools.partial(_noise, r.loss_mask, g)
        out.append(Rollout(r.token_ids, r.loss_mask, advantages=noise(), weights=w,
                           old_logprobs=(-6.0 + 0.2 * noise()) * r.loss_mask, returns=noise(),
                           old_values=0.1 * noise()))
    return out


def _padded_dpo(model, rollouts: list[Rollout], ref: torch.Tensor, P: int):
    """TRL DPOTrainer's concatenated forward: every sequence of the batch as one [2 x pairs, T] batch (equal lengths
    here: no padding), the completion logprobs summed per row, the sigmoid loss, one backward."""
    ids = torch.stack([r.token_ids for r in rollouts]).to(model.device)
    R = ids.shape[1] - P
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=R + 1).logits[:, :-1].float()  # the head on R rows
    logps = torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1).double().sum(-1)
    value = dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta=0.1).mean()
    value.backward()


def _side_by_side(scenario: str, label: str, methods: dict, flops: dict, positions: dict, models: list, stats,
                  log) -> list[dict]:
    """Warm up, time each method once, check its gradient against naive's; one row each (physical: the positions
    the method runs through the decoder per model, padded's pads included)."""
    for fn in methods.values():  # the first call of a method is slower (allocator, kernels)
        _zero(models)
        fn()
    runs, grads = {}, {}
    for name, fn in methods.items():
        if log:
            log(f"{scenario} {label}: {name} ...")
        _zero(models)
        runs[name] = measure(fn, next(models[0].parameters()).device)
        grads[name] = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                       for m in models for p in m.parameters()]
    rows = []
    for name, m in runs.items():
        rows.append({"scenario": scenario, "label": label, "method": name, "logical_tokens": stats.logical_tokens,
                     "physical_tokens": positions[name], "flops": flops[name],
                     "flop_ratio": flops["naive"] / flops[name], "seconds": m.seconds,
                     "speedup": runs["naive"].seconds / m.seconds, "peak_bytes": m.peak_bytes,
                     "max_rel_grad_err": max_rel_grad_err(grads[name], grads["naive"])})
    return rows


def _zero(models) -> None:
    for m in models:
        m.zero_grad(set_to_none=True)


def format_objective_table(loss: str, rows: list[dict], header: str) -> str:
    """The rows of `run_ppo` / `run_dpo` for people."""
    lines = [header, f"loss: {loss}; speedup = naive time / method time (one run each, after a warm-up); "
             "flop-ratio = naive FLOPs / the method's", ""]
    w = max([len(r["label"]) for r in rows] + [6]) + 2
    head = (f"{'scenario':<14}{'config':<{w}}{'method':<14}{'logical':>9}{'physical':>10}{'GFLOP':>9}"
            f"{'flop-ratio':>11}{'time s':>9}{'speedup':>9}{'peak MiB':>10}{'grad err':>10}")
    lines += [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['scenario']:<14}{r['label']:<{w}}{r['method']:<14}{r['logical_tokens']:>9}"
                     f"{r['physical_tokens']:>10}{r['flops'] / 1e9:>9.1f}{r['flop_ratio']:>11.2f}"
                     f"{r['seconds']:>9.2f}{r['speedup']:>9.2f}{r['peak_bytes'] / 2**20:>10.0f}"
                     f"{r['max_rel_grad_err']:>10.1e}")
    return "\n".join(lines)


def _random_ids(vocab: int, g: torch.Generator, n: int) -> torch.Tensor:
    """[n] token ids drawn from [3, vocab) with `g`."""
    return torch.randint(3, vocab, (n,), generator=g)


def _noise(mask: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[T] float64 standard normal noise drawn with `g`, 0 where `mask` is."""
    return torch.randn(len(mask), generator=g, dtype=torch.float64) * mask
