"""Preference pairs for DPO: (prompt, chosen, rejected) rows from a local file, tokenized as TRL 1.16's DPOTrainer
tokenizes them, and the prefix trees they make.

A row is plain (three strings) or conversational (three lists of {"role", "content"} messages: the prompt's turns,
and the chosen and rejected assistant turns), TRL's two preference formats. The file is JSONL, JSON or Parquet,
read offline with Hugging Face `datasets`; `load_preferences` says how each format is tokenized. Sequences longer
than `max_length` keep their start (TRL's truncation_mode="keep_start"). Over a tree, the prompt is one node and
chosen and rejected are branches that share a node where their responses share a prefix; pairs with the same
prompt share one tree (`pair_trees`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ...models import chat_prompt_ids
from ...tree import Rollout, RolloutTree
from .cells import check_columns
from .datafiles import read_rows
from .order import prompt_indices


@dataclass
class PreferencePair:
    """One row, tokenized: prompt_ids [P], chosen_ids [C], rejected_ids [R] (int token ids; C, R >= 1); `row` is
    its index in the file."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    row: int


def load_preferences(path: str | Path, tokenizer, max_length: int | None = None) -> tuple[list[PreferencePair], int]:
    """The pairs of a preference file and how many rows were skipped (chosen equal to rejected, with a warning).

    Tokenized as TRL 1.16's DPOTrainer tokenizes them:

        plain           EOS appended to chosen and rejected unless they end with it; prompt, prompt + chosen and
                        prompt + rejected tokenized as whole strings, the responses starting where the ids diverge
                        from the prompt's (tokens that merge across the boundary: TRL trims the prompt there too)
        conversational  prompt ids = the chat template of the prompt with the generation prompt
                        (`models.chat_prompt_ids`, as the sampler renders prompts); chosen ids = the template of
                        prompt + chosen, minus those prompt ids (so chosen and rejected continue the SAME prompt ids;
                        a template that renders the prompt differently inside the whole conversation is refused by
                        row)

    Also skipped, with a warning: rows whose prompt alone fills max_length tokens (TRL drops them too).
    Raises:
        FileNotFoundError: no such file.
        ValueError: an unknown extension, a missing column (naming the columns found), a prompt, chosen or
            rejected that is empty or not text (`cells.check_columns`: naming the row and column), a row of mixed
            formats, a conversational row whose prompt does not re-render as the
            prefix of prompt + response under the chat template (naming the row), or no pair left.
    """
    path = Path(path)
    columns = ("prompt", "chosen", "rejected")
    rows = read_rows(path, "dpo.dataset", columns, "rows need prompt, chosen and rejected, as TRL's")
    check_columns(rows, f"dpo.dataset {path}", text=columns)
    pairs, skipped, too_long = [], 0, 0
    for i, (where, row) in enumerate(rows):
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
        if chosen == rejected:
            skipped += 1
            continue
        prompt_ids, chosen_ids, rejected_ids = _tokenize(tokenizer, prompt, chosen, rejected, f"{path} {where}")
        if max_length is not None:
            if len(prompt_ids) >= max_length:  # no room for a response: dropped, as TRL's filter does
                too_long += 1
                continue
            room = max_length - len(prompt_ids)
            chosen_ids, rejected_ids = chosen_ids[:room], rejected_ids[:room]
        pairs.append(PreferencePair(prompt_ids, chosen_ids, rejected_ids, i))
    if skipped:
        warnings.warn(f"dpo.dataset {path}: skipped {skipped} row(s) whose chosen equals rejected (no preference)",
                      RuntimeWarning, stacklevel=2)
    if too_long:
        warnings.warn(f"dpo.dataset {path}: skipped {too_long} row(s) whose prompt has dpo.max_length={max_length} "
                      "tokens or more (no room for a response); raise dpo.max_length to keep them",
                      RuntimeWarning, stacklevel=2)
    if not pairs:
        raise ValueError(f"dpo.dataset {path} holds no usable preference pair")
    return pairs, skipped + too_long


