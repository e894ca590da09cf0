"""The execution stack: exact forward and backward over a tree of rollouts, each unique position computed once.

Depth first: the children of a pack's nodes run as packs (one query sequence of up to `max_pack_tokens` with a tree
mask and absolute position ids, or the rows of one [B, L] batch) against their ancestors' K/V (split prefix
attention: children of several nodes in one pack, `packs_of`; recurrent families: packs of one node, `recurrent.py`).
After a pack's forward its nodes' K/V and last hidden state are detached into leaves; once every descendant has run
its backward they hold dL/dK, dL/dV and dL/dh (a child's first token is predicted from its parent's last hidden
state), and the pack's backward runs once, `torch.autograd.backward([pack_loss, K_n, V_n, h_n, ...], [1, dK_n, dV_n,
dh_n, ...])`: into `param.grad`, what `loss.backward()` on the per-rollout sum gives (the same terms in another
order). The LM head runs only on the trained rows, in checkpointed chunks (`head.py`).
Design notes and measurements: docs/notes/execution-stack.md.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from ..losses import loss_inputs
from ..tree import Node, ReplayResult, RolloutTree
from ..value import is_value_model
from .attention import PrefixSplit, own_keys_mask
from .cache import NodeState, PrefixCache
from .embedding import DeferredEmbeddingGrad
from .families import check_no_dropout, family_of, layer_windows
from .head import check_float32_head, check_head, decoder_and_head, head_statistics, token_logprobs, token_values
from .masks import own_keys_tree_mask, takes_tree_mask, tree_mask
from .model_view import ModelView
from .options import ReplayOptions
from .packs import batched_packs, chunked, is_batch, packs, spans
from .parallel.context_parallel import ContextParallelTree, run_prefix
from .parallel.lockstep import BACKWARD, FORWARD
from .planner import default_budget, memory_model, plan
from .positions import length_dependent_rotaries
from .recurrent import EngineForwards, layer_kinds
from .router import routed, taken
from .schedule import attention_per_key, schedule
from .temperature import QueryTemperature
from .vision import ImageRun


def model_view(model, trusted: bool = False, router_loss: bool = False) -> ModelView:
    """The engine's `ModelView` of `model`, resolved once per engine call. `trusted`, `router_loss`: as
    `families.family_of`'s, whose errors it raises."""
    family = family_of(model, trusted=trusted, router_loss=router_loss)
    decoder, head, transform = decoder_and_head(model)  # transform: head.py
    critic = is_value_model(model)  # a value model: values at the trained positions (value.py)
    return ModelView(model, family, decoder, head, transform, windows=layer_windows(model.config),
                     kinds=layer_kinds(model.config),  # attention / recurrent / hybrid, per layer
                     critic=critic, vocab_size=model.config.vocab_size if critic else head.weight.shape[0],
                     dtype=head.weight.dtype, device=head.weight.device,
                     rotaries=length_dependent_rotaries(model))  # longrope / dynamic: held at each rollout's length


def _check_model(model) -> None:
    """The checks of `model` every engine call makes beyond its family's: no active dropout
    (`families.check_no_dropout`), the LM head's logits equal to the model's own (`head.check_head`), and no
    activation checkpointing in training. Raises ValueError, or HeadMismatchError (check_head)."""
    check_no_dropout(model)
    check_head(model)
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x; older name:
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if model.training and checkpointing:
        raise ValueError("the model has activation (gradient) checkpointing on; call "
                         "model.activation_checkpointing_disable() or model.eval(): transformers' checkpointed "
                         "layers drop the prefix cache, and the engine recomputes packs itself "
                         "(EngineConfig.replay)")


class _PackForward(NamedTuple):
    """One forward of a pack: hidden [S, H] (final-normed), the `PrefixCache` that gives each node's state, the
    pack's loss (None without one), the router loss's terms of its decoder call, and the embedding outputs that
    `DeferredEmbeddingGrad.capture` made (None when not deferred)."""

    hidden: torch.Tensor
    cache: PrefixCache
    loss: torch.Tensor | None
    router_terms: list[torch.Tensor]
    embedded: list | None


