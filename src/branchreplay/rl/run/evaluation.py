"""Held-out evaluation: greedy answers to the task's held-out split, scored by the task's reward; for a multi-turn
task, greedy trajectories scored by its environment (`evaluate_agent`).
Measurements: docs/notes/sampler.md."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.table import Table

from ...decode.config import SamplingConfig
from ...decode.loop import Sample, eos_token_ids
from ...decode.packed_linears import packed_linears
from ...decode.turns import InProcessTurns
from ...engine.parallel.distributed import raise_together
from ...models import apply_lora, autocast, load_policy
from ..agent.task import bind, context_limit, load_agent_task, trajectory_metrics, trajectory_reward
from ..config import Config
from ..config.task import reward_specs
from ..data.rewards import RewardFunctionError, make_rewards, score
from ..data.tasks import load_task, prompt_token_ids
from ..rollouts.trajectories import Limits, sample_trajectories_turnwise
from .checkpoint import load_weights
from .log import held_out_progress, run_console

if TYPE_CHECKING:
    from .parallel import Ranks

EVAL_BATCH = 16  # held-out prompts decoded together


@torch.no_grad()
def evaluate(model, tokenizer, config: Config, data=None, reward_fn=None, progress=None, ranks: Ranks | None = None,
             env=None
             ) -> dict:
    """Held-out score with greedy decoding, up to sampling.max_new_tokens tokens per answer.

    data: items (default: the task's held-out split, task.eval_size items); reward_fn: a `rewards.RewardFunctions`
    or one TRL-style function (default: task.reward, `rewards.make_rewards`); progress: called as progress(done,
    total) after each batch of answers; ranks: a data-parallel run's `rl.run.parallel.Ranks`, which evaluate items rank,
    rank + world, ... each and gather the scores (every rank returns the same metrics). Returns the mean reward as
    eval/accuracy when the task's scores are one (`score_name`: in [0, 1] for the task's verifier, partial credit
    included), else as eval/reward (custom or weighted rewards keep their range), eval/frac_correct (fraction
    scoring 1), eval/mean_length (tokens), time/eval_s.
    env: a multi-turn environment (with `data` its held-out items): `evaluate_agent`'s metrics instead."""
    if env is not None:
        return evaluate_agent(model, tokenizer, config, env, data, eos_token_ids(model, tokenizer), progress,
                              EVAL_BATCH)
    t0 = time.perf_counter()
    if data is None:
        data = load_task(config.task)[1]
    reward_fn = reward_fn or make_rewards(config.task, data)
    if len(data) == 0:
        raise ValueError("the held-out split is empty (task.eval_size=0, or an empty task.eval_dataset): hold out "
                         "some items, or set train.eval_steps -1")
    indices = ranks.mine(len(data)) if ranks is not None else range(len(data))
    items = [data[i] for i in indices]
    try:
        prompts = [prompt_token_ids(tokenizer, item, config.task) for item in items]
        completions = greedy_completions(model, prompts, config.sampling.max_new_tokens,
                                         eos_token_ids(model, tokenizer), progress=progress,
                                         pack_weights=config.sampling.pack_weights)
        samples = [[Sample(c, [0.0] * len(c), truncated=False)] for c in completions]
        scores = score(reward_fn, tokenizer, items, samples, config.task).tolist() if items else []
        lengths, error = [len(c) for c in completions], None
    except Exception as e:  # noqa: BLE001 (re-raised on every rank: the others would wait in the gather)
        if ranks is None:
            raise
        scores, lengths, error = [], [], e
    if ranks is not None:
        with ranks.waiting():
            raise_together(error, "held-out evaluation", kinds=(RewardFunctionError,))
        parts = ranks.gather((scores, lengths))
        scores, lengths = [x for p, _ in parts for x in p], [n for _, ln in parts for n in ln]
    scores_t = torch.tensor(scores)
    return {score_key(config): scores_t.mean().item(), "eval/frac_correct": (scores_t == 1).float().mean().item(),
            "eval/mean_length": sum(lengths) / len(lengths), "time/eval_s": time.perf_counter() - t0}


@torch.no_grad()
@torch.no_grad()
def evaluate_agent(model, tokenizer, config: Config, env, items, eos, progress=None, batch_size: int = 16) -> dict:
    """Greedy multi-turn held-out evaluation: one trajectory per item (top-1 token at every step), up to
    agent.max_turns replies of sampling.max_new_tokens, in the run's sampling.cache_implementation. Returns
    eval/accuracy (mean final reward: the task's success), eval/frac_correct (final reward 1), eval/reward (the
    combined reward trained on), eval/turns_mean, eval/tool_calls_mean, eval/mean_length (assistant tokens) and
    time/eval_s. Items that raise ItemError are skipped with a warning (eval/skipped counts them). The items run
    `batch_size` at a time (progress(done, total) after each batch), each turn of a batch's items in one decoding
    loop, the start their openings share prefilled once per batch (`decode.turns.InProcessTurns`)."""
    t0, a, s = time.perf_counter(), config.agent, config.sampling
    greedy = SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=s.max_new_tokens,
                            cache_implementation=s.cache_implementation, enforce_eager=s.enforce_eager,
                            pack_weights=s.pack_weights)
    limits = Limits(a.max_turns, context_limit(a, model), a.max_tool_output_tokens)
    done, skipped = [], 0
    with packed_linears(model, s.pack_weights, rows=batch_size):  # a turn's most replies: one per item
        for first in range(0, len(items), batch_size):
            if progress is not None:
                progress(first, len(items))
            turns = InProcessTurns(model, greedy, eos, lambda k, path: None)
            batch = [items[k] for k in range(first, min(first + batch_size, len(items)))]  # a dataset: no slices
            drawn, errors = sample_trajectories_turnwise(turns, tokenizer, env, batch, (1,), greedy, limits)
            for why in errors:
                warnings.warn(f"a held-out item was skipped: {why}", RuntimeWarning, stacklevel=2)
            done += [t for k in sorted(drawn) for t in drawn[k]]
            skipped += len(errors)
    if progress is not None:
        progress(len(items), len(items))
    n, counts = max(len(done), 1), trajectory_metrics([done])
    return {"eval/accuracy": sum(t.reward for t in done) / n,
            "eval/frac_correct": sum(t.reward == 1 for t in done) / n,
            "eval/reward": sum(trajectory_reward(t, a) for t in done) / n,
            "eval/turns_mean": counts["turns/mean"],
            "eval/tool_calls_mean": counts["tool_calls/mean"],
            "eval/mean_length": sum(sum(t.conversation.loss_mask) for t in done) / n,
            "eval/skipped": skipped, "time/eval_s": time.perf_counter() - t0}


