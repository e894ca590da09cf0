"""`branchreplay estimate`: will the tree help this run? Before any training, from the run's config and its own
prompts (tokenized, nothing sampled), the step's token ratio and FLOP ratio, the speed-up they predict, and the
memory of the largest step's tree against the per-rollout path and TRL's padded batch.

Each step of `grpo.prompts_per_step` prompts is laid out as the trainer lays it out: each prompt with
`grpo.num_generations` completions of C tokens (`--completion-tokens`, default `sampling.max_new_tokens`, the most a
completion takes), the completions of distinct random tokens (they share nothing), one tree over the step
(`tree.RolloutTree`: prompts that share a start, a system prompt or few-shot turns, share it too). Then:

    token ratio       positions of every rollout / positions the tree computes
    FLOP ratio        `reference.work`: naive_work FLOPs / tree_work FLOPs (forward + backward, LM head included)
    speed-up          the FLOP ratio, and the range SPEEDUP_RANGE around it: what the CPU bench measured against the
                      naive per-rollout path on its shared-prompt and low-sharing rows (docs/benchmarks.md)
    memory            `reference.memory`: activations only (parameters, gradients and optimizer state come on top):
                      one rollout at a time (the longest), the step as one padded batch, and the tree's largest step
                      (its prompt's activations and K/V kept, one pack of children at a time)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..engine.families import state_bytes_per_token
from ..reference.memory import PEAK_OVER_SAVED, activation_bytes_per_token, padded_peak_bytes
from ..reference.work import ModelShape, naive_work, tree_work
from ..tree import Rollout, RolloutTree
from .config import Config

SPEEDUP_RANGE = (0.85, 1.3)
"""The measured speed-up over the FLOP ratio on the CPU bench's current rows against naive: 0.85 to 1.27 on the
shared-prompt, low-sharing and demo-shape rows of results/ (tests/test_rl_estimate.py; the table in
docs/benchmarks.md), the range an estimate prints around the FLOP ratio."""


@dataclass
class Estimate:
    """The figures of `estimate` (module docstring): per step, logical and physical positions summed over the
    steps; FLOPs of naive and of the tree; peak bytes of one rollout alone, TRL's padded batch, the tree."""

    steps: int
    prompts: int
    prompt_tokens: tuple[int, int, int]  # min, mean, max
    group: int
    completion_tokens: int
    logical: int
    physical: int
    naive_flops: int
    tree_flops: int
    naive_peak: int
    padded_peak: int
    tree_peak: int

    @property
    def token_ratio(self) -> float:
        return self.logical / self.physical

    @property
    def flop_ratio(self) -> float:
        return self.naive_flops / self.tree_flops

    @property
    def speedup(self) -> tuple[float, float]:
        low, high = SPEEDUP_RANGE
        return low * self.flop_ratio, high * self.flop_ratio