def pair_trees(pairs: list[PreferencePair]) -> tuple[list[RolloutTree], list[PreferencePair]]:
    """Trees of `pairs`, the pairs of one prompt in one tree; each tree's rollouts are chosen, rejected, chosen,
    rejected, ... of its pairs, loss mask 1 on the responses. Returns (trees, the pairs in the trees' order), so that
    the k-th chosen / rejected summed logprob of the trees belongs to the k-th returned pair."""
    by_prompt: dict[tuple, list[PreferencePair]] = {}
    for p in pairs:
        by_prompt.setdefault(tuple(p.prompt_ids), []).append(p)
    trees, ordered = [], []
    for group in by_prompt.values():
        rollouts = []
        for p in group:
            for response in (p.chosen_ids, p.rejected_ids):
                rollouts.append(Rollout(p.prompt_ids + response,
                                        loss_mask=[0.0] * len(p.prompt_ids) + [1.0] * len(response)))
        trees.append(RolloutTree(rollouts))
        ordered += group
    return trees, ordered


def _tokenize(tokenizer, prompt, chosen, rejected, where: str) -> tuple[list[int], list[int], list[int]]:
    conversational = [isinstance(x, list) for x in (prompt, chosen, rejected)]
    if any(conversational) and not all(conversational):
        raise ValueError(f"dpo.dataset {where}: prompt, chosen and rejected must all be text or all be lists of "
                         "messages")
    if not all(conversational):  # TRL 1.16 DPOTrainer: add_eos, then tokenize_fn
        eos = getattr(tokenizer, "eos_token", None) or ""
        chosen, rejected = (x if x.endswith(eos) else x + eos for x in (chosen, rejected))
        prompt_ids = list(tokenizer(prompt).input_ids)
        full = [list(tokenizer(prompt + x).input_ids) for x in (chosen, rejected)]
        n = len(os.path.commonprefix([prompt_ids, *full]))
        return prompt_ids[:n], full[0][n:], full[1][n:]
    prompt_ids = chat_prompt_ids(tokenizer, prompt)  # as the sampler renders a prompt (one BOS)
    responses = []
    for response in (chosen, rejected):
        full = chat_prompt_ids(tokenizer, prompt + response, add_generation_prompt=False)
        if full[: len(prompt_ids)] != prompt_ids:
            raise ValueError(
                f"dpo.dataset {where}: the chat template renders the prompt differently inside prompt + response "
                f"({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}), so the response would not "
                "continue the prompt's token ids; use a template that is prefix-stable, or plain-text rows")
        responses.append(full[len(prompt_ids):])
    return prompt_ids, responses[0], responses[1]


@dataclass
class PairBatch:
    """A DPO step's batch: `trees` (`pair_trees`) and `pairs` in the trees' order; the rollouts of the trees are
    chosen, rejected, chosen, ... of the pairs. `everything`: a batch of every pair of the data
    (dpo.precompute_ref_log_probs). Nothing is sampled: no sampler logprobs, no completions to log."""

    trees: list[RolloutTree]
    pairs: list[PreferencePair]
    everything: object = None
    sampler_logprobs: None = None
    metrics: dict = field(default_factory=dict)

    @property
    def logical_tokens(self) -> int:
        return sum(t.stats.logical_tokens for t in self.trees)

    def step_metrics(self) -> dict:
        return {}

    def completions(self, tokenizer, advantages: bool = True) -> list[dict]:
        return []


class PairBatches:
    """The preference pairs of a run, `per_step` of them a step, in the seeded order of `order.prompt_indices`."""

    def __init__(self, pairs: list[PreferencePair], per_step: int, seed: int):
        self.pairs, self.per_step, self.seed = pairs, per_step, seed

    def sample(self, step: int) -> PairBatch:
        """The pairs of `step` (>= 1) and their trees: a step's batch, as a sampler's (nothing is drawn)."""
        picked = [self.pairs[i] for i in prompt_indices(len(self.pairs), self.per_step, self.seed, step)]
        return PairBatch(*pair_trees(picked), everything=self.all)

    def score(self, batch: PairBatch) -> PairBatch:
        """`batch` as it is: a preference is its own score."""
        return batch

    def all(self) -> PairBatch:
        """Every pair of the data, as one batch."""
        return PairBatch(*pair_trees(self.pairs))
