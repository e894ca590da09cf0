"""FLOP counts of one forward + backward of each benchmarked method, from the positions it computes.

Algorithmic counts: matmul FLOPs only (no norms, RoPE, softmax or loss), the backward twice the forward, no
recomputation, attention causal (a query at absolute position t attends t + 1 keys) whatever the method's kernel:

    flops = 3 * (2 * N * positions                              dense layers (N: non-embedding matmul parameters)
                 + 4 * n_layers * d_attn * attention_keys       QK^T and AV, 2 * d_attn FLOPs per (query, key) each
                 + 2 * hidden * vocab * head_rows)              the LM head, on the rows it is computed on

attention_keys: the sum over computed positions of their context length; d_attn = heads * head_dim; each method's
positions: `naive_work`, `padded_work`, `prompt_sharing_work`, `tree_work`. Source: PaLM (Chowdhery et al. 2022),
Appendix B: 6N + 12 * L * H * Q * T FLOPs per token, H * Q = d_attn, T here each query's own causal context.
Design notes: docs/benchmarks.md ("Reading the tables").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import head_dim
from ..tree import Node, Rollout, RolloutTree
from .padded import padded_shape
from .prompt_sharing import prompt_groups

FORMULA = ("3 * (2 * N_nonembedding * positions + 4 * n_layers * d_attn * attention_keys + 2 * hidden * vocab * "
           "head_rows); attention_keys = sum over computed positions of (position + 1); backward = 2 x forward; "
           "recomputation not counted")


@dataclass(frozen=True)
class ModelShape:
    """What the count needs from a model. n_params: non-embedding matmul parameters (embedding and LM head out)."""

    n_params: int
    n_layers: int
    d_attn: int
    hidden: int
    vocab: int

    @classmethod
    def of(cls, model) -> ModelShape:
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        skip = {id(p) for m in (embed, head) for p in m.parameters()}
        n = sum(p.numel() for p in model.parameters() if id(p) not in skip and p.dim() >= 2)
        c = model.config
        return cls(n, c.num_hidden_layers, c.num_attention_heads * head_dim(c), c.hidden_size, c.vocab_size)


@dataclass(frozen=True)
class Work:
    """The positions a method computes. positions: token positions through the decoder; attention_keys: sum of
    their context lengths; head_rows: rows through the LM head."""

    positions: int
    attention_keys: int
    head_rows: int

    def __add__(self, other: Work) -> Work:
        return Work(self.positions + other.positions, self.attention_keys + other.attention_keys,
                    self.head_rows + other.head_rows)

    def flops(self, shape: ModelShape) -> int:
        """FLOPs of forward + backward (see the module docstring)."""
        forward = (2 * shape.n_params * self.positions + 4 * shape.n_layers * shape.d_attn * self.attention_keys
                   + 2 * shape.hidden * shape.vocab * self.head_rows)
        return 3 * forward


NOTHING = Work(0, 0, 0)


def segment(start: int, length: int, head_rows: int = 0) -> Work:
    """`length` positions at absolute positions start .. start + length - 1, each attending causally."""
    return Work(length, length * start + length * (length + 1) // 2, head_rows)


def naive_work(rollouts: list[Rollout]) -> Work:
    """Each rollout alone; HF computes logits on every position."""
    return sum((segment(0, len(r), len(r)) for r in rollouts), NOTHING)


def padded_work(rollouts: list[Rollout]) -> Work:
    """One [B, P_max + C_max] batch (left-padded prompts, right-padded completions, see `padded.padded_shape`);
    head on B x (C_max + 1) rows."""

    B, P_max, C_max = padded_shape(rollouts)
    return Work(B * (P_max + C_max), B * ((P_max + C_max) * (P_max + C_max + 1) // 2), B * (C_max + 1))


def prompt_sharing_work(rollouts: list[Rollout]) -> Work:
    """Each group's shared prompt once, each suffix against the prompt and itself; head on the suffix rows."""

    total = NOTHING
    for P, members in prompt_groups(rollouts):
        total = total + segment(0, P)
        for i in members:
            S = len(rollouts[i]) - P
            total = total + segment(P, S, S)
    return total


def tree_work(tree: RolloutTree) -> Work:
    """Each unique position of the tree once; head on the positions that some rollout through the node trains."""
    total = NOTHING
    for node in tree.nodes():
        total = total + segment(node.start, len(node), _trained_positions(tree, node))
    return total


def _trained_positions(tree: RolloutTree, node: Node) -> int:
    masks = torch.stack([tree.rollouts[i].loss_mask[node.start : node.end] for i in node.rollouts])
    return int((masks.amax(0) > 0).sum())