class _Run:
    """State of one engine call over its trees: the model's view, the engine's options, and the tree's results."""

    def __init__(self, model, loss, options: ReplayOptions):
        router, engine = options.router, options.engine
        self.view = view = model_view(model, options.trusted, router_loss=router is not None or loss is None)
        self.engine, self.temperature, self.loss = engine, options.temperature, loss
        self.router = router  # the MoE router loss: each token's rollout count at each decoder call (router.py)
        self.head_stats = options.head_stats  # `replay_logprobs(head_stats=...)`
        self.engine_forwards = EngineForwards(model)  # exact mixer forwards for cached SSM states (recurrent.py)
        self.query_scale = QueryTemperature(model)  # Llama 4's query scale at the pack's positions (temperature.py)
        self.prefix_split = PrefixSplit(model, view.windows, view.kinds)
        # calibrated on split prefix attention (schedule.py); not calibrated for the masked path, so not charged there
        self.prefix_position_overhead = engine.prefix_position_overhead if self.prefix_split.applies else 0.0
        self.attention_per_key = attention_per_key(model.config, _matmul_params(view.decoder))
        if engine.head_float32:
            check_float32_head(view.head)
        self.replay_set: set[int] = set()
        self.final_backward = None  # a context around the last backward of the last tree (`replay_backward`)
        self.lockstep = False  # every forward and backward in step with the other ranks (`lockstep.py`)
        self.images: ImageRun | None = None  # the tree's image features while it runs (vision.py)
        self.across_parents = False  # packs may hold children of different parents (`packs_of`), per tree
        embedding = view.decoder.get_input_embeddings()
        self.deferred = DeferredEmbeddingGrad(embedding) if loss is not None and embedding.weight.requires_grad \
            else None
        _check_model(model)

    def run_tree(self, tree: RolloutTree | ContextParallelTree):
        """One tree through the execution stack: per-rollout logprobs and entropy, the loss, the planner's predicted
        peak bytes (None without a loss) and the number of replayed packs. A `ContextParallelTree` runs its prefix
        across the ranks first (`context_parallel.run_prefix`), then its branches against the prefix's state. A
        generator of the tree's collective events (`lockstep.py`) that returns the result."""
        view, engine = self.view, self.engine
        part = tree if isinstance(tree, ContextParallelTree) else None
        self.across_parents = self.prefix_split.applies and getattr(tree, "images", None) is None
        scheduled = schedule(part.below() if part else tree.root, engine.pack_overhead_tokens, self.attention_per_key,
                             self.prefix_position_overhead)
        root = chunked(scheduled.root, engine.chunk_tokens)
        peak, replayed = None, 0
        if self.loss is not None:
            budget = None if engine.replay != "auto" else engine.memory_budget or default_budget(view.device)
            memory = yield from memory_model(view, self.forward, tree.stats.physical_tokens, self.prefix_split.applies)
            taken(self.router)  # the memory probes' forwards: zero-weight terms, not the tree's
            step_plan = plan(root, memory, self.packs_of, budget, replay_all=engine.replay == "replay",
                             head_chunk_tokens=engine.head_chunk_tokens)
            self.replay_set = step_plan.replay
            peak, replayed = step_plan.predicted_peak_bytes, len(step_plan.replay)
        self.tree = tree
        images = getattr(tree, "images", None)
        self.images = None if images is None else ImageRun(images, self.loss is not None, view.dtype, view.device)
        if self.images is not None:
            self.images.check_chunks([n.start for n in _chain(root)])
        self.results = _Results(tree, view.dtype, view.critic, self.head_stats)
        if part is None:
            yield from self.children(root, ancestors=[], parent_h=None)
        else:
            yield from run_prefix(self, part, lambda ancestors, h: self.children(root, ancestors, h),
                                  self.final_backward)
        if self.images is not None:  # the features' gradient, summed over the packs, through the vision tower
            self.images.backward()
            self.images = None
        return self.results.replay_result(peak, replayed, scheduled.kept, scheduled.merged)

    # -- traversal ------------------------------------------------------------------------------------------------

    def children(self, parent: Node, ancestors: list[NodeState], parent_h: torch.Tensor | None):
        """Run the subtrees under `parent` (the root, or a context-parallel prefix's last round), against
        `ancestors` and the parent's last hidden state; on return, the ancestors' leaves hold their gradients. A
        generator of the packs' collective events (`lockstep.py`), as `pack`."""
        yield from self.subtrees([parent], [ancestors], [parent_h], top=not ancestors)

    def subtrees(self, parents: list[Node], ancestors: list[list[NodeState]], parent_hs: list, top: bool = False):
        """Run the subtrees under `parents` (the nodes with children of one pack), pack by pack (`packs_of`), each
        child against its own parent's ancestors (`ancestors`, per parent) and last hidden state (`parent_hs`).
        The last root pack of the run's final tree (`top`) is the last backward (post-order): it takes
        `final_backward`."""
        below = {id(child): k for k, parent in enumerate(parents) for child in parent.children}
        packs = self.packs_of(parents)
        for i, pack in enumerate(packs):
            final = self.final_backward is not None and top and i == len(packs) - 1
            owners = [below[id(node)] for node in pack]
            yield from self.pack(pack, [ancestors[k] for k in owners], [parent_hs[k] for k in owners], final)

    def packs_of(self, parents: list[Node]) -> list[list[Node]]:
        """The packs in which the children of `parents` run (one node each in a recurrent family). Where the model
        runs split prefix attention, and the tree has no images, the children of different parents share packs
        (`packs.batched_packs`: equal lengths as the rows of a batch, with or without children of their own; split
        attention serves each its own parent's prefix, `cache.Prefix`): a tree's nodes of one depth run in a few
        forwards, not one per parent. Otherwise each parent's children run apart, as batches only at the root."""
        pack_tokens, batch_tokens = self.engine.max_pack_tokens, self.engine.max_batch_tokens
        if self.view.family.recurrent:
            return [[node] for parent in parents for node in parent.children]
        if self.across_parents:
            return batched_packs([c for parent in parents for c in parent.children], pack_tokens, batch_tokens,
                                 with_children=True)
        return [pack for parent in parents
                for pack in (batched_packs(parent.children, pack_tokens, batch_tokens)
                             if parent.end == 0 or self.prefix_split.applies
                             else packs(parent.children, pack_tokens))]

    def pack(self, nodes: list[Node], ancestors: list[list[NodeState]], parent_hs: list, final: bool = False):
        """Forward of `nodes` (each against its own `ancestors` and its parent's last hidden state `parent_hs`),
        their subtrees, then their one backward (`pack_backward`).

        A generator that yields FORWARD before each decoder forward and BACKWARD before the backward when the
        backward runs through every layer (lock-step or final). Kept: the pack's autograd graph lives while its
        subtrees run. Replayed: the first forward runs without a
        graph (only the state and last hidden states handed to the children are kept) and is recomputed, with a
        graph, just before the backward: the same values, since it is the same computation on the same inputs."""
        train = self.loss is not None
        replay = train and id(nodes[0]) in self.replay_set
        defer = self.deferred is not None and not final  # the embedding's gradient later, in one pass (embedding.py)
        yield FORWARD
        fwd = self.pack_forward(nodes, ancestors, parent_hs, defer, graph=not replay)
        parents, chains, hs, leaves = _hand_down(nodes, ancestors, fwd, train)
        if parents:
            yield from self.subtrees(parents, chains, hs)
        if not train:
            return
        if replay:
            yield FORWARD
            fwd = self.pack_forward(nodes, ancestors, parent_hs, defer)
        yield from self.pack_backward(fwd, leaves, final)
        if defer:
            self.deferred.keep(fwd.embedded)

    def pack_forward(self, nodes: list[Node], ancestors: list[list[NodeState]], parent_hs: list, defer: bool,
                     graph: bool = True) -> _PackForward:
        """One forward of the pack and its loss (`pack_loss`); `defer`: its embedding outputs captured for the
        deferred embedding gradient. graph=False: a replayed pack's first forward, without a graph and without a
        loss (its replay computes both)."""
        capture = self.deferred.capture if defer else contextlib.nullcontext
        with torch.no_grad() if not graph else contextlib.nullcontext(), capture() as embedded:
            hidden, cache = self.forward(nodes, ancestors)  # hidden [S, H]
        router_terms = taken(self.router)  # none from a replayed pack's no-grad forward (pass 2)
        pack_loss = self.pack_loss(nodes, hidden, parent_hs) if graph else None
        return _PackForward(hidden, cache, pack_loss, router_terms, embedded)

    def pack_backward(self, fwd: _PackForward, leaves: list, final: bool):
        """The pack's one backward: its loss, its router terms and the gradients its subtrees left on `leaves`
        (`_hand_down`) through the graph of `fwd`; through every layer when `final` (inside `final_backward`, with the
        deferred embedding gradients) or in lock-step. A generator: BACKWARD before such a backward."""
        hidden, pack_loss, router_terms = fwd.hidden, fwd.loss, fwd.router_terms
        outputs, grads = _carried(leaves, fwd.cache, hidden)
        if pack_loss is not None:
            self.results.loss += pack_loss.item()
            outputs.append(pack_loss)
            grads.append(torch.ones_like(pack_loss))
        outputs += router_terms
        grads += [torch.ones_like(t) for t in router_terms]
        # backward outside an active autocast (its ops take the forward's dtypes; PyTorch's AMP notes advise so)
        no_autocast = torch.autocast(self.view.device.type, enabled=False)
        if final or self.lockstep:  # through every layer (and its collectives), even with nothing to carry back
            outputs.append(hidden.sum() * 0)
            grads.append(torch.ones((), dtype=hidden.dtype, device=hidden.device))
            yield BACKWARD
        if final:  # the run's last backward, inside `final_backward`
            if self.deferred is not None:  # the earlier packs' embedding gradients, in the same backward
                more_outputs, more_grads = self.deferred.outputs()
                outputs, grads = outputs + more_outputs, grads + more_grads
            with self.final_backward, no_autocast:
                torch.autograd.backward(outputs, grads)
        elif outputs:
            with no_autocast:
                torch.autograd.backward(outputs, grads)

    def pack_loss(self, nodes: list[Node], hidden: torch.Tensor, parent_hs: list) -> torch.Tensor | None:
        """Sum of the nodes' losses (None when no node has a trainable position, or in forward-only mode);
        parent_hs: each node's parent's last hidden state (None at the root)."""
        pieces = [self.trained_rows(node, hidden[a:b], h) for (node, a, b), h in zip(spans(nodes), parent_hs,
                                                                                     strict=True)]
        pieces = [p for p in pieces if p]
        leaves = not any(node.children for node in nodes)  # the pack's backward follows its forward at once
        return self.node_losses(pieces, backward_next=leaves) if pieces else None

    # -- one pack's forward -----------------------------------------------------------------------------------------

    def forward(self, nodes: list[Node], ancestors: list[list[NodeState]],
                cache=None) -> tuple[torch.Tensor, PrefixCache]:
        """Run the pack's tokens, each node against its own `ancestors` (root first; nodes below different parents
        only under split prefix attention, `packs_of`). Returns hidden [S, H] (final-normed) and the cache, which
        gives each node's state. `cache`: a pack of one node against that cache instead of a `PrefixCache` of the
        ancestors (a context-parallel round's, `context_parallel.GatheredCache`)."""
        view, P = self.view, nodes[0].start  # P > 0 for every node below the root
        split = self.prefix_split.applies and P > 0  # prefix keys unmasked, the tree mask only over the pack's own
        covered = self.images is not None and any(self.images.covers(n.start, n.end) for n in nodes)
        if cache is None:
            cache = _prefix_cache(view, nodes, ancestors, split)
        batch = is_batch(nodes, P, split, self.across_parents) and not covered  # rows of one [B, L] forward
        inputs = _batch_inputs(view, nodes, split, self.images) if batch else \
            _sequence_inputs(view, nodes, split, self.images, covered)
        with self.engine_forwards, self.query_scale.at(inputs["position_ids"]), routed(self.router, nodes, view.device):
            hidden = view.decoder(**inputs, cache=cache, use_cache=True).last_hidden_state  # [B, L, H] or [1, S, H]
        return hidden.reshape(-1, hidden.shape[-1]) if batch else hidden[0], cache  # rows in `packs.spans` order

    def dummy_forward(self) -> torch.Tensor:
        """A forward of one token (id 0, position 0) through every decoder layer, the lock-step's dummy
        (`lockstep.py`). Returns its hidden state [1, H]."""
        return self.forward([Node(torch.zeros(1, dtype=torch.long), 0, [])], [[]])[0]

    # -- the nodes' losses -----------------------------------------------------------------------------------------

    def trained_rows(self, node: Node, hidden: torch.Tensor, parent_h: torch.Tensor | None):
        """(node, positions [L'] within it, predictor rows [L', H]) of the node's trainable positions, None if none.
        Position t of the node is predicted by hidden[t - 1], and position 0 by the parent's last hidden state; a
        critic's value of position t is read from the same hidden state (value.py)."""
        s, e = node.start, node.end
        trainable = torch.stack([self.tree.rollouts[i].loss_mask[s:e] for i in node.rollouts]).amax(0) > 0  # [L]
        positions = trainable.nonzero().squeeze(1)  # [L']
        if positions.numel() == 0:
            return None
        if parent_h is None:  # a root: position 0 has no context and Rollout forbids training it
            predictors = torch.cat([hidden[:1], hidden[:-1]])
        else:
            predictors = torch.cat([parent_h[None], hidden[:-1]])
        return node, positions, predictors[positions.to(self.view.device)]

    def node_losses(self, pieces: list, backward_next: bool = False) -> torch.Tensor | None:
        """The logprobs (a critic's values) of every piece (`trained_rows`) of a pack, recorded per rollout, and the
        sum of the nodes' losses (None in forward-only mode). The LM head runs once over the rows of all the pieces,
        in chunks: one [vocab, hidden] weight gradient per chunk of the pack, not one per node. backward_next: the
        pack has no children, so its backward runs next (`head.token_logprobs`)."""
        view, engine = self.view, self.engine
        rows = torch.cat([r for _, _, r in pieces])
        sizes = [len(p) for _, p, _ in pieces]
        if view.critic:
            values = token_values(view.head, rows).split(sizes)
            logprobs, entropy = values, [None] * len(pieces)
        else:
            targets = torch.cat([node.tokens[p] for node, p, _ in pieces])
            logprobs, entropy = token_logprobs(view.head, view.transform, rows, targets, self.temperature,
                                               engine.head_chunk_tokens, backward_next, engine.head_float32)
            logprobs, entropy = logprobs.split(sizes), entropy.split(sizes)
        stats = {}
        if self.head_stats and not view.critic:
            stats = head_statistics(view.head, view.transform, rows, targets, self.temperature, self.head_stats,
                                    engine.head_chunk_tokens, engine.head_float32)
            stats = {name: values.cpu().split(sizes) for name, values in stats.items()}
        losses = []
        for k, ((node, positions, _), lp, ent) in enumerate(zip(pieces, logprobs, entropy, strict=True)):
            at = node.start + positions
            self.results.record(node, at, lp, ent, {name: values[k] for name, values in stats.items()})
            if self.loss is not None:
                rollouts = [self.tree.rollouts[i] for i in node.rollouts]
                inputs = loss_inputs(rollouts, at, None, None, values=lp) if view.critic else \
                    loss_inputs(rollouts, at, lp, ent)
                losses.append(self.loss(inputs))
        return torch.stack(losses).sum() if losses else None


