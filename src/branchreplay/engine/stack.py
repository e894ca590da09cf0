"""The execution stack: exact forward and backward over a tree of rollouts, each unique position computed once.

Depth first: the children of a pack's nodes run as packs (one query sequence of up to `max_pack_tokens` with a tree
mask and absolute position ids, or the rows of one [B, L] batch) against their ancestors' K/V (split prefix
attention: children of several nodes in one pack, `packs_of`; recurrent families: packs of one node, `recurrent.py`).
After a pack's forward its nodes' K/V and last hidden state are detached into leaves; once every descendant has run
its backward they hold dL/dK, dL/dV and dL/dh (a child's first token is predicted from its parent's last hidden
state), and the pack's backward runs once, `torch.autograd.backward([pack_loss, K_n, V_n, h_n, ...], [1, dK_n, dV_n,
dh_n, ...])`: into `param.grad`, what `loss.backward()` on the per-rollout sum gives (the same terms in another
order). The LM head runs only on the trained rows, in checkpointed chunks (`head.py`).
Design notes and measurements: docs/notes/engine-docstrings.md.
"""

from __future__ import annotations

import contextlib

import torch

from ..losses import loss_inputs
from ..models import max_positions
from ..tree import Node, ReplayResult, RolloutTree
from ..value import is_value_model
from .attention import PrefixSplit, own_keys_mask
from .cache import NodeState, PrefixCache
from .config import EngineConfig
from .context_parallel import ContextParallelTree, run_prefix
from .lockstep import BACKWARD, FORWARD
from .embedding import DeferredEmbeddingGrad
from .families import check_no_dropout, family_of, layer_windows
from .head import check_float32_head, check_head, decoder_and_head, head_statistics, token_logprobs, token_values
from .masks import own_keys_tree_mask, takes_tree_mask, tree_mask
from .packs import batched_packs, chunked, is_batch, packs, spans
from .planner import default_budget, memory_model, plan
from .schedule import attention_per_key, schedule
from .positions import length_dependent_rotaries
from .recurrent import EngineForwards, layer_kinds
from .router import RouterLoss, routed, taken
from .vision import ImageRun


