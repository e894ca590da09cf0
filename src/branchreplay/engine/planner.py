"""Memory planning for the execution stack: which packs keep their activations and which are replayed.

A kept pack holds its autograd graph while its subtrees run; a replayed pack holds only the state it hands to its
children and recomputes its forward before its backward. The planner predicts a step's peak memory from the tree's
shape and a memory model fitted per model from probe forwards (the bytes autograd saves, parameters excluded), and
replays the internal packs with the largest activations until it fits `memory_budget` (leaf packs never):
    activations(S query tokens, P prefix tokens) = a * S + b * (P + S) + mask entries * mask element bytes + c
        (mask entries: S * (P + S); with split prefix attention S * S for a pack of siblings, 0 for one node;
        c: bytes every pack saves whatever its size, e.g. under autocast its half-precision copy of the weights)
    node state (K/V handed to children)         = s * L per node of L tokens, twice (leaf and its gradient)
plus fixed bytes: the parameters' gradients and the LM head's working chunk (under autocast one half-precision copy
of the matrices). The prediction is an upper bound of `measure_peak_bytes` (tests/test_engine_planner.py).
Design notes and measurements: docs/notes/execution-stack.md.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field

import torch

from ..models import max_positions
from ..tree import Node
from .model_view import ModelView
from .parallel.lockstep import FORWARD


@dataclass(frozen=True)
class MemoryModel:
    """Bytes per query token (a), per visible key (b), per position of handed-on state (s), per row of the LM
    head's working chunk; fixed bytes (parameter gradients still to allocate); bytes per mask entry; whether the
    model runs split prefix attention (`attention.PrefixSplit`), whose mask covers only the pack's own keys;
    bytes per pack (c)."""

    per_token: float
    per_key: float
    state_per_token: float
    head_per_row: float
    fixed_bytes: int
    mask_bytes_per_entry: int
    split: bool = False
    per_pack: float = 0.0

    def activations(self, S: int, P: int, packed: bool) -> float:
        """Bytes saved for backward by a pack of S tokens against P prefix tokens (`packed`: more than one node),
        with the engine's additive mask, one tensor shared by the layers: none for a single root (transformers'
        causal mask) or, with split attention, for a single node; S x S with split attention; else S x (P + S)."""
        if self.split and P > 0:
            entries = S * S if packed else 0
        else:
            entries = S * (P + S) if packed or P > 0 else 0
        return self.per_token * S + self.per_key * (P + S) + self.mask_bytes_per_entry * entries + self.per_pack


@dataclass
class Plan:
    """The replay decision per internal pack (keyed by the id of the pack's first node) and the predicted peak
    memory of the step in bytes (above what was allocated before it)."""

    replay: set[int] = field(default_factory=set)
    predicted_peak_bytes: float = 0.0


class MemoryBudgetError(RuntimeError):
    """No replay plan fits the memory budget."""


def saved_bytes(params: list[torch.Tensor], fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn() runs (parameters excluded)."""
    exclude = {_storage_ptr(p) for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def available_memory_bytes(device: torch.device) -> int | None:
    """Bytes `device` can still allocate: CUDA's free memory (torch.cuda.mem_get_info), on the CPU the MemAvailable
    of /proc/meminfo; None where neither can be read. The one reader of available memory (planner, benchmark)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _storage_ptr(t: torch.Tensor) -> int | None:
    """The data pointer of a tensor's storage; a sharded DTensor parameter (FSDP2) counts by its local shard. The
    unsharded copy FSDP2 gathers for a forward is the same in every probe, so it cancels in the fit's differences."""
    local = t.to_local() if hasattr(t, "to_local") else t
    try:
        return local.untyped_storage().data_ptr()
    except RuntimeError:  # a freed (resharded) storage
        return None


def default_budget(device: torch.device) -> int:
    """90% of `available_memory_bytes(device)`. Raises RuntimeError where it cannot be read."""
    available = available_memory_bytes(device)
    if available is None:
        raise RuntimeError("cannot read the available memory (MemAvailable of /proc/meminfo); set "
                           "EngineConfig.memory_budget")
    return int(available * 0.9)


_fitted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(compute dtype, s, split): MemoryModel}


def memory_model(view: ModelView, forward, tokens: int, split: bool):
    """The `MemoryModel` of the model of `view` (`model_view.ModelView`) for a tree of `tokens` physical positions,
    fitted once per model, compute dtype (the parameters', or an active autocast's), scale s and attention path
    (split or masked), from the bytes that three probe forwards save for backward.
    s = 256 for trees of 4096 positions or more (the sizes whose kernels real steps use: SDPA picks its path by
    size), else s = 16 (cheap, and a small tree's memory is small whatever the fit). The probes never pass the
    model's position limit (GPT-2's learned table): s is at most max_position_embeddings // 7, and a model with
    fewer than 7 positions, whose trees are a few tokens, gets the fixed bytes only.

    forward(nodes, ancestors) -> (hidden [S, H], cache): the engine's pack forward; split: the model runs split
    prefix attention (`attention.PrefixSplit`). A generator that yields FORWARD before each probe forward (the
    probes are decoder forwards like the packs', so under lock-step the other ranks run dummies: `lockstep.py`)
    and returns the `MemoryModel`."""
    model = view.model
    scale = 256 if tokens >= 4096 else 16
    limit = max_positions(model.config)
    if limit is not None:
        scale = min(scale, limit // 7)  # the largest probe runs s tokens against 6s: 7s positions
    device = view.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else view.dtype
    fitted = _fitted.setdefault(model, {})
    if (compute, scale, split) not in fitted:
        fitted[compute, scale, split] = yield from _fit(view, forward, scale, split)
    return fitted[compute, scale, split]


def _fit(view: ModelView, forward, s: int, split: bool):
    """Fit a, b and s of `MemoryModel` from the saved bytes of three probes of scale `s` (none for s = 0); a
    generator of the probes' FORWARD events, as `memory_model`."""
    vocab, dtype = view.model.config.vocab_size, view.dtype
    params = list(view.model.parameters())
    g = torch.Generator().manual_seed(0)

    def probe(S, P):
        prefix = Node(torch.randint(0, vocab, (P,), generator=g), 0, [])
        yield FORWARD
        with torch.no_grad():
            _, cache = forward([prefix], [[]])
        state = [tuple(t.detach().requires_grad_(True) for t in layer) for layer in cache.node_state(0, P)]
        node = Node(torch.randint(0, vocab, (S,), generator=g), P, [])
        leaves = [t for layer in state for t in layer]  # counted as state, not as activations
        yield FORWARD
        return saved_bytes(params + leaves, lambda: forward([node], [[state]])), state

    per_token = per_key = state_per_token = 0.0
    if s > 0:
        b1, state = yield from probe(s, 2 * s)
        b2, _ = yield from probe(2 * s, 2 * s)
        b3, _ = yield from probe(s, 6 * s)
        per_key = max(b3 - b1, 0) / (4 * s)
        per_token = max((b2 - b1) / s - per_key, 0.0)
        state_per_token = sum(t.numel() * t.element_size() for layer in state for t in layer) / (2 * s)
    elem = torch.finfo(dtype).bits // 8
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad and p.grad is None)
    device = view.device.type
    if torch.is_autocast_enabled(device):  # one more half-precision copy of the matrices, outside any pack: the
        # casts and weight gradients of the backward in flight (without it the prediction fell below the peak)
        half = torch.finfo(torch.get_autocast_dtype(device)).bits // 8
        grads += half * sum(p.numel() for p in params if p.dim() >= 2)
    # logits, log-softmax and its exp (the entropy's), saved for backward, and a gradient in flight (a critic's: 1
    # value); a leaf pack holds them from its forward to its backward (head.token_logprobs, backward_next)
    head_per_row = 4 * view.head.weight.shape[0] * max(elem, 4)
    memory = MemoryModel(per_token, per_key, state_per_token, head_per_row, grads, elem, split=split)
    if s > 0:  # what the first probe saved beyond its size-proportional terms: the per-pack constant c
        memory = dataclasses.replace(memory, per_pack=max(b1 - memory.activations(s, 2 * s, False), 0.0))
    return memory


def plan(root, memory: MemoryModel, packs_of, budget: float | None, replay_all: bool = False,
         head_chunk_tokens: int = 512) -> Plan:
    """Predict the step's peak memory and choose the packs to replay.

    Args:
        root: the (chunked) virtual root of the tree.
        memory: the model's `MemoryModel`.
        packs_of: nodes -> list of packs (lists of their children, of one or several of them), as the engine forms
            them (`stack._Run.packs_of`).
        budget: bytes, or None to keep everything (prediction only).
        replay_all: replay every internal pack (EngineConfig.replay == "replay").
        head_chunk_tokens: rows of the LM head at once (a pack's rows run in chunks of at most this many).
    Raises:
        MemoryBudgetError: the step does not fit even with every internal pack replayed.
    """
    internal, longest = {}, [0]
    _collect_internal([root], memory, packs_of, internal, longest)
    fixed = memory.fixed_bytes + memory.head_per_row * min(head_chunk_tokens, longest[0])
    chosen = set(internal) if replay_all else set()
    peak = _peak([root], 0, memory, packs_of, chosen) + fixed
    if budget is None or replay_all or peak <= budget:
        return Plan(chosen, peak)
    for key in sorted(internal, key=internal.get, reverse=True):
        chosen.add(key)
        peak = _peak([root], 0, memory, packs_of, chosen) + fixed
        if peak <= budget:
            return Plan(chosen, peak)
    gib = 2**30
    raise MemoryBudgetError(
        f"the step needs about {peak / gib:.2f} GiB even with every internal pack replayed, and the memory budget is "
        f"{budget / gib:.2f} GiB: lower EngineConfig.max_pack_tokens, max_batch_tokens or chunk_tokens "
        "(smaller packs hold less), split the step into micro-batches of fewer prompts, or raise memory_budget"
    )


def _activations(pack, memory: MemoryModel) -> float:
    """A pack's activation bytes, its prefix taken as its deepest node's (nodes below different parents)."""
    return memory.activations(sum(len(n) for n in pack), max(n.start for n in pack), len(pack) > 1)


def _collect_internal(parents, memory, packs_of, out, longest):
    """Activation bytes of every internal pack under `parents` (by id of its first node), and the longest pack (its
    trained rows go through the LM head together)."""
    for pack in packs_of(parents):
        below = [n for n in pack if n.children]
        if below:
            out[id(pack[0])] = _activations(pack, memory)
            _collect_internal(below, memory, packs_of, out, longest)
        longest[0] = max(longest[0], sum(len(n) for n in pack))


def _peak(parents, held: float, memory: MemoryModel, packs_of, replay: set[int]) -> float:
    """Peak bytes while the subtrees under `parents` run, given `held` bytes already held on the path."""
    peak = held
    for pack in packs_of(parents):
        act = _activations(pack, memory)
        peak = max(peak, held + act)  # its backward frees saved tensors about as fast as it makes gradients
        below = [n for n in pack if n.children]
        if below:
            kept = 0.0 if id(pack[0]) in replay else act
            states = 2 * memory.state_per_token * sum(len(n) for n in below)  # leaves and their gradients
            peak = max(peak, _peak(below, held + kept + states, memory, packs_of, replay))
    return peak


def measure_peak_bytes(fn) -> int:
    """Peak bytes of PyTorch CPU allocations while fn() runs, above the start, from the profiler's memory events
    (each op's own allocations at the op's start, frees as they happen). Slows fn down; for tests and checks."""
    activity = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[activity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
        for e in prof.events()
    )
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak
