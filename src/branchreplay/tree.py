"""Rollouts and the prefix tree (radix trie) built from them.

A rollout is one token sequence (prompt + completion, or a whole agent trajectory) with a per-position trainable
mask. Rollouts that share a prefix share the nodes of the tree: a node is a maximal segment of tokens that the same
set of rollouts passes through. Every position of a node has ONE context, hence one logprob, shared by all the
rollouts through it; advantages and loss weights stay per rollout.

Shape letters: T positions of one rollout, L positions of one node, k rollouts through a node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Rollout:
    """One token sequence and its per-position training data.

    Args:
        token_ids: [T] int token ids of ONE rollout (1-D), prompt first. T >= 1.
        loss_mask: [T] 0/1, 1 on positions whose logprob is trained (generated tokens), 0 on prompt and tool output.
            Position 0 has no context and must be 0. Default: all 0 (nothing trained).
        advantages: a float (one advantage for every position) or [T] per-token advantages. Default 0.
        weights: [T] float loss weight of each position (the loss normalisation, e.g. 1 / (|o| * G) for GRPO).
            Must be 0 where loss_mask is 0. Default: loss_mask.
        old_logprobs: [T] finite logprobs under the policy that sampled the rollout (PPO ratio), or None
            (on-policy).
        ref_logprobs: [T] finite logprobs under the reference model (KL penalty), or None.
        returns: [T] finite value targets of a critic (PPO: GAE advantages + values), or None.
        old_values: [T] finite values of the critic before the update (PPO's value clipping), or None.
        group: id of the group (prompt) the rollout belongs to; used for advantages, not by the tree.
    Raises:
        ValueError: naming the field: token_ids empty or not 1-D (a [B, T] batch), a per-position field of another
            shape, a loss mask other than 0/1 or trained at position 0, NaN or inf advantages, weights, old or ref
            logprobs, weights where the loss mask is 0.
    """

    token_ids: torch.Tensor | list[int]
    loss_mask: torch.Tensor | list[float] | None = None
    advantages: torch.Tensor | list[float] | float = 0.0
    weights: torch.Tensor | list[float] | None = None
    old_logprobs: torch.Tensor | list[float] | None = None
    ref_logprobs: torch.Tensor | list[float] | None = None
    returns: torch.Tensor | list[float] | None = None
    old_values: torch.Tensor | list[float] | None = None
    group: int | str | None = None

    def __post_init__(self):
        ids = torch.as_tensor(self.token_ids, dtype=torch.long, device="cpu")  # the tree and engine index on the CPU
        if ids.dim() != 1:
            raise ValueError(
                f"Rollout.token_ids has shape {tuple(ids.shape)}, expected [T]: one rollout's ids (prompt + "
                "completion); for a [B, T] batch make one Rollout per row, without its padding"
            )
        self.token_ids = ids
        T = self.token_ids.numel()
        if T == 0:
            raise ValueError("Rollout.token_ids is empty: a rollout needs at least one token (the prompt)")
        self.loss_mask = _per_position(self.loss_mask, T, "loss_mask", default=0.0)
        if torch.any((self.loss_mask != 0) & (self.loss_mask != 1)):
            raise ValueError("Rollout.loss_mask must hold only 0 and 1")
        if self.loss_mask[0] != 0:
            raise ValueError("Rollout.loss_mask[0] must be 0: the first token has no context to predict it from")
        if isinstance(self.advantages, (int, float)):
            self.advantages = torch.full((T,), float(self.advantages), dtype=torch.float64)
        else:
            self.advantages = _per_position(self.advantages, T, "advantages")
        if not torch.isfinite(self.advantages).all():
            raise ValueError("Rollout.advantages holds NaN or inf; check the reward and its normalisation")
        self.weights = _per_position(self.weights, T, "weights", default=None)
        if self.weights is None:
            self.weights = self.loss_mask.clone()
        if not torch.isfinite(self.weights).all():
            raise ValueError("Rollout.weights holds NaN or inf")
        if torch.any((self.weights != 0) & (self.loss_mask == 0)):
            raise ValueError("Rollout.weights is non-zero where loss_mask is 0; zero it there or set loss_mask to 1")
        self.old_logprobs = _per_position(self.old_logprobs, T, "old_logprobs", default=None)
        for name in ("ref_logprobs", "returns", "old_values"):
            setattr(self, name, _per_position(getattr(self, name), T, name, default=None))
        for name in ("old_logprobs", "ref_logprobs", "returns", "old_values"):
            values = getattr(self, name)
            if values is not None and not torch.isfinite(values).all():
                t = int((~torch.isfinite(values)).nonzero()[0])
                raise ValueError(
                    f"Rollout.{name}[{t}] is {values[t].item()}: it must be finite (it enters the loss); recompute "
                    "it, or pass 0 at positions that carry no loss"
                )

    def __len__(self) -> int:
        return self.token_ids.numel()


def _per_position(x, T: int, name: str, default=0.0) -> torch.Tensor | None:
    if x is None:
        return None if default is None else torch.full((T,), default, dtype=torch.float64)
    x = torch.as_tensor(x, dtype=torch.float64, device="cpu")
    if x.shape != (T,):
        raise ValueError(f"Rollout.{name} has shape {tuple(x.shape)}, expected ({T},) like token_ids")
    return x


@dataclass(eq=False)
class Node:
    """A maximal segment of tokens shared by the same rollouts.

    Attributes:
        tokens: [L] token ids of the segment (L >= 1, except the virtual root, L = 0).
        start: absolute position of tokens[0] in every rollout through the node (tokens).
        rollouts: indices of the rollouts that pass through every position of the node.
        children: nodes that continue it; their rollouts partition those of this node that go on.
    """

    tokens: torch.Tensor
    start: int
    rollouts: list[int]
    children: list[Node] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.tokens.numel()

    def __len__(self) -> int:
        return self.tokens.numel()


@dataclass(frozen=True)
class TreeStats:
    """Size of a tree (or forest) in token positions.

    logical_tokens: sum of rollout lengths (what a per-rollout computation processes).
    physical_tokens: unique positions (what the execution stack processes).
    token_ratio: logical / physical. nodes: number of nodes. depth: nodes on the longest root-to-leaf path.
    """

    logical_tokens: int
    physical_tokens: int
    nodes: int
    depth: int
    rollouts: int

    @property
    def token_ratio(self) -> float:
        return self.logical_tokens / max(self.physical_tokens, 1)

    def __add__(self, other: TreeStats) -> TreeStats:
        return TreeStats(
            self.logical_tokens + other.logical_tokens,
            self.physical_tokens + other.physical_tokens,
            self.nodes + other.nodes,
            max(self.depth, other.depth),
            self.rollouts + other.rollouts,
        )


@dataclass
class ReplayResult:
    """Output of a forward (and backward) over rollouts: the engine's `replay_backward` / `replay_logprobs` and the
    naive reference `reference.naive.naive_backward`. One entry per rollout of each tree, in order.

    logprobs: per rollout, [T] detached logprobs at trainable positions (loss_mask 1), 0 elsewhere; float64 for a
        float64 model, else float32.
    entropy: per rollout, [T] detached next-token entropy (nats) at the same positions, 0 elsewhere; same dtype.
    loss: the loss summed over the trees (a Python float; 0.0 without a loss).
    stats: tree sizes summed over the trees.
    predicted_peak_bytes: the planner's prediction of the step's peak memory (largest over the trees; None without
        a loss, and for the reference).
    replayed_packs: number of packs replayed (recomputed before their backward).
    values: a critic's (`value.is_value_model`) per rollout [T] values at the trainable positions, 0 elsewhere,
        same dtype as logprobs; its logprobs and entropy are then empty lists. None for a policy.
    shared_nodes_kept, shared_nodes_merged: the engine's schedule (`engine/schedule.py`): shared nodes run once, and
        shared nodes run again inside each child because their sharing saved less than a pack costs.
    head_stats: {name: per rollout [T] float32} of the next-token distribution at the trainable positions, 0
        elsewhere, for the names `replay_logprobs(head_stats=...)` asked for (`engine.head.HEAD_STATS`); else {}.
    """

    logprobs: list[torch.Tensor]
    entropy: list[torch.Tensor]
    loss: float
    stats: TreeStats
    predicted_peak_bytes: float | None = None
    replayed_packs: int = 0
    values: list[torch.Tensor] | None = None
    shared_nodes_kept: int = 0
    shared_nodes_merged: int = 0
    head_stats: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def schedule(self) -> str:
        """"tree" (every shared node ran once), "packed" (none did: each rollout alone) or "mixed"."""
        if not self.shared_nodes_merged:
            return "tree"
        return "packed" if not self.shared_nodes_kept else "mixed"

    @classmethod
    def merge(cls, parts: list[ReplayResult]) -> ReplayResult:
        """The results of consecutive calls (micro-batches, sub-forests) as one: rollouts in order, losses, sizes
        and replayed packs summed, the largest predicted peak. Raises ValueError for an empty list."""
        if not parts:
            raise ValueError("ReplayResult.merge needs at least one result")
        peaks = [p.predicted_peak_bytes for p in parts if p.predicted_peak_bytes is not None]
        return cls(
            logprobs=[lp for p in parts for lp in p.logprobs],
            entropy=[e for p in parts for e in p.entropy],
            loss=sum(p.loss for p in parts),
            stats=sum((p.stats for p in parts[1:]), parts[0].stats),
            predicted_peak_bytes=max(peaks) if peaks else None,
            replayed_packs=sum(p.replayed_packs for p in parts),
            values=[v for p in parts for v in p.values or []] if any(p.values is not None for p in parts) else None,
            shared_nodes_kept=sum(p.shared_nodes_kept for p in parts),
            shared_nodes_merged=sum(p.shared_nodes_merged for p in parts),
            head_stats={name: [v for p in parts for v in p.head_stats[name]] for name in parts[0].head_stats},
        )


class RolloutTree:
    """Prefix tree of rollouts. The root is virtual (no tokens); its children start at position 0.

    Rollouts with different first tokens make a forest under the virtual root; identical rollouts share every node;
    a rollout that is a prefix of another ends at a node boundary. Building is O(logical tokens) with numpy
    comparisons (64 rollouts x 32k tokens build in well under a second; `branchreplay bench` measures it).

    images: the images of the rollouts' shared prompt for a vision-language model (`engine.vision.ImagePrompt`):
        their placeholders must lie in the prefix every rollout shares. Rollouts whose prompts show other images
        need trees of their own (the placeholder tokens are equal, the images not).

    Raises:
        ValueError: no rollouts, a rollout is invalid (see `Rollout`), or an image placeholder outside the shared
            prefix.
    """

    def __init__(self, rollouts: list[Rollout], images=None):
        if len(rollouts) == 0:
            raise ValueError("RolloutTree needs at least one rollout")
        self.rollouts = [r if isinstance(r, Rollout) else Rollout(r) for r in rollouts]
        arrays = [r.token_ids.numpy() for r in self.rollouts]
        self.root = Node(torch.empty(0, dtype=torch.long), 0, list(range(len(arrays))))
        self.root.children = _split(arrays, self.root.rollouts, 0)
        self.stats = self._stats()
        self.images = images
        if images is not None:
            shared = self.root.children[0].tokens if len(self.root.children) == 1 else torch.empty(0, dtype=torch.long)
            images.check(shared)

    def nodes(self) -> list[Node]:
        """All real nodes in depth-first pre-order (parents before children)."""
        out, stack = [], list(reversed(self.root.children))
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children))
        return out

    def _stats(self) -> TreeStats:
        nodes = self.nodes()
        depth, level = 0, [(c, 1) for c in self.root.children]
        while level:
            node, d = level.pop()
            depth = max(depth, d)
            level.extend((c, d + 1) for c in node.children)
        return TreeStats(
            logical_tokens=sum(len(r) for r in self.rollouts),
            physical_tokens=sum(len(n) for n in nodes),
            nodes=len(nodes),
            depth=depth,
            rollouts=len(self.rollouts),
        )


def forest(trees: list[RolloutTree]) -> RolloutTree:
    """One tree of every rollout of `trees`, in their order: a start that rollouts of different trees share (a chat
    template's system prompt, a tool schema, few-shot turns, the opening of an environment) becomes one node, so it
    runs once; rollouts with nothing in common are separate subtrees under the virtual root. Per-rollout data
    (advantages, weights, old and reference logprobs) stay on the rollouts, so a loss written per rollout gives the
    same value and gradient over the forest as over the trees (the step's normalisation is in the weights:
    `losses.token_weights`). The Rollout objects are shared, not copied.

    Raises:
        ValueError: no trees, or a tree with images (`RolloutTree.images` belong to that tree's own prompt).
    """
    if not trees:
        raise ValueError("forest needs at least one tree")
    if any(t.images is not None for t in trees):
        raise ValueError("trees with images cannot join a forest: their images belong to their own prompt")
    if len(trees) == 1:
        return trees[0]
    return RolloutTree([r for t in trees for r in t.rollouts])


def forests(trees: list) -> list:
    """Each run of consecutive `RolloutTree`s that share a start (each tree's rollouts begin with a token the run's
    earlier ones begin with) as one tree (`forest`), so that the start runs once; the trees of a run have no images
    and their rollouts carry the same optional fields (old and reference logprobs, returns, old values: all or
    none, as one tree needs). Anything else (a tree that shares no start with its neighbours, a tree with images,
    the engine's context-parallel parts) stays as it is, so it runs exactly as alone. Rollout order is kept."""
    def key(tree):
        if not isinstance(tree, RolloutTree) or tree.images is not None:
            return None
        first = tree.rollouts[0]
        return tuple(getattr(first, name) is None for name in ("old_logprobs", "ref_logprobs", "returns", "old_values"))

    out, run, starts = [], [], set()
    for tree in trees:
        k = key(tree)
        firsts = {int(child.tokens[0]) for child in tree.root.children} if k is not None else set()
        if run and (k != key(run[0]) or not firsts & starts):
            out.append(forest(run))
            run, starts = [], set()
        if k is None:
            out.append(tree)
        else:
            run.append(tree)
            starts |= firsts
    return out + ([forest(run)] if run else [])


def _split(arrays: list[np.ndarray], members: list[int], d: int) -> list[Node]:
    """Nodes starting at position d for the rollouts `members` (all longer than d), grouped by their token at d.

    Iterative, so that deep trees (long chains of branch points) cannot overflow Python's recursion limit.
    """
    roots: list[Node] = []
    todo = [(grp, d, roots) for grp in reversed(_group_by_token(arrays, members, d))]
    while todo:
        grp, start, siblings = todo.pop()
        end = start + _common_length(arrays, grp, start)
        node = Node(torch.from_numpy(arrays[grp[0]][start:end].copy()), start, grp)
        siblings.append(node)
        going_on = [i for i in grp if len(arrays[i]) > end]
        todo.extend((child, end, node.children) for child in reversed(_group_by_token(arrays, going_on, end)))
    return roots


def _group_by_token(arrays: list[np.ndarray], members: list[int], d: int) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for i in members:
        groups.setdefault(int(arrays[i][d]), []).append(i)
    return list(groups.values())


def _common_length(arrays: list[np.ndarray], members: list[int], start: int) -> int:
    """Length of the longest common segment of `members` from `start` (>= 1: they share the token at start)."""
    n = min(len(arrays[i]) for i in members) - start
    if len(members) == 1:
        return n
    first = arrays[members[0]][start : start + n]
    common = n
    for i in members[1:]:
        diff = np.flatnonzero(arrays[i][start : start + common] != first[:common])
        if diff.size:
            common = int(diff[0])
    return common