class _Results:
    """A tree's results while its packs run: per rollout, logprobs (a critic's values), entropy and head statistics
    [T] at the trained positions and 0 elsewhere; the loss summed over the packs."""

    def __init__(self, tree: RolloutTree, dtype: torch.dtype, critic: bool, head_stats: tuple[str, ...]):
        self.stats, self.critic = tree.stats, critic
        kept = torch.float64 if dtype == torch.float64 else torch.float32  # ReplayResult's dtype
        self.logprobs = [torch.zeros(len(r), dtype=kept) for r in tree.rollouts]  # a critic's values
        self.entropy = [torch.zeros(len(r), dtype=kept) for r in tree.rollouts]
        self.head_stats = {name: [torch.zeros(len(r)) for r in tree.rollouts] for name in head_stats}
        self.loss = 0.0

    def record(self, node: Node, at: torch.Tensor, logprobs: torch.Tensor, entropy: torch.Tensor | None,
               stats: dict[str, torch.Tensor]) -> None:
        """The node's logprobs [L'] (a critic's values), entropy [L'] (None for a critic) and head statistics
        ({name: [L']}) at absolute positions `at` [L'], into each of its rollouts."""
        for i in node.rollouts:
            self.logprobs[i][at] = logprobs.detach().cpu().to(self.logprobs[i].dtype)
            if entropy is not None:
                self.entropy[i][at] = entropy.detach().cpu().to(self.entropy[i].dtype)
            for name, values in stats.items():
                self.head_stats[name][i][at] = values

    def replay_result(self, peak: float | None, replayed: int, kept: int, merged: int) -> ReplayResult:
        """The tree's `ReplayResult` (a critic's: `values`, no logprobs or entropy), with the planner's predicted
        `peak` bytes, the number of `replayed` packs and the schedule's `kept` and `merged` shared nodes."""
        if self.critic:
            return ReplayResult([], [], self.loss, self.stats, peak, replayed, values=self.logprobs,
                                shared_nodes_kept=kept, shared_nodes_merged=merged)
        return ReplayResult(self.logprobs, self.entropy, self.loss, self.stats, peak, replayed,
                            shared_nodes_kept=kept, shared_nodes_merged=merged, head_stats=self.head_stats)