class _Run:
    """State of one replay over a tree: the model's pieces, the options, and the per-rollout outputs."""

    def __init__(self, model, temperature: float, engine: EngineConfig, loss, force: bool = False,
                 head_stats: tuple[str, ...] = (), router: RouterLoss | None = None):
        self.family = family_of(model, force=force, router_loss=router is not None or loss is None)  # no training
        self.router = router  # the MoE router loss: each token's rollout count at each decoder call (router.py)
        self.config = model.config
        self.decoder, self.head, self.transform = decoder_and_head(model)  # transform: head.py
        self.windows = layer_windows(model.config)
        self.num_layers = model.config.num_hidden_layers
        self.kinds = layer_kinds(model.config)  # attention / recurrent / hybrid, per layer
        self.engine_forwards = EngineForwards(model)  # exact mixer forwards for cached SSM states (recurrent.py)
        self.prefix_split = PrefixSplit(model, self.windows, self.kinds)
        self.dtype = self.head.weight.dtype
        self.device = self.head.weight.device
        self.critic = is_value_model(model)  # a value model: values at the trained positions (value.py)
        self.vocab_size = model.config.vocab_size if self.critic else self.head.weight.shape[0]
        self.temperature = temperature
        self.rotaries = length_dependent_rotaries(model)  # longrope / dynamic: held at each rollout's length
        self.max_pack_tokens, self.max_batch_tokens = engine.max_pack_tokens, engine.max_batch_tokens
        self.pack_overhead_tokens = engine.pack_overhead_tokens  # which shared nodes run once (schedule.py)
        # calibrated on split prefix attention (schedule.py); not calibrated for the masked path, so not charged there
        self.prefix_position_overhead = engine.prefix_position_overhead if self.prefix_split.applies else 0.0
        self.attention_per_key = attention_per_key(model.config, _matmul_params(self.decoder))
        self.chunk_tokens = engine.chunk_tokens
        self.head_chunk_tokens, self.head_float32 = engine.head_chunk_tokens, engine.head_float32
        if self.head_float32:
            check_float32_head(self.head)
        self.replay, self.memory_budget = engine.replay, engine.memory_budget
        self.replay_set: set[int] = set()
        self.final_backward = None  # a context around the last backward of the last tree (`replay_backward`)
        self.head_stats = head_stats  # `replay_logprobs(head_stats=...)`
        self.lockstep = False  # every forward and backward in step with the other ranks (`lockstep.py`)
        self.images: ImageRun | None = None  # the tree's image features while it runs (vision.py)
        self.across_parents = False  # packs may hold children of different parents (`packs_of`), per tree
        embedding = self.decoder.get_input_embeddings()
        self.deferred = DeferredEmbeddingGrad(embedding) if loss is not None and embedding.weight.requires_grad \
            else None
        self.model = model
        self.loss = loss
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

    def run_tree(self, tree: RolloutTree | ContextParallelTree):
        """One tree through the execution stack: per-rollout logprobs and entropy, the loss, the planner's predicted
        peak bytes (None without a loss) and the number of replayed packs. A `ContextParallelTree` runs its prefix
        across the ranks first (`context_parallel.run_prefix`), then its branches against the prefix's state. A
        generator of the tree's collective events (`lockstep.py`) that returns the result."""
        part = tree if isinstance(tree, ContextParallelTree) else None
        self.across_parents = self.prefix_split.applies and getattr(tree, "images", None) is None
        scheduled = schedule(part.below() if part else tree.root, self.pack_overhead_tokens, self.attention_per_key,
                             self.prefix_position_overhead)
        root = chunked(scheduled.root, self.chunk_tokens)
        peak, replayed = None, 0
        if self.loss is not None:
            budget = None if self.replay != "auto" else self.memory_budget or default_budget(self.device)
            memory = yield from memory_model(self.model, self.forward, tree.stats.physical_tokens,
                                             self.prefix_split.applies)
            taken(self.router)  # the memory probes' forwards: zero-weight terms, not the tree's
            step_plan = plan(root, memory, self.packs_of, budget, replay_all=self.replay == "replay",
                             head_chunk_tokens=self.head_chunk_tokens)
            self.replay_set = step_plan.replay
            peak, replayed = step_plan.predicted_peak_bytes, len(step_plan.replay)
        self.tree = tree
        images = getattr(tree, "images", None)
        self.images = None if images is None else ImageRun(images, self.loss is not None, self.dtype, self.device)
        if self.images is not None:
            self.images.check_chunks([n.start for n in _chain(root)])
        kept = torch.float64 if self.dtype == torch.float64 else torch.float32  # ReplayResult's dtype
        self.logprobs = [torch.zeros(len(r), dtype=kept) for r in tree.rollouts]  # a critic's values
        self.entropy = [torch.zeros(len(r), dtype=kept) for r in tree.rollouts]
        self.stat_values = {name: [torch.zeros(len(r)) for r in tree.rollouts] for name in self.head_stats}
        self.loss_value = 0.0
        if part is None:
            yield from self.children(root, ancestors=[], parent_h=None)
        else:
            yield from run_prefix(self, part, lambda ancestors, h: self.children(root, ancestors, h),
                                  self.final_backward)
        if self.images is not None:  # the features' gradient, summed over the packs, through the vision tower
            self.images.backward()
            self.images = None
        kept, merged = scheduled.kept, scheduled.merged
        if self.critic:
            return ReplayResult([], [], self.loss_value, tree.stats, peak, replayed, values=self.logprobs,
                                shared_nodes_kept=kept, shared_nodes_merged=merged)
        return ReplayResult(self.logprobs, self.entropy, self.loss_value, tree.stats, peak, replayed,
                            shared_nodes_kept=kept, shared_nodes_merged=merged, head_stats=self.stat_values)

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
        if self.family.recurrent:
            return [[node] for parent in parents for node in parent.children]
        if self.across_parents:
            return batched_packs([c for parent in parents for c in parent.children], self.max_pack_tokens,
                                 self.max_batch_tokens, with_children=True)
        return [pack for parent in parents
                for pack in (batched_packs(parent.children, self.max_pack_tokens, self.max_batch_tokens)
                             if parent.end == 0 or self.prefix_split.applies
                             else packs(parent.children, self.max_pack_tokens))]

    def pack(self, nodes: list[Node], ancestors: list[list[NodeState]], parent_hs: list, final: bool = False):
        """Forward of `nodes` (each against its own `ancestors` and its parent's last hidden state `parent_hs`),
        their subtrees, then their one backward.

        A generator that yields FORWARD before each decoder forward and BACKWARD before the backward when the
        backward runs through every layer (lock-step or final). Kept: the pack's autograd graph lives while its
        subtrees run. Replayed: the first forward runs without a
        graph (only the state and last hidden states handed to the children are kept) and is recomputed, with a
        graph, just before the backward: the same values, since it is the same computation on the same inputs."""
        train = self.loss is not None
        replay = train and id(nodes[0]) in self.replay_set
        defer = self.deferred is not None and not final  # the embedding's gradient later, in one pass (embedding.py)
        capture = self.deferred.capture if defer else contextlib.nullcontext
        yield FORWARD
        with torch.no_grad() if replay else contextlib.nullcontext(), capture() as embedded:
            hidden, cache = self.forward(nodes, ancestors)  # hidden [S, H]
        router_terms = taken(self.router)  # none from a replayed pack's no-grad forward (pass 2)
        pack_loss = None if replay else self.pack_loss(nodes, hidden, parent_hs)
        parents, chains, hs = [], [], []  # the nodes with children, their descendants' ancestors and parent state
        leaves = []  # (span, state leaves, last hidden leaf) of the nodes with children
        for (node, a, b), chain in zip(spans(nodes), ancestors):
            if not node.children:
                continue
            state, h = cache.node_state(a, b), hidden[b - 1]
            if train:
                state, h = [tuple(_leaf(t) for t in layer) for layer in state], _leaf(h)
                leaves.append(((a, b), state, h))
            parents.append(node)
            chains.append(chain + [state])
            hs.append(h)
        if parents:
            yield from self.subtrees(parents, chains, hs)
        if not train:
            return
        if replay:
            yield FORWARD
            with capture() as embedded:
                hidden, cache = self.forward(nodes, ancestors)
            router_terms = taken(self.router)
            pack_loss = self.pack_loss(nodes, hidden, parent_hs)
        outputs, grads = [], []
        for (a, b), state_leaves, h_leaf in leaves:
            pairs = [(out, leaf) for layer, leaf_layer in zip(cache.node_state(a, b), state_leaves)
                     for out, leaf in zip(layer, leaf_layer)]
            pairs.append((hidden[b - 1], h_leaf))
            for out, leaf in pairs:  # a state no trainable parameter reaches (frozen layers under LoRA) has none
                if leaf.grad is not None and out.requires_grad:
                    outputs.append(out)
                    grads.append(leaf.grad)
        if pack_loss is not None:
            self.loss_value += pack_loss.item()
            outputs.append(pack_loss)
            grads.append(torch.ones_like(pack_loss))
        outputs += router_terms
        grads += [torch.ones_like(t) for t in router_terms]
        # backward outside an active autocast (its ops take the forward's dtypes; PyTorch's AMP notes advise so)
        no_autocast = torch.autocast(self.device.type, enabled=False)
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
        if defer:
            self.deferred.keep(embedded)

    def pack_loss(self, nodes: list[Node], hidden: torch.Tensor, parent_hs: list) -> torch.Tensor | None:
        """Sum of the nodes' losses (None when no node has a trainable position, or in forward-only mode);
        parent_hs: each node's parent's last hidden state (None at the root)."""
        pieces = [self.trained_rows(node, hidden[a:b], h) for (node, a, b), h in zip(spans(nodes), parent_hs)]
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
        lengths, starts = [len(n) for n in nodes], [n.start for n in nodes]  # starts differ below different parents
        P = starts[0]  # > 0 for every node below the root
        split = self.prefix_split.applies and P > 0  # prefix keys unmasked, the tree mask only over the pack's own
        images = self.images if self.images and any(self.images.covers(n.start, n.end) for n in nodes) else None
        if cache is None:
            cache = self.prefix_cache(nodes, ancestors, split)
        if is_batch(nodes, P, split, self.across_parents) and images is None:  # rows of one [B, L] forward
            tokens = torch.stack([n.tokens for n in nodes]).to(self.device)  # [B, L]
            local = torch.arange(lengths[0], device=self.device)
            positions = self.position_ids(P + local, len(nodes)) if len(set(starts)) == 1 else \
                torch.tensor(starts, device=self.device)[:, None] + local  # [B, L] (no images: `run_tree`)
            mask = own_keys_mask(None, lengths[0], self.dtype, self.device) if split else None
            with self.engine_forwards, routed(self.router, nodes, self.device):
                out = self.decoder(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache,
                                   use_cache=True)
            return out.last_hidden_state.reshape(tokens.numel(), -1), cache  # rows in the order of `packs.spans`
        tokens = torch.cat([n.tokens for n in nodes]).to(self.device)[None]  # [1, S]
        local = torch.cat([torch.arange(L, device=self.device) for L in lengths])  # position within its node
        segment = torch.repeat_interleave(torch.arange(len(nodes), device=self.device),  # output_size: no device sync
                                          torch.tensor(lengths, device=self.device), output_size=sum(lengths))
        positions = P + local if len(set(starts)) == 1 else local + torch.tensor(starts, device=self.device)[segment]
        blocks = images.blocks(positions) if images else None  # image blocks, bidirectional inside (vision.py)
        if split:
            own = own_keys_tree_mask(local, segment, self.dtype, blocks) if len(nodes) > 1 or blocks is not None \
                else None
            mask = own_keys_mask(own, tokens.shape[1], self.dtype, self.device)
        elif takes_tree_mask(len(nodes), P, self.family.recurrent) or blocks is not None:
            mask = tree_mask(P, local, segment, self.windows, self.dtype, self.family.mask_mapping, blocks)
        else:
            mask = None
        inputs = {"input_ids": tokens} if images is None else \
            {"inputs_embeds": images.embeds(self.decoder.get_input_embeddings(), tokens[0], positions)[None]}
        with self.engine_forwards, routed(self.router, nodes, self.device):
            out = self.decoder(**inputs, position_ids=self.position_ids(positions), attention_mask=mask, cache=cache,
                               use_cache=True)
        return out.last_hidden_state[0], cache

    def prefix_cache(self, nodes: list[Node], ancestors: list[list[NodeState]], split: bool) -> PrefixCache:
        """The `PrefixCache` of a pack: one prefix for all its nodes, or under split attention one per run of nodes
        below the same parent (their positions in the pack's rows, one after the other)."""
        runs = []  # [a, b, ancestors] per run of nodes with the same ancestors
        for (_, a, b), chain in zip(spans(nodes), ancestors):
            if runs and _same(runs[-1][2], chain):
                runs[-1][1] = b
            else:
                runs.append([a, b, chain])
        if len(runs) == 1:
            return PrefixCache(ancestors[0], self.num_layers, self.kinds, windows=self.windows,
                               prefix_length=nodes[0].start, split=split)
        if not split:
            raise RuntimeError("a pack below several parents reached the masked attention path (engine bug: "
                               "`packs_of` forms such packs only under split prefix attention)")
        return PrefixCache([], self.num_layers, self.kinds, windows=self.windows, prefix_length=nodes[0].start,
                           split=True, groups=[tuple(run) for run in runs])

    def position_ids(self, positions: torch.Tensor, rows: int = 1) -> torch.Tensor:
        """The decoder's position ids for `rows` rows at absolute `positions` [S]: [rows, S], the index, or
        [3, rows, S] where the tree's images set the rotary positions (Qwen2-VL's mrope: vision.py)."""
        grid = self.images.rope_positions(positions) if self.images is not None else None
        if grid is None:
            return positions.expand(rows, -1)
        return grid[:, None].expand(3, rows, -1)

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
        return node, positions, predictors[positions.to(self.device)]

    def node_losses(self, pieces: list, backward_next: bool = False) -> torch.Tensor | None:
        """The logprobs (a critic's values) of every piece (`trained_rows`) of a pack, recorded per rollout, and the
        sum of the nodes' losses (None in forward-only mode). The LM head runs once over the rows of all the pieces,
        in chunks: one [vocab, hidden] weight gradient per chunk of the pack, not one per node. backward_next: the
        pack has no children, so its backward runs next (`head.token_logprobs`)."""
        rows = torch.cat([r for _, _, r in pieces])
        sizes = [len(p) for _, p, _ in pieces]
        if self.critic:
            values = token_values(self.head, rows).split(sizes)
            logprobs, entropy = values, [None] * len(pieces)
        else:
            targets = torch.cat([node.tokens[p] for node, p, _ in pieces])
            logprobs, entropy = token_logprobs(self.head, self.transform, rows, targets, self.temperature,
                                               self.head_chunk_tokens, backward_next, self.head_float32)
            logprobs, entropy = logprobs.split(sizes), entropy.split(sizes)
        stats = {}
        if self.head_stats and not self.critic:
            stats = head_statistics(self.head, self.transform, rows, targets, self.temperature, self.head_stats,
                                    self.head_chunk_tokens, self.head_float32)
            stats = {name: values.cpu().split(sizes) for name, values in stats.items()}
        losses = []
        for k, ((node, positions, _), lp, ent) in enumerate(zip(pieces, logprobs, entropy)):
            at = node.start + positions
            for i in node.rollouts:
                self.logprobs[i][at] = lp.detach().cpu().to(self.logprobs[i].dtype)
                if ent is not None:
                    self.entropy[i][at] = ent.detach().cpu().to(self.entropy[i].dtype)
                for name, values in stats.items():
                    self.stat_values[name][i][at] = values[k]
            if self.loss is not None:
                rollouts = [self.tree.rollouts[i] for i in node.rollouts]
                inputs = loss_inputs(rollouts, at, None, None, values=lp) if self.critic else \
                    loss_inputs(rollouts, at, lp, ent)
                losses.append(self.loss(inputs))
        return torch.stack(losses).sum() if losses else None


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
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(True)
