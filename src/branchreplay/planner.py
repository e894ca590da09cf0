"""Memory planning for the execution stack: which packs keep their activations and which are replayed.

A kept pack holds its autograd graph while its subtrees run; a replayed pack holds only the state it hands to its
children (and recomputes its forward before its backward). The planner predicts the peak memory of a step from
the tree's shape and a memory model of the network, and replays the internal packs with the largest activations
until the prediction fits `memory_budget`. Leaf packs are never replayed: nothing runs while they hold their graph.

Memory model (bytes), fitted per model from probe forwards that count the tensors autograd saves for backward
(`torch.autograd.graph.saved_tensors_hooks`; parameters excluded):
    activations(S query tokens, P prefix tokens) = a * S + b * (P + S) + mask entries * mask element bytes
        (mask entries: S * (P + S); with split prefix attention, S * S for a pack of siblings, 0 for one node)
    node state (K/V handed to children)         = s * L per node of L tokens, twice (leaf and its gradient)
plus fixed bytes: the parameters' gradients and the LM head's working chunk. Measured against
`measure_peak_bytes` on tiny Llamas (tests/test_planner.py), the prediction is an upper bound within 1.6x.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

@dataclass(frozen=True)
class MemoryModel:
    """Bytes per query token (a), per visible key (b), per position of handed-on state (s), per row of the LM
    head's working chunk; fixed bytes (parameter gradients still to allocate); bytes per mask entry; whether the
    model runs split prefix attention (`attention.PrefixSplit`), whose mask covers only the pack's own keys."""

    per_token: float
    per_key: float
    state_per_token: float
    head_per_row: float
    fixed_bytes: int
    mask_bytes_per_entry: int
    split: bool = False

    def activations(self, S: int, P: int, packed: bool) -> float:
        """Bytes saved for backward by a pack of S tokens against P prefix tokens (`packed`: more than one node),
        with the engine's additive mask, one tensor shared by the layers: none for a single root (transformers'
        causal mask) or, with split attention, for a single node; S x S with split attention; else S x (P + S)."""
        if self.split and P > 0:
            entries = S * S if packed else 0
        else:
            entries = S * (P + S) if packed or P > 0 else 0
        return self.per_token * S + self.per_key * (P + S) + self.mask_bytes_per_entry * entries


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
    exclude = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def default_budget(device: torch.device) -> int:
    """90% of the free memory of `device` (CUDA: torch.cuda.mem_get_info; CPU: MemAvailable of /proc/meminfo)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * 0.9)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(int(line.split()[1]) * 1024 * 0.9)
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; set EngineConfig.memory_budget")


def plan(root, memory: MemoryModel, packs_of, budget: float | None, replay_all: bool = False,
         head_chunk_tokens: int = 512) -> Plan:
    """Predict the step's peak memory and choose the packs to replay.

    Args:
        root: the (chunked) virtual root of the tree.
        memory: the model's `MemoryModel`.
        packs_of: node -> list of packs (lists of sibling nodes), as the engine forms them.
        budget: bytes, or None to keep everything (prediction only).
        replay_all: replay every internal pack (EngineConfig.replay == "replay").
        head_chunk_tokens: rows of the LM head at once (a node's rows run in chunks of at most this many).
    Raises:
        MemoryBudgetError: the step does not fit even with every internal pack replayed.
    """
    internal, longest = {}, [0]
    _collect_internal(root, 0, memory, packs_of, internal, longest)
    fixed = memory.fixed_bytes + memory.head_per_row * min(head_chunk_tokens, longest[0])
    chosen = set(internal) if replay_all else set()
    peak = _peak(root, 0, memory, packs_of, chosen) + fixed
    if budget is None or replay_all or peak <= budget:
        return Plan(chosen, peak)
    for key in sorted(internal, key=internal.get, reverse=True):
        chosen.add(key)
        peak = _peak(root, 0, memory, packs_of, chosen) + fixed
        if peak <= budget:
            return Plan(chosen, peak)
    gib = 2**30
    raise MemoryBudgetError(
        f"the step needs about {peak / gib:.2f} GiB even with every internal pack replayed, and the memory budget is "
        f"{budget / gib:.2f} GiB: lower EngineConfig.max_pack_tokens or chunk_tokens (smaller packs hold less), "
        "split the step into micro-batches of fewer prompts, or raise memory_budget"
    )


def _collect_internal(node, P, memory, packs_of, out, longest):
    """Activation bytes of every internal pack under `node` (by id of its first node), and the longest node."""
    for pack in packs_of(node):
        if any(n.children for n in pack):
            S = sum(len(n) for n in pack)
            out[id(pack[0])] = memory.activations(S, P, len(pack) > 1)
        for n in pack:
            longest[0] = max(longest[0], len(n))
            _collect_internal(n, P + len(n), memory, packs_of, out, longest)


def _peak(node, held: float, memory: MemoryModel, packs_of, replay: set[int]) -> float:
    """Peak bytes while the subtrees under `node` run, given `held` bytes already held on the path."""
    P = node.end
    peak = held
    for pack in packs_of(node):
        S = sum(len(n) for n in pack)
        act = memory.activations(S, P, len(pack) > 1)
        peak = max(peak, held + act)  # its backward frees saved tensors about as fast as it makes gradients
        kept = 0.0 if id(pack[0]) in replay else act
        states = 0.0
        for n in pack:
            if n.children:
                states += 2 * memory.state_per_token * len(n)  # leaves and their gradients, until the pack's backward
                peak = max(peak, _peak(n, held + kept + states, memory, packs_of, replay))
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