def greedy_completions(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int],
                       batch_size: int = EVAL_BATCH, progress=None, pack_weights: bool = True) -> list[list[int]]:
    """Greedy completions (ending with their EOS if any) of `prompts`, `batch_size` at a time, left-padded with an
    EOS id under an attention mask (HF generate; on SmolLM2 this gives the same tokens as decoding each prompt alone,
    in less time). progress(done, total) is called before the first batch and after each.
    pack_weights: the linear layers from MKL-packed weights on the CPU in float32 (`packed_linears`)."""
    pad, out = min(eos), []
    with packed_linears(model, pack_weights, rows=batch_size):
        for i in range(0, len(prompts), batch_size):
            if progress is not None:
                progress(i, len(prompts))
            chunk = prompts[i : i + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
            generated = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                       max_new_tokens=max_new_tokens, eos_token_id=sorted(eos),
                                       pad_token_id=pad)[:, width:].tolist()
            for row in generated:
                end = next((k for k, t in enumerate(row) if t in eos), len(row) - 1)
                out.append(row[: end + 1])
    if progress is not None:
        progress(len(out), len(prompts))
    return out


def score_name(config: Config, env=None) -> str:
    """What the held-out score (eval/accuracy) is, for people: "accuracy" when the task says its scores are one (the
    task's verifier or math_verify alone, each in [0, 1]; an environment with `scores_accuracy` True, as the
    built-in ones), else "mean reward" (a user's reward functions and environments keep their own range)."""
    if env is not None:
        return "accuracy" if getattr(env, "scores_accuracy", False) else "mean reward"
    graded = all(spec in ("task", "math_verify") for spec in reward_specs(config.task.reward))
    weights = config.task.reward_weights
    return "accuracy" if graded and len(reward_specs(config.task.reward)) == 1 and not weights else "mean reward"


def score_key(config: Config, env=None) -> str:
    """The metric of the held-out score: "eval/accuracy" when it is one (`score_name`) or an environment scores the
    run (`evaluate_agent`'s metrics), else "eval/reward" (the mean of the user's own rewards)."""
    return "eval/accuracy" if env is not None or score_name(config) == "accuracy" else "eval/reward"


def evaluate_cli(config: Config, checkpoint: str | None) -> dict:
    """Evaluate model.spec, with a checkpoint's weights if given (a checkpoint folder or a run folder), on the
    held-out split; prints and returns the metrics."""
    env = None  # the task, its reward and the checkpoint's folder before the model's load
    if config.agent.environment is not None:
        env, _, data = load_agent_task(config)
        reward_fn = None
    else:
        data = load_task(config.task)[1]
        reward_fn = make_rewards(config.task, data)
        if config.task.dataset is not None and config.task.eval_dataset is None and config.train.eval_steps < 0:
            warnings.warn(f"the run trained on every row of {config.task.dataset} (train.eval_steps -1): its last "
                          f"{len(data)} rows, scored here, were trained on; give --task.eval_dataset for a held-out "
                          "score", RuntimeWarning, stacklevel=2)
    if checkpoint is not None and not Path(checkpoint).is_dir():
        raise FileNotFoundError(f"--checkpoint {checkpoint}: no such folder (give a run folder or a checkpoint "
                                "folder)")
    model, tokenizer = load_policy(config.model.spec, config.model.dtype, config.model.device)
    if config.model.lora_r:  # the run's adapter layers, which the checkpoint's adapter fills
        model = apply_lora(model, config.model.lora_r, config.model.lora_alpha, config.model.lora_targets())
    if checkpoint is not None:
        load_weights(model, checkpoint)
    if env is not None:
        bind(env, tokenizer)
    console = run_console()
    progress = held_out_progress(console, always=True)
    with autocast(config.model.dtype, model.device.type):  # as the trainer's held-out eval computes it
        metrics = evaluate(model, tokenizer, config, data, reward_fn, progress=progress, env=env)
    name = config.agent.environment or config.task.eval_dataset or config.task.dataset or config.task.name
    table = Table(title=f"held-out {name} ({len(data)} items)")  # the data actually scored
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        table.add_row(key, f"{value:.4g}")
    console.print(table)
    return metrics