def _hand_down(nodes: list[Node], ancestors: list[list[NodeState]], fwd: _PackForward, train: bool
               ) -> tuple[list[Node], list[list[NodeState]], list[torch.Tensor], list]:
    """What a pack's forward `fwd` hands the children of its nodes: the nodes with children, their children's
    ancestors (the node's own plus its state) and the node's last hidden state [H], and (span, state leaves, last
    hidden leaf) of each such node. In training the state and hidden state handed down are those detached leaves,
    whose gradients the subtrees fill (`_carried`); otherwise no leaves."""
    parents, chains, hs = [], [], []  # the nodes with children, their descendants' ancestors and parent state
    leaves = []  # (span, state leaves, last hidden leaf) of the nodes with children
    for (node, a, b), chain in zip(spans(nodes), ancestors, strict=True):
        if not node.children:
            continue
        state, h = fwd.cache.node_state(a, b), fwd.hidden[b - 1]
        if train:
            state, h = [tuple(_leaf(t) for t in layer) for layer in state], _leaf(h)
            leaves.append(((a, b), state, h))
        parents.append(node)
        chains.append(chain + [state])
        hs.append(h)
    return parents, chains, hs, leaves


def _carried(leaves: list, cache: PrefixCache, hidden: torch.Tensor) -> tuple[list, list]:
    """(outputs, gradients) for a pack's backward from the gradients its subtrees left on `leaves` ((span, state
    leaves, last hidden leaf) per node with children): each node's state in `cache` and last hidden state in
    `hidden` [S, H] against its leaf's gradient."""
    outputs, grads = [], []
    for (a, b), state_leaves, h_leaf in leaves:
        pairs = [(out, leaf) for layer, leaf_layer in zip(cache.node_state(a, b), state_leaves, strict=True)
                 for out, leaf in zip(layer, leaf_layer, strict=True)]
        pairs.append((hidden[b - 1], h_leaf))
        for out, leaf in pairs:  # a state no trainable parameter reaches (frozen layers under LoRA) has none
            if leaf.grad is not None and out.requires_grad:
                outputs.append(out)
                grads.append(leaf.grad)
    return outputs, grads