def estimate(config: Config, prompt_ids: list[list[int]], model_config, completion_tokens: int | None = None,
             dtype: torch.dtype = torch.float32, seed: int = 0) -> Estimate:
    """The `Estimate` of `config`'s steps over `prompt_ids` (the tokenized prompts, in order; the last step may
    hold fewer), on a model of `model_config` (a transformers config: sizes only, no weights)."""
    G, per_step = config.grpo.num_generations, config.grpo.prompts_per_step
    C = completion_tokens or config.sampling.max_new_tokens
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # the sizes only: no weights allocated
        shape = ModelShape.of(AutoModelForCausalLM.from_config(model_config))
    vocab = model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    logical = physical = naive = tree = 0
    tree_peak = padded_peak = 0
    per_token = activation_bytes_per_token(model_config, dtype)
    kv_per_token, kv_sliding = state_bytes_per_token(model_config, dtype)  # a prefix's K/V (or MLA latent) bytes
    for start in range(0, len(prompt_ids), per_step):
        rollouts = [Rollout(torch.tensor(p + torch.randint(3, vocab, (C,), generator=g).tolist()),
                            loss_mask=torch.tensor([0] * len(p) + [1] * C))
                    for p in prompt_ids[start : start + per_step] for _ in range(G)]
        step = RolloutTree(rollouts)
        logical += step.stats.logical_tokens
        physical += step.stats.physical_tokens
        naive += naive_work(rollouts).flops(shape)
        tree += tree_work(step).flops(shape)
        padded_peak = max(padded_peak, padded_peak_bytes(rollouts, model_config, dtype))
        longest = max(len(p) for p in prompt_ids[start : start + per_step])
        pack = min(G * C, config.engine.max_pack_tokens)
        prefix_state = kv_per_token * longest + kv_sliding  # held for the children, and its gradient: twice
        tree_peak = max(tree_peak, int(PEAK_OVER_SAVED * per_token * (longest + pack) + 2 * prefix_state
                                      + 3 * 4 * pack * vocab))
    lengths = [len(p) for p in prompt_ids]
    longest_rollout = max(lengths) + C
    naive_peak = int(PEAK_OVER_SAVED * per_token * longest_rollout + 3 * 4 * (C + 1) * vocab)
    return Estimate(-(-len(prompt_ids) // per_step), len(prompt_ids),
                    (min(lengths), round(sum(lengths) / len(lengths)), max(lengths)), G, C, logical, physical,
                    naive, tree, naive_peak, padded_peak, tree_peak)


def estimate_cli(config: Config, dataset: str | None, completion_tokens: str | None, prompts: str | None) -> str:
    """`branchreplay estimate`: the run's first `prompts` (default 64) training prompts, or those of `dataset` (a
    JSONL, JSON or Parquet file with the task's prompt column), tokenized with the model's tokenizer and laid out as
    `estimate` does; the model's config for the sizes (no weights are loaded). Returns `report`'s text.

    Raises:
        ValueError: naming the option, for a count that is not a positive integer; what reading the prompts raises.
    """
    from transformers import AutoConfig, AutoTokenizer

    from ..models import model_folder
    from .data.tasks import checked_rows, load_task, prompt_token_ids

    count = _positive("--prompts", prompts, 64)
    tokens = _positive("--completion-tokens", completion_tokens, config.sampling.max_new_tokens)
    task = config.task
    if dataset is not None:
        items = [dict(row, question=row[task.prompt_column]) for row in checked_rows(
            dataset, "--dataset", (task.prompt_column,), "set --task.prompt_column to the file's prompt column", ())]
        task = dataclasses.replace(task, dataset=dataset, reward="math_verify")  # tokenized as the run would; no reward
    else:
        items = load_task(task, hold_out=False)[0]
    items = [items[i] for i in range(min(count, len(items)))]
    folder = model_folder(config.model.spec)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = [prompt_token_ids(tokenizer, item, task) for item in items]
    return report(estimate(config, prompt_ids, AutoConfig.from_pretrained(folder), tokens))


def _positive(option: str, value: str | None, default: int) -> int:
    if value is None:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{option}={value!r}: a whole number >= 1")
    return int(value)


def report(e: Estimate) -> str:
    """The estimate for people, a few lines."""
    gib = 2 ** 30
    low, high = e.speedup
    return "\n".join([
        f"{e.prompts} prompts in {e.steps} steps: prompts of {e.prompt_tokens[0]} to {e.prompt_tokens[2]} tokens "
        f"(mean {e.prompt_tokens[1]}), {e.group} completions of {e.completion_tokens} tokens each",
        f"token ratio {e.token_ratio:.2f} (positions of every rollout / positions the tree computes)",
        f"FLOP ratio {e.flop_ratio:.2f} (forward + backward, LM head included)",
        f"predicted speed-up over the per-rollout path: about {e.flop_ratio:.1f}x ({low:.1f}x to {high:.1f}x, the "
        "range the CPU bench measured around the FLOP ratio)"
        + ("; at this little sharing the engine runs each rollout alone where the tree would not pay"
           if e.flop_ratio < 1.3 else ""),
        "activation memory of a step (estimated; the parameters, gradients and optimizer state come on top): "
        f"tree {e.tree_peak / gib:.2f} GiB, one rollout at a time "
        f"{e.naive_peak / gib:.2f} GiB, the step as one padded batch (TRL's layout) {e.padded_peak / gib:.2f} GiB",
    ])
