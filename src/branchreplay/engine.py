"""The execution stack: exact forward and backward over a tree of rollouts, each unique position computed once.

Depth first over the tree. The children of a node run as packs: their tokens are concatenated into one query
sequence (up to `max_pack_tokens`) against ONE copy of the ancestors' K/V, with a tree mask (each child sees the
whole prefix and its own earlier positions) and absolute position ids. After a pack's forward, the K/V and the last
hidden state of each of its nodes are detached into leaf tensors; the node's children run against those leaves;
once every descendant has run its backward, the leaves hold dL/dK, dL/dV and dL/dh summed over all descendants,
and the pack's backward runs once with them:

    torch.autograd.backward([pack_loss, K_n, V_n, h_last_n, ...], [1, dK_n, dV_n, dh_n, ...])

which accumulates into `param.grad` exactly what `loss.backward()` on the per-rollout sum would (the sum of the
same terms, in a different order: equal to floating-point tolerance).

The first token of a child is predicted from the LAST hidden state of its parent; that term is in the child's loss
and its gradient flows into the parent through dh. The LM head and log-softmax run only on positions that carry a
loss, in chunks under activation checkpointing, so no [positions x vocab] tensor larger than a chunk ever exists.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from .losses import LossInputs
from .state import NodeState, PrefixCache, decoder_and_head, family_of, layer_windows
from .tree import Node, RolloutTree, TreeStats

LossFn = Callable[[LossInputs], torch.Tensor]


@dataclass
class ReplayResult:
    """Output of `replay_backward` / `replay_logprobs`, one entry per rollout of each tree, in order.

    logprobs: per rollout, [T] float32 detached logprobs at trainable positions (loss_mask 1), 0 elsewhere.
    entropy: per rollout, [T] float32 detached next-token entropy (nats) at the same positions, 0 elsewhere.
    loss: the loss summed over the trees (a Python float; 0.0 for `replay_logprobs`).
    stats: tree sizes summed over the trees.
    """

    logprobs: list[torch.Tensor]
    entropy: list[torch.Tensor]
    loss: float
    stats: TreeStats


@dataclass(frozen=True)
class EngineConfig:
    """How the execution stack runs a tree. None of these change the result, only time and memory.

    max_pack_tokens: most tokens of sibling nodes run as one pack (one query sequence against one copy of their
        prefix K/V); a longer node runs alone. Memory of the tree mask: pack x (prefix + pack) bytes.
    chunk_tokens: a node longer than this runs as a chain of chunks of at most this many tokens, each against the
        K/V of the ones before it.
    head_chunk_tokens: rows of the LM head computed at once (memory: head_chunk_tokens x vocab floats).
    replay: "keep" holds every pack's activations until its backward; "replay" holds only the K/V and last hidden
        state it hands to its children and recomputes its forward just before its backward (one more forward per
        pack, activation memory of one pack at a time).
    """

    max_pack_tokens: int = 4096
    chunk_tokens: int = 4096
    head_chunk_tokens: int = 512
    replay: str = "keep"

    def __post_init__(self):
        for name in ("max_pack_tokens", "chunk_tokens", "head_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.replay not in ("keep", "replay"):
            raise ValueError(f"EngineConfig.replay must be 'keep' or 'replay', got {self.replay!r}")


def replay_backward(
    model,
    trees: RolloutTree | list[RolloutTree],
    loss: LossFn,
    *,
    temperature: float = 1.0,
    engine: EngineConfig = EngineConfig(),
) -> ReplayResult:
    """Forward and backward of `loss` over every rollout of `trees`, each unique position computed once.

    Gradients accumulate into `param.grad` as `sum(loss over rollouts).backward()` would (call
    `optimizer.zero_grad()` yourself).

    Args:
        model: a Hugging Face causal LM of a supported family (see `branchreplay.state.FAMILIES`), with no active
            dropout.
        trees: one tree or a list of them (e.g. one per prompt group).
        loss: maps a node's `LossInputs` to a scalar; e.g. `GRPOLoss()`.
        temperature: logprobs are of softmax(logits / temperature), as the sampler's.
        engine: packing, chunking and replay options (`EngineConfig`).
    Raises:
        UnsupportedModelError: the model's family or attention implementation is not supported.
        ValueError: token ids outside the vocabulary, a rollout longer than the model's maximum positions, active
            dropout, or inconsistent old/ref logprobs.
    """
    return _replay(model, trees, loss, temperature, engine)


@torch.no_grad()
def replay_logprobs(
    model,
    trees: RolloutTree | list[RolloutTree],
    *,
    temperature: float = 1.0,
    engine: EngineConfig = EngineConfig(),
) -> ReplayResult:
    """Forward only, no autograd graph: per-rollout logprobs (old-policy or reference), equal to running each
    rollout alone. Same arguments and errors as `replay_backward`."""
    return _replay(model, trees, None, temperature, engine)


def _replay(model, trees, loss, temperature, engine: EngineConfig) -> ReplayResult:
    trees = [trees] if isinstance(trees, RolloutTree) else list(trees)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    run = _Run(model, temperature, engine, loss)
    logprobs, entropy, total, stats = [], [], 0.0, None
    for tree in trees:
        run.check(tree)
        run.tree = tree
        run.logprobs = [torch.zeros(len(r), dtype=torch.float32) for r in tree.rollouts]
        run.entropy = [torch.zeros(len(r), dtype=torch.float32) for r in tree.rollouts]
        run.loss_value = 0.0
        run.children(_chunked(tree.root, engine.chunk_tokens), ancestors=[], parent_h=None)
        logprobs += run.logprobs
        entropy += run.entropy
        total += run.loss_value
        stats = tree.stats if stats is None else stats + tree.stats
    return ReplayResult(logprobs, entropy, total, stats)


class _Run:
    """State of one replay over a tree: the model's pieces, the options, and the per-rollout outputs."""

    def __init__(self, model, temperature: float, engine: EngineConfig, loss):
        self.family = family_of(model)
        self.config = model.config
        self.decoder, self.head = decoder_and_head(model)
        self.windows = layer_windows(model.config)
        self.num_layers = model.config.num_hidden_layers
        self.additive_mask = model.config._attn_implementation == "eager"
        self.dtype = self.head.weight.dtype
        self.device = self.head.weight.device
        self.vocab_size = self.head.weight.shape[0]
        self.temperature = temperature
        self.max_pack_tokens = engine.max_pack_tokens
        self.head_chunk_tokens = engine.head_chunk_tokens
        self.replay = engine.replay == "replay"
        self.loss = loss
        _check_no_dropout(model)

    def check(self, tree: RolloutTree) -> None:
        max_pos = getattr(self.config, "max_position_embeddings", None)
        for i, r in enumerate(tree.rollouts):
            ids = r.token_ids
            if ids.min() < 0 or ids.max() >= self.vocab_size:
                bad = ids[(ids < 0) | (ids >= self.vocab_size)][0].item()
                raise ValueError(f"rollout {i} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")
            if max_pos is not None and len(r) > max_pos:
                raise ValueError(
                    f"rollout {i} has {len(r)} tokens, more than the model's max_position_embeddings ({max_pos})"
                )
        for name in ("old_logprobs", "ref_logprobs"):
            given = {getattr(r, name) is not None for r in tree.rollouts}
            if len(given) > 1:
                raise ValueError(f"some rollouts carry {name} and others do not: give it for all or none")

    # -- traversal ------------------------------------------------------------------------------------------------

    def children(self, parent: Node, ancestors: list[NodeState], parent_h: torch.Tensor | None) -> None:
        """Run the subtrees under `parent`, pack by pack; on return, the ancestors' leaves hold their gradients."""
        for pack in _packs(parent.children, self.max_pack_tokens):
            self.pack(pack, parent.end, ancestors, parent_h)

    def pack(self, nodes: list[Node], P: int, ancestors: list[NodeState], parent_h) -> None:
        """Forward of sibling `nodes` (starting at position P), their subtrees, then their one backward.

        Kept: the pack's autograd graph lives while its subtrees run. Replayed: the first forward runs without a
        graph (only the state and last hidden states handed to the children are kept) and is recomputed, with a
        graph, just before the backward: the same values, since it is the same computation on the same inputs."""
        train = self.loss is not None
        replay = train and self.replay
        with torch.no_grad() if replay else contextlib.nullcontext():
            hidden, cache = self.forward(nodes, P, ancestors)  # hidden [S, H]
        pack_loss = None if replay else self.pack_loss(nodes, hidden, parent_h)
        spans = _spans(nodes)
        leaves = []  # (span, state leaves, last hidden leaf) of the nodes with children
        for node, a, b in spans:
            if not node.children:
                continue
            state = cache.node_state(a, b)
            if not train:
                self.children(node, ancestors + [state], hidden[b - 1])
                continue
            state_leaves, h_leaf = [tuple(_leaf(t) for t in layer) for layer in state], _leaf(hidden[b - 1])
            self.children(node, ancestors + [state_leaves], h_leaf)
            leaves.append(((a, b), state_leaves, h_leaf))
        if not train:
            return
        if replay:
            hidden, cache = self.forward(nodes, P, ancestors)
            pack_loss = self.pack_loss(nodes, hidden, parent_h)
        outputs, grads = [], []
        for (a, b), state_leaves, h_leaf in leaves:
            pairs = [(out, leaf) for layer, leaf_layer in zip(cache.node_state(a, b), state_leaves)
                     for out, leaf in zip(layer, leaf_layer)]
            pairs.append((hidden[b - 1], h_leaf))
            for out, leaf in pairs:
                if leaf.grad is not None:
                    outputs.append(out)
                    grads.append(leaf.grad)
        if pack_loss is not None:
            self.loss_value += pack_loss.item()
            outputs.append(pack_loss)
            grads.append(torch.ones_like(pack_loss))
        if outputs:
            torch.autograd.backward(outputs, grads)

    def pack_loss(self, nodes: list[Node], hidden: torch.Tensor, parent_h) -> torch.Tensor | None:
        """Sum of the nodes' losses (None when no node has a trainable position, or in forward-only mode)."""
        losses = [self.node_loss(node, hidden[a:b], parent_h) for node, a, b in _spans(nodes)]
        losses = [x for x in losses if x is not None]
        return torch.stack(losses).sum() if losses else None

    # -- one pack's forward -----------------------------------------------------------------------------------------

    def forward(self, nodes: list[Node], P: int, ancestors: list[NodeState]) -> tuple[torch.Tensor, PrefixCache]:
        """Run the pack's tokens against the ancestors' state. Returns hidden [S, H] (final-normed) and the cache,
        which gives each node's state."""
        lengths = [len(n) for n in nodes]
        tokens = torch.cat([n.tokens for n in nodes]).to(self.device)[None]  # [1, S]
        local = torch.cat([torch.arange(L, device=self.device) for L in lengths])  # position within its node
        segment = torch.repeat_interleave(torch.arange(len(nodes), device=self.device), torch.tensor(lengths))
        cache = PrefixCache(ancestors, self.num_layers)
        out = self.decoder(
            input_ids=tokens,
            position_ids=(P + local)[None],
            # One node: the ordinary causal (or sliding-window) mask with offset P, which transformers builds itself
            # (and SDPA may then skip); several: the tree mask.
            attention_mask=self.masks(P, local, segment) if len(nodes) > 1 else None,
            cache=cache,
            use_cache=True,
        )
        return out.last_hidden_state[0], cache

    def masks(self, P: int, local: torch.Tensor, segment: torch.Tensor):
        """Tree mask [1, 1, S, P + S]: query (segment s, position P + t) sees every prefix key and the keys of its own
        segment at positions <= P + t, and, in a sliding-window layer, only keys k with q - k < window."""
        q_pos = P + local
        k_pos = torch.cat([torch.arange(P, device=self.device), q_pos])
        k_seg = torch.cat([torch.full((P,), -1, device=self.device), segment])
        visible = (k_seg[None] == -1) | ((k_seg[None] == segment[:, None]) & (k_pos[None] <= q_pos[:, None]))

        def build(window):
            allowed = visible if window is None else visible & (q_pos[:, None] - k_pos[None] < window)
            if self.additive_mask:  # eager attention adds the mask: a boolean one would be silently wrong
                zero = torch.zeros((), dtype=self.dtype, device=self.device)
                allowed = torch.where(allowed, zero, torch.finfo(self.dtype).min)
            return allowed[None, None]

        kinds = {w: build(w) for w in set(self.windows)}
        if self.family.mask_mapping:
            full = kinds.get(None)
            sliding = next((m for w, m in kinds.items() if w is not None), None)
            return {k: m for k, m in (("full_attention", full), ("sliding_attention", sliding)) if m is not None}
        if len(kinds) > 1:
            raise ValueError(f"{self.family.name}: layers mix windows {sorted(kinds, key=str)} but take one mask")
        return next(iter(kinds.values()))

    # -- one node's loss -----------------------------------------------------------------------------------------

    def node_loss(self, node: Node, hidden: torch.Tensor, parent_h: torch.Tensor | None) -> torch.Tensor | None:
        """Logprobs of the node's trainable positions, recorded per rollout, and the loss on them (None if none).

        Position t of the node is predicted by hidden[t - 1], and position 0 by the parent's last hidden state."""
        rollouts = [self.tree.rollouts[i] for i in node.rollouts]
        s, e = node.start, node.end
        trainable = torch.stack([r.loss_mask[s:e] for r in rollouts]).amax(0) > 0  # [L]
        positions = trainable.nonzero().squeeze(1)  # [L']
        if positions.numel() == 0:
            return None
        if parent_h is None:  # a root: position 0 has no context and Rollout forbids training it
            predictors = torch.cat([hidden[:1], hidden[:-1]])
        else:
            predictors = torch.cat([parent_h[None], hidden[:-1]])
        logprobs, entropy = self.token_logprobs(predictors[positions.to(self.device)], node.tokens[positions])
        for i in node.rollouts:
            self.logprobs[i][s + positions] = logprobs.detach().float().cpu()
            self.entropy[i][s + positions] = entropy.detach().float().cpu()
        if self.loss is None:
            return None
        return self.loss(loss_inputs(rollouts, s + positions, logprobs, entropy))

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, H] hidden, [N] targets -> logprobs [N], entropy [N], chunk by chunk; under autograd each chunk is
        checkpointed, so its [chunk, V] logits exist only while that chunk is computed (forward or backward)."""
        targets = targets.to(self.device)
        outs = []
        for start in range(0, hidden.shape[0], self.head_chunk_tokens):
            h = hidden[start : start + self.head_chunk_tokens]
            t = targets[start : start + self.head_chunk_tokens]
            if torch.is_grad_enabled():
                outs.append(checkpoint(_head_logprobs, self.head, h, t, self.temperature, use_reentrant=False))
            else:
                outs.append(_head_logprobs(self.head, h, t, self.temperature))
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def loss_inputs(rollouts, positions: torch.Tensor, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossInputs:
    """Gather the per-rollout data of `rollouts` at absolute `positions` [L'] into a `LossInputs` (dtype and device
    of `logprobs`)."""

    def per_rollout(name):
        if getattr(rollouts[0], name) is None:
            return None
        return torch.stack([getattr(r, name)[positions] for r in rollouts]).to(logprobs)

    return LossInputs(
        logprobs=logprobs,
        entropy=entropy,
        weights=per_rollout("weights"),
        advantages=per_rollout("advantages"),
        old_logprobs=per_rollout("old_logprobs"),
        ref_logprobs=per_rollout("ref_logprobs"),
    )


def _head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    """log softmax(head(hidden) / temperature) at `targets`, and the entropy of that distribution.
    [N, H], [N] -> [N], [N]."""
    logits = head(hidden)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp_all = torch.log_softmax(logits / temperature, dim=-1)  # [N, V]
    logprobs = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


def _packs(nodes: list[Node], max_tokens: int) -> list[list[Node]]:
    """Greedy packs of consecutive siblings with at most `max_tokens` tokens (a longer node gets a pack alone)."""
    packs, current, size = [], [], 0
    for node in nodes:
        if current and size + len(node) > max_tokens:
            packs.append(current)
            current, size = [], 0
        current.append(node)
        size += len(node)
    if current:
        packs.append(current)
    return packs


def _chunked(root: Node, chunk_tokens: int) -> Node:
    """A copy of the tree under `root` in which every node longer than `chunk_tokens` is a chain of chunks."""
    new_root = Node(root.tokens, root.start, root.rollouts)
    todo = [(child, new_root) for child in reversed(root.children)]
    while todo:
        node, parent = todo.pop()
        for a in range(0, len(node), chunk_tokens):
            piece = Node(node.tokens[a : a + chunk_tokens], node.start + a, node.rollouts)
            parent.children.append(piece)
            parent = piece
        todo.extend((child, parent) for child in reversed(node.children))
    return new_root


def _spans(nodes: list[Node]) -> list[tuple[Node, int, int]]:
    """(node, start, end) of each node's positions within its pack's query sequence."""
    out, offset = [], 0
    for node in nodes:
        out.append((node, offset, offset + len(node)))
        offset += len(node)
    return out


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(True)


def _check_no_dropout(model) -> None:
    """Active dropout draws a different mask in the tree and in each rollout: the gradients would not be equal."""
    if not model.training:
        return
    active = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training]
    p_attn = getattr(model.config, "attention_dropout", 0.0) or 0.0
    if active or p_attn > 0:
        where = ", ".join(active[:3]) or f"attention_dropout={p_attn}"
        raise ValueError(
            f"the model has active dropout ({where}); call model.eval() or set the dropout probabilities to 0: "
            "dropout breaks the equivalence with the per-rollout computation"
        )