def _prefix_cache(view: ModelView, nodes: list[Node], ancestors: list[list[NodeState]], split: bool) -> PrefixCache:
    """The `PrefixCache` of a pack: one prefix for all its nodes, or under split attention one per run of nodes
    below the same parent (their positions in the pack's rows, one after the other)."""
    runs = []  # [a, b, ancestors] per run of nodes with the same ancestors
    for (_, a, b), chain in zip(spans(nodes), ancestors, strict=True):
        if runs and _same(runs[-1][2], chain):
            runs[-1][1] = b
        else:
            runs.append([a, b, chain])
    if len(runs) == 1:
        return PrefixCache(ancestors[0], view.num_layers, view.kinds, windows=view.windows,
                           prefix_length=nodes[0].start, split=split)
    if not split:
        raise RuntimeError("a pack below several parents reached the masked attention path (engine bug: "
                           "`packs_of` forms such packs only under split prefix attention)")
    return PrefixCache([], view.num_layers, view.kinds, windows=view.windows, prefix_length=nodes[0].start,
                       split=True, groups=[tuple(run) for run in runs])


def _batch_inputs(view: ModelView, nodes: list[Node], split: bool, images: ImageRun | None) -> dict:
    """The decoder's inputs for a pack that runs as the rows of one [B, L] forward (`packs.is_batch`): input_ids
    [B, L], position ids (`_position_ids` of the tree's `images`) and, under split prefix attention, the mask over
    each row's own keys."""
    length, starts = len(nodes[0]), [n.start for n in nodes]  # starts differ below different parents
    tokens = torch.stack([n.tokens for n in nodes]).to(view.device)  # [B, L]
    local = torch.arange(length, device=view.device)
    positions = _position_ids(images, starts[0] + local, len(nodes)) if len(set(starts)) == 1 else \
        torch.tensor(starts, device=view.device)[:, None] + local  # [B, L] (no images: `run_tree`)
    mask = own_keys_mask(None, length, view.dtype, view.device) if split else None
    return {"input_ids": tokens, "position_ids": positions, "attention_mask": mask}


