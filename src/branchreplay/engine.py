"""The execution stack: exact forward and backward over a tree of rollouts, each unique position computed once.

Depth first over the tree. The children of a node run as packs: their tokens are concatenated into one query
sequence (up to `max_pack_tokens`) against ONE copy of the ancestors' K/V, with a tree mask (each child sees the
whole prefix and its own earlier positions) and absolute position ids. On CPU, where every layer is full attention,
the prefix keys are attended without a mask and the tree mask covers only the pack's own keys (`attention.py`,
merged by log-sum-exp). After a pack's forward, the K/V and the last
hidden state of each of its nodes are detached into leaf tensors; the node's children run against those leaves;
once every descendant has run its backward, the leaves hold dL/dK, dL/dV and dL/dh summed over all descendants,
and the pack's backward runs once with them (a family with recurrent layers, `state/recurrent.py`, runs every
node as a pack of one, and hands its children the conv / SSM state after the node instead of per-position K/V):

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

from .attention import PrefixSplit, own_keys_mask
from .losses import LossInputs
from .planner import MemoryModel, default_budget, plan, saved_bytes
from .positions import held_at_length, length_dependent_rotaries, max_positions, regimes
from .state import (
    EngineForwards,
    NodeState,
    PrefixCache,
    check_head,
    decoder_and_head,
    family_of,
    kept_positions,
    layer_kinds,
    layer_windows,
)
from .tree import Node, RolloutTree, TreeStats

LossFn = Callable[[LossInputs], torch.Tensor]


@dataclass
class ReplayResult:
    """Output of `replay_backward` / `replay_logprobs`, one entry per rollout of each tree, in order.

    logprobs: per rollout, [T] float32 detached logprobs at trainable positions (loss_mask 1), 0 elsewhere.
    entropy: per rollout, [T] float32 detached next-token entropy (nats) at the same positions, 0 elsewhere.
    loss: the loss summed over the trees (a Python float; 0.0 for `replay_logprobs`).
    stats: tree sizes summed over the trees.
    predicted_peak_bytes: the planner's prediction of the step's peak memory (largest over the trees; None for
        `replay_logprobs`).
    replayed_packs: number of packs replayed (recomputed before their backward).
    """

    logprobs: list[torch.Tensor]
    entropy: list[torch.Tensor]
    loss: float
    stats: TreeStats
    predicted_peak_bytes: float | None = None
    replayed_packs: int = 0


@dataclass(frozen=True)
class EngineConfig:
    """How the execution stack runs a tree. None of these change the result, only time and memory.

    max_pack_tokens: most tokens of sibling nodes run as one pack (one query sequence against one copy of their
        prefix K/V); a longer node runs alone. Short siblings share a pack (fewer, larger calls); long ones run
        alone, since the masked block of a pack costs pack^2 attention scores where its nodes need only the sum of
        their own lengths^2 / 2, and a pack of one node runs that block causally (skipped above the diagonal).
        256 was fastest on CPU for shared prompts of 1k-16k tokens with 256-token responses (docs/benchmarks.md).
        Tree mask: pack x pack elements where `attention.PrefixSplit` applies (CPU, float32/64, sdpa, only
        full-attention layers), else pack x (prefix + pack).
    chunk_tokens: a node longer than this runs as a chain of chunks of at most this many tokens, each against the
        K/V of the ones before it.
    head_chunk_tokens: rows of the LM head computed at once (memory: head_chunk_tokens x vocab floats).
    replay: "keep" holds every pack's activations until its backward; "replay" holds only the K/V and last hidden
        state it hands to its children and recomputes its forward just before its backward (one more forward per
        internal pack); "auto" lets the planner (`branchreplay.planner`) keep what fits `memory_budget` and replay
        the internal packs with the largest activations.
    memory_budget: bytes for "auto" (default: 90% of the device's free memory when the step starts).
    """

    max_pack_tokens: int = 256
    chunk_tokens: int = 4096
    head_chunk_tokens: int = 512
    replay: str = "auto"
    memory_budget: int | None = None

    def __post_init__(self):
        for name in ("max_pack_tokens", "chunk_tokens", "head_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.replay not in ("keep", "replay", "auto"):
            raise ValueError(f"EngineConfig.replay must be 'keep', 'replay' or 'auto', got {self.replay!r}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"EngineConfig.memory_budget must be > 0 bytes, got {self.memory_budget}")


def replay_backward(
    model,
    trees: RolloutTree | list[RolloutTree],
    loss: LossFn,
    *,
    temperature: float = 1.0,
    engine: EngineConfig = EngineConfig(),
    force: bool = False,
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
        force: run a family that is not in the registry, as `state.generic_family` guesses it (for `branchreplay
            verify --force`, which compares the result with the naive reference; never for training).
    A tree whose rollouts fall in different regimes of a length-dependent rotary encoding (longrope, dynamic NTK:
    `branchreplay.positions`) runs as one sub-forest per regime; `stats` counts the positions actually computed.

    Raises:
        UnsupportedModelError: the model's family (unless `force`) or attention implementation is not supported.
        HeadMismatchError: the model's ForCausalLM transforms its logits in a way the engine's head does not know.
        ValueError: token ids outside the vocabulary, a rollout longer than the model's maximum positions, active
            dropout, or inconsistent old/ref logprobs.
    """
    return _replay(model, trees, loss, temperature, engine, force)


@torch.no_grad()
def replay_logprobs(
    model,
    trees: RolloutTree | list[RolloutTree],
    *,
    temperature: float = 1.0,
    engine: EngineConfig = EngineConfig(),
    force: bool = False,
) -> ReplayResult:
    """Forward only, no autograd graph: per-rollout logprobs (old-policy or reference), equal to running each
    rollout alone. Same arguments and errors as `replay_backward`."""
    return _replay(model, trees, None, temperature, engine, force)


def _replay(model, trees, loss, temperature, engine: EngineConfig, force: bool = False) -> ReplayResult:
    trees = [trees] if isinstance(trees, RolloutTree) else list(trees)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    run = _Run(model, temperature, engine, loss, force)
    logprobs, entropy, total, stats, peak, replayed = [], [], 0.0, None, None, 0
    for tree in trees:
        run.check(tree)
        lp = [torch.zeros(len(r), dtype=torch.float32) for r in tree.rollouts]
        ent = [torch.zeros(len(r), dtype=torch.float32) for r in tree.rollouts]
        # rollouts whose full forwards pick other rotary frequencies run as separate sub-forests (positions.py)
        for length, members in regimes(run.rotaries, [len(r) for r in tree.rollouts]):
            sub = tree if len(members) == len(tree.rollouts) else RolloutTree([tree.rollouts[i] for i in members])
            with held_at_length(model, length, run.rotaries):
                sub_peak, sub_replayed = run.run_tree(sub)
            for i, sub_lp, sub_ent in zip(members, run.logprobs, run.entropy):
                lp[i], ent[i] = sub_lp, sub_ent
            total += run.loss_value
            stats = sub.stats if stats is None else stats + sub.stats
            if sub_peak is not None:
                peak = max(peak or 0.0, sub_peak)
            replayed += sub_replayed
        logprobs += lp
        entropy += ent
    return ReplayResult(logprobs, entropy, total, stats, peak, replayed)


class _Run:
    """State of one replay over a tree: the model's pieces, the options, and the per-rollout outputs."""

    def __init__(self, model, temperature: float, engine: EngineConfig, loss, force: bool = False):
        self.family = family_of(model, force=force)
        self.config = model.config
        self.decoder, self.head, self.transform = decoder_and_head(model)  # transform: state/head.py
        self.windows = layer_windows(model.config)
        self.num_layers = model.config.num_hidden_layers
        self.kinds = layer_kinds(model.config)  # attention / recurrent / hybrid, per layer
        self.engine_forwards = EngineForwards(model)  # exact mixer forwards for cached SSM states (recurrent.py)
        self.prefix_split = PrefixSplit(model, self.windows, self.kinds)
        self.dtype = self.head.weight.dtype
        self.device = self.head.weight.device
        self.vocab_size = self.head.weight.shape[0]
        self.temperature = temperature
        self.rotaries = length_dependent_rotaries(model)  # longrope / dynamic: held at each rollout's length
        self.max_pack_tokens = engine.max_pack_tokens
        self.chunk_tokens = engine.chunk_tokens
        self.head_chunk_tokens = engine.head_chunk_tokens
        self.replay, self.memory_budget = engine.replay, engine.memory_budget
        self.replay_set: set[int] = set()
        self.model = model
        self.loss = loss
        _check_no_dropout(model)
        check_head(model)
        checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x; older name:
        if checkpointing is None:
            checkpointing = getattr(model, "is_gradient_checkpointing", False)
        if model.training and checkpointing:
            raise ValueError("the model has activation (gradient) checkpointing on; call "
                             "model.activation_checkpointing_disable() or model.eval(): transformers' checkpointed "
                             "layers drop the prefix cache, and the engine recomputes packs itself "
                             "(EngineConfig.replay)")

    def run_tree(self, tree: RolloutTree) -> tuple[float | None, int]:
        """One tree through the execution stack; per-rollout outputs land in self.logprobs / entropy / loss_value.
        Returns (the planner's predicted peak bytes or None without a loss, number of replayed packs)."""
        root = _chunked(tree.root, self.chunk_tokens)
        peak, replayed = None, 0
        if self.loss is not None:
            budget = None if self.replay != "auto" else self.memory_budget or default_budget(self.device)
            memory = self.memory_model(tree.stats.physical_tokens)
            step_plan = plan(root, memory, self.packs_of, budget, replay_all=self.replay == "replay",
                             head_chunk_tokens=self.head_chunk_tokens)
            self.replay_set = step_plan.replay
            peak, replayed = step_plan.predicted_peak_bytes, len(step_plan.replay)
        self.tree = tree
        self.logprobs = [torch.zeros(len(r), dtype=torch.float32) for r in tree.rollouts]
        self.entropy = [torch.zeros(len(r), dtype=torch.float32) for r in tree.rollouts]
        self.loss_value = 0.0
        self.children(root, ancestors=[], parent_h=None)
        return peak, replayed

    def check(self, tree: RolloutTree) -> None:
        max_pos = max_positions(self.config)
        for i, r in enumerate(tree.rollouts):
            ids = r.token_ids
            if ids.min() < 0 or ids.max() >= self.vocab_size:
                bad = ids[(ids < 0) | (ids >= self.vocab_size)][0].item()
                raise ValueError(f"rollout {i} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")
            if max_pos is not None and len(r) > max_pos:
                raise ValueError(
                    f"rollout {i} has {len(r)} tokens, more than the model's max_position_embeddings ({max_pos}); "
                    "shorten the prompt or the completion (SamplingConfig.max_new_tokens)"
                )
        for name in ("old_logprobs", "ref_logprobs"):
            given = {getattr(r, name) is not None for r in tree.rollouts}
            if len(given) > 1:
                raise ValueError(f"some rollouts carry {name} and others do not: give it for all or none")

    # -- traversal ------------------------------------------------------------------------------------------------

    def children(self, parent: Node, ancestors: list[NodeState], parent_h: torch.Tensor | None) -> None:
        """Run the subtrees under `parent`, pack by pack; on return, the ancestors' leaves hold their gradients."""
        for pack in self.packs_of(parent):
            self.pack(pack, parent.end, ancestors, parent_h)

    def packs_of(self, parent: Node) -> list[list[Node]]:
        """The packs in which `parent`'s children run (one node each in a recurrent family)."""
        return _packs(parent.children, 1 if self.family.recurrent else self.max_pack_tokens)

    def memory_model(self, tokens: int) -> MemoryModel:
        """The model's `MemoryModel` for a tree of `tokens` physical positions, fitted once per model, dtype and
        scale from three probe forwards: s-2s tokens against 2s-6s, with s = 256 for trees of 4096 positions or
        more (the sizes whose kernels real steps use: SDPA picks its path by size), else s = 16 (cheap, and a
        small tree's memory is small whatever the fit). The probes never pass the model's position limit (GPT-2's
        learned table): s is at most max_position_embeddings // 7, and a model with fewer than 7 positions, whose
        trees are a few tokens, gets the fixed bytes only."""
        scale = 256 if tokens >= 4096 else 16
        limit = max_positions(self.config)
        if limit is not None:
            scale = min(scale, limit // 7)  # the largest probe runs s tokens against 6s: 7s positions
        cache = self.model.__dict__.setdefault("_branchreplay_memory_models", {})
        if (self.dtype, scale) not in cache:
            cache[self.dtype, scale] = self._probe_memory(scale) if scale > 0 else self._unprobed_memory()
        return cache[self.dtype, scale]

    def _unprobed_memory(self) -> MemoryModel:
        """Fixed bytes only (parameter gradients, the LM head's rows): for models too short to probe."""
        elem = torch.finfo(self.dtype).bits // 8
        grads = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        return MemoryModel(0.0, 0.0, 0.0, 3 * self.vocab_size * max(elem, 4), grads, elem,
                           split=self.prefix_split.applies)

    def _probe_memory(self, s: int) -> MemoryModel:
        g = torch.Generator().manual_seed(0)
        params = list(self.model.parameters())

        def probe(S, P):
            prefix = Node(torch.randint(0, self.vocab_size, (P,), generator=g), 0, [])
            with torch.no_grad():
                _, cache = self.forward([prefix], 0, [])
            state = [tuple(_leaf(t) for t in layer) for layer in cache.node_state(0, P)]
            node = Node(torch.randint(0, self.vocab_size, (S,), generator=g), P, [])
            leaves = [t for layer in state for t in layer]  # counted as state, not as activations
            return saved_bytes(params + leaves, lambda: self.forward([node], P, [state])), state

        b1, state = probe(s, 2 * s)
        b2, _ = probe(2 * s, 2 * s)
        b3, _ = probe(s, 6 * s)
        per_key = max(b3 - b1, 0) / (4 * s)
        per_token = max((b2 - b1) / s - per_key, 0.0)
        state_per_token = sum(t.numel() * t.element_size() for layer in state for t in layer) / (2 * s)
        elem = torch.finfo(self.dtype).bits // 8
        grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad and p.grad is None)
        head_per_row = 3 * self.vocab_size * max(elem, 4)  # logits, log-softmax, its gradient
        return MemoryModel(per_token, per_key, state_per_token, head_per_row, grads, elem,
                           split=self.prefix_split.applies)

    def pack(self, nodes: list[Node], P: int, ancestors: list[NodeState], parent_h) -> None:
        """Forward of sibling `nodes` (starting at position P), their subtrees, then their one backward.

        Kept: the pack's autograd graph lives while its subtrees run. Replayed: the first forward runs without a
        graph (only the state and last hidden states handed to the children are kept) and is recomputed, with a
        graph, just before the backward: the same values, since it is the same computation on the same inputs."""
        train = self.loss is not None
        replay = train and id(nodes[0]) in self.replay_set
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
        split = self.prefix_split.applies and P > 0  # prefix keys unmasked, the tree mask only over the pack's own
        cache = PrefixCache(ancestors, self.num_layers, self.kinds, windows=self.windows, prefix_length=P, split=split)
        if split:
            own = self.own_keys_tree_mask(local, segment) if len(nodes) > 1 else None
            mask = own_keys_mask(own, tokens.shape[1], self.dtype, self.device)
        else:
            mask = self.masks(P, local, segment) if self.own_mask(nodes, P) else None
        with self.engine_forwards:
            out = self.decoder(input_ids=tokens, position_ids=(P + local)[None], attention_mask=mask, cache=cache,
                               use_cache=True)
        return out.last_hidden_state[0], cache

    def own_keys_tree_mask(self, local: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
        """Tree mask [1, 1, S, S] over a pack's own keys (for `PrefixSplit`): a query sees the earlier or equal
        positions of its own segment. Additive, in the model's dtype."""
        return self.additive((segment[None] == segment[:, None]) & (local[None] <= local[:, None]))

    def additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """Boolean [S, K] -> additive mask [1, 1, S, K] in the model's dtype (0 where allowed, the dtype's minimum
        elsewhere): eager attention adds the mask, so a boolean one would be silently wrong."""
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)[None, None]

    def own_mask(self, nodes: list[Node], P: int) -> bool:
        """Whether the pack takes our tree mask. A root alone takes transformers' causal mask, which SDPA can skip;
        so do the single-node packs of recurrent families (whose SSM layers read a 2D mask). Otherwise ours: one
        additive tensor that every layer shares, where transformers' boolean mask is converted, and saved for
        backward, once per layer by SDPA (4x the memory on a 4-layer model)."""
        return len(nodes) > 1 or (P > 0 and not self.family.recurrent)

    def masks(self, P: int, local: torch.Tensor, segment: torch.Tensor):
        """Tree mask [1, 1, S, K + S]: query (segment s, position P + t) sees every prefix key and the keys of its own
        segment at positions <= P + t, and, in a sliding-window layer, only keys k with q - k < window. The K prefix
        keys are those the layer's cache serves (`kept_positions`): all P in a full layer, the last window - 1 in a
        sliding one, at their absolute positions."""
        q_pos = P + local

        def build(window):
            kept = kept_positions(P, window)
            k_pos = torch.cat([torch.arange(P - kept, P, device=self.device), q_pos])
            k_seg = torch.cat([torch.full((kept,), -1, device=self.device), segment])
            allowed = (k_seg[None] == -1) | ((k_seg[None] == segment[:, None]) & (k_pos[None] <= q_pos[:, None]))
            if window is not None:
                allowed = allowed & (q_pos[:, None] - k_pos[None] < window)
            return self.additive(allowed)

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
                outs.append(checkpoint(_head_logprobs, self.head, h, t, self.temperature, self.transform,
                                       use_reentrant=False))
            else:
                outs.append(_head_logprobs(self.head, h, t, self.temperature, self.transform))
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


def _head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, transform):
    """log softmax(transform(head(hidden)) / temperature) at `targets`, and the entropy of that distribution.
    [N, H], [N] -> [N], [N]. `transform` (`state.head.LogitTransform`: logit scales, final softcapping) runs in the
    model's dtype, as transformers' ForCausalLM computes it; half-precision logits are upcast to float32.

    The logprob is the target's logit minus the row's logsumexp, as TRL's `selective_log_softmax`
    (trl/trainer/utils.py) computes it for float32: on SmolLM2 in float32 (45-token chat prompt, 4 sampled
    completions) its gradient is 4.8e-5 from float64 where `log_softmax(...).gather(...)` is 5.1e-4 (the naive
    per-rollout HF computation: 5.3e-4); docs/support.md. The entropy keeps the full log-softmax."""
    logits = transform(head(hidden))
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logits = logits / temperature
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    logp_all = torch.log_softmax(logits, dim=-1)  # [N, V]
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
    jitter = getattr(model.config, "router_jitter_noise", 0.0) or 0.0  # Mixtral: random router input scaling
    if active or p_attn > 0 or jitter > 0:
        where = ", ".join(active[:3]) or (
            f"attention_dropout={p_attn}" if p_attn > 0 else f"router_jitter_noise={jitter}"
        )
        raise ValueError(
            f"the model has active dropout ({where}); call model.eval() or set the dropout probabilities to 0: "
            "dropout breaks the equivalence with the per-rollout computation"
        )