def _sequence_inputs(view: ModelView, nodes: list[Node], split: bool, images: ImageRun | None, covered: bool
                     ) -> dict:
    """The decoder's inputs for a pack that runs as one query sequence [1, S] of its nodes' tokens: the input ids
    (input embeddings with the features of the tree's `images` where the pack `covered` a placeholder), position ids
    (`_position_ids`) and the tree mask (under split prefix attention over the pack's own keys), None where the
    causal mask is the tree's."""
    lengths, starts = [len(n) for n in nodes], [n.start for n in nodes]  # starts differ below different parents
    P = starts[0]
    tokens = torch.cat([n.tokens for n in nodes]).to(view.device)[None]  # [1, S]
    local = torch.cat([torch.arange(L, device=view.device) for L in lengths])  # position within its node
    segment = torch.repeat_interleave(torch.arange(len(nodes), device=view.device),  # output_size: no device sync
                                      torch.tensor(lengths, device=view.device), output_size=sum(lengths))
    positions = P + local if len(set(starts)) == 1 else local + torch.tensor(starts, device=view.device)[segment]
    blocks = images.blocks(positions) if covered else None  # image blocks, bidirectional inside (vision.py)
    if split:
        own = own_keys_tree_mask(local, segment, view.dtype, blocks) if len(nodes) > 1 or blocks is not None \
            else None
        mask = own_keys_mask(own, tokens.shape[1], view.dtype, view.device)
    elif takes_tree_mask(len(nodes), P, view.family.recurrent) or blocks is not None:
        mask = tree_mask(P, local, segment, view.windows, view.dtype, view.family.mask_mapping, blocks)
    else:
        mask = None
    inputs = {"input_ids": tokens} if not covered else \
        {"inputs_embeds": images.embeds(view.decoder.get_input_embeddings(), tokens[0], positions)[None]}
    return {**inputs, "position_ids": _position_ids(images, positions), "attention_mask": mask}


def _position_ids(images: ImageRun | None, positions: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """The decoder's position ids for `rows` rows at absolute `positions` [S]: [rows, S], the index, or
    [3, rows, S] where the tree's `images` set the rotary positions (Qwen2-VL's mrope: vision.py)."""
    grid = images.rope_positions(positions) if images is not None else None
    if grid is None:
        return positions.expand(rows, -1)
    return grid[:, None].expand(3, rows, -1)


def _matmul_params(decoder) -> int:
    """Parameters of the decoder's matrices, the input embedding left out (it is a lookup, not a matmul)."""
    embedding = {id(p) for p in decoder.get_input_embeddings().parameters()}
    return sum(p.numel() for p in decoder.parameters() if p.dim() >= 2 and id(p) not in embedding)


def _chain(root: Node) -> list[Node]:
    """The nodes of the path every rollout shares, from the root down (a chunked prompt's chunks)."""
    chain = []
    while len(root.children) == 1:
        root = root.children[0]
        chain.append(root)
    return chain


def _same(a: list[NodeState], b: list[NodeState]) -> bool:
    """Whether two ancestor lists hold the same states (the same tensors, not equal values)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(True)
