"""The decoding rows of `loop.sample_groups` in a preallocated KV cache (sampling.cache_implementation=static),
as gpt-fast and vLLM decode: every step is the same forward over a fixed number of rows, so on CUDA it is captured
once as a CUDA graph and replayed (sampling.enforce_eager=True runs it eagerly instead).

The cache is transformers' `StaticCache` (one [rows, kv_heads, slots, head_dim] tensor per layer and for keys and
values). Where split prefix attention applies (`engine.attention.PrefixSplit`) each group's prompt is held once and
read through `grouped_prefix_attention`; elsewhere every row holds its prompt under a boolean mask. Either way a row
sees exactly the keys the dynamic path gives it. Rows and generated slots come in power-of-two buckets (`StaticRows`).
The tokens are drawn outside the graph as the dynamic path draws them (per group, from its own generator, for its
live streams only), so the sampled ids and logprobs are the dynamic path's (float64 test).
Design notes: docs/notes/sampler.md.
"""

from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache, StaticCache

from ...engine.attention import GROUPS_ATTR, groups_mask
from ...models import is_mixture_of_experts
from .llama import FIRST_SLOTS  # generated slots a row starts with, as the plain step's key store


def static_applies(model) -> bool:
    """Whether `StaticRows` can decode `model`: its attention is SDPA, which reads the boolean 4-D mask as "the keys
    a row sees" (eager attention would add it to the scores)."""
    return getattr(model.config, "_attn_implementation", None) == "sdpa"


def graphs_apply(model) -> bool:
    """Whether `StaticRows` may capture the decoding step as a CUDA graph: a model on CUDA, not a mixture of experts
    (its routing sizes each expert's batch on the host, which a graph cannot replay) and not sharded by FSDP2 (its
    hooks gather the parameters inside every forward)."""
    if model.device.type != "cuda":
        return False
    if is_mixture_of_experts(model.config):
        return False
    from torch.distributed.fsdp import FSDPModule

    return not any(isinstance(m, FSDPModule) for m in model.modules())


class StaticRows:
    """The rows of the step's streams in a `StaticCache` of `capacity` rows, with the prompts in one of two ways.

    start: [prompts] long, each prompt's first generated position; live stream k starts as prompt k in row k.
    Either every row holds its prompt: `stacked`, the prompts' caches left-aligned (`dynamic.stacked`, P slots),
    and `visible` [prompts, P] long, 1 where a slot holds one of the prompt's keys (the cache then has P slots and
    the generated ones). Or each prompt is held once: `prompts`, one batch-1 DynamicCache per prompt, which the
    rows of its group see through `grouped_prefix_attention` (the cache holds only the generated slots; a fork
    copies none of the prompt); the caller decodes inside an `engine.attention.PrefixSplit` that applies. The
    generated slots: FIRST_SLOTS, doubled when full, at most max_new_tokens. `graphs`: capture the step as a CUDA
    graph (on CUDA; `graphs_apply`). The capacity is a power of two, the smallest that holds the live streams when
    they outgrow it or fill at most half of it (then the rows are gathered into a new cache). A finished stream's
    row stops being read but goes on decoding junk (which keeps the step's shape) until that gather; a fork's
    children copy their parent's row. So at most twice the live rows decode over at most twice the slots written;
    on CUDA each new shape (a gather, a doubling of the slots) is captured again."""

    def __init__(self, model, start: torch.Tensor, max_new_tokens: int, graphs: bool, stacked: DynamicCache = None,
                 visible: torch.Tensor = None, prompts: list[DynamicCache] = None):
        n = len(start)
        self.model, self.device, self.graphs, self.shared = model, start.device, graphs, prompts is not None
        self.width = 0 if self.shared else visible.shape[1]
        self.max_new_tokens, slots = max_new_tokens, min(FIRST_SLOTS, max_new_tokens)
        self.cache = StaticCache(config=model.config, max_cache_len=self.width + slots)
        if self.shared:
            self.prompt_keys = [[c.layers[i].keys for c in prompts] for i in range(len(self.cache.layers))]
            self.prompt_values = [[c.layers[i].values for c in prompts] for i in range(len(self.cache.layers))]
            for layer, keys, values in zip(self.cache.layers, self.prompt_keys, self.prompt_values, strict=True):
                empty = keys[0][:, :, :0].expand(n, -1, -1, -1), values[0][:, :, :0].expand(n, -1, -1, -1)
                layer.lazy_initialization(*empty)  # allocates n rows of `slots` slots
            self.mask = torch.full((n, 1, 1, slots), float("-inf"), dtype=model.dtype, device=self.device)
            self.group = list(range(n))
        else:
            for static, dynamic in zip(self.cache.layers, stacked.layers, strict=True):
                static.update(dynamic.keys, dynamic.values)  # allocates prompts rows, writes slots [0, width)
            self.mask = torch.zeros(n, 1, 1, self.width + slots, dtype=torch.bool, device=self.device)
            self.mask[:, 0, 0, : self.width] = visible.bool()
        self.start = start.clone()
        self.tokens = torch.zeros(n, 1, dtype=torch.long, device=self.device)
        self.positions = self.start[:, None].clone()
        self.slots = list(range(n))
        self.graph = self.logits = None
        self._gather(self.slots)

    @property
    def capacity(self) -> int:
        return len(self.start)

    @property
    def slots_held(self) -> int:
        """Generated slots each row holds now (the prompt's, where every row holds it, not counted)."""
        return self.mask.shape[-1] - self.width

    def _step(self) -> torch.Tensor:
        """One decoding step of every row: [capacity, V] logits in the model's dtype."""
        out = self.model(input_ids=self.tokens, position_ids=self.positions, attention_mask=self.mask,
                         cache=self.cache, use_cache=True)
        return out.logits[:, -1]

    def _capture(self):
        """Capture `_step` as a CUDA graph after two warm-up steps on a side stream (as torch.cuda.graphs asks). The
        warm-ups write at the next slot, which the next real step overwrites; each layer's write position is set
        back after each of them, and after the capture or its failure."""
        written = [layer.cumulative_length.clone() for layer in self.cache.layers]

        def rewind():
            for layer, n in zip(self.cache.layers, written, strict=True):
                layer.cumulative_length.copy_(n)

        stream = torch.cuda.Stream(self.device)
        try:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step()
                    rewind()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self._step()
            self.graph = graph
        finally:
            torch.cuda.current_stream(self.device).wait_stream(stream)  # a failed warm-up's writes end first
            rewind()

    def _gather(self, rows: list[int]) -> None:
        """Live stream j moves to row j of a new cache whose rows are old rows `rows`, padded to a power of two."""
        capacity = 1 << max(len(rows) - 1, 0).bit_length()
        index = torch.tensor(rows + [rows[0]] * (capacity - len(rows)), dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            rows_there = index.to(layer.keys.device)  # a model split across devices keeps each layer's cache there
            layer.keys, layer.values = layer.keys[rows_there], layer.values[rows_there]
            layer.batch_size = capacity
        self.mask, self.start, self.tokens, self.positions = (
            self.mask[index], self.start[index], self.tokens[index], self.positions[index])
        if self.shared:  # the rows of group g are consecutive (the sampler keeps streams in group order): span g
            self.group = [self.group[r] for r in rows] + [-1] * (capacity - len(rows))  # padding: no prompt
            self._mark_groups()
        self.slots = list(range(len(rows)))
        self.slot_index = torch.arange(len(rows), device=self.device)
        self.graph = self.logits = None  # the step's tensors moved: captured again at the next step

    def _mark_groups(self) -> None:
        """Hand each layer's keys the rows' group spans and the prompts (`grouped_prefix_attention`), and mark the
        mask: after every gather or doubling, whose tensors are new."""
        spans = [(self.group.index(g), len(self.group) - self.group[::-1].index(g)) if g in self.group else (0, 0)
                 for g in range(len(self.prompt_keys[0]))]
        for layer, keys, values in zip(self.cache.layers, self.prompt_keys, self.prompt_values, strict=True):
            setattr(layer.keys, GROUPS_ATTR, (spans, keys, values))
        groups_mask(self.mask)

    def _grow(self) -> None:
        """Double the generated slots of every row (at most max_new_tokens), keeping those written; the new ones
        hidden by the mask until written."""
        old = self.slots_held
        new = min(2 * old, self.max_new_tokens)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                held = getattr(layer, name)
                grown = held.new_zeros((*held.shape[:2], self.width + new, held.shape[3]))
                grown[:, :, : self.width + old] = held
                setattr(layer, name, grown)
            layer.max_cache_len = self.width + new
        hidden = float("-inf") if self.shared else False
        self.mask = torch.cat([self.mask, self.mask.new_full((*self.mask.shape[:3], new - old), hidden)], dim=-1)
        if self.shared:
            self._mark_groups()
        self.graph = self.logits = None  # a new shape: captured again at the next step

    def select(self, index: torch.Tensor) -> None:
        """Live stream j becomes old live stream index[j]. A drop (every index once) only forgets rows; a fork (an
        index repeated), more streams than rows, or half the rows or fewer, gather the rows into a new cache."""
        index = index.tolist()
        if not index:  # every stream has ended: nothing decodes again
            self.slots = []
        elif len(set(index)) < len(index) or not self.capacity // 2 < len(index) <= self.capacity:
            self._gather([self.slots[i] for i in index])
        else:
            self.slots = [self.slots[i] for i in index]
            self.slot_index = torch.tensor(self.slots, dtype=torch.long, device=self.device)

    def decode(self, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """Each live stream's token ([streams, 1]) at generated depth `depth`: the [streams, V] float32 next logits.
        A step that cannot be captured as a CUDA graph (a forward that syncs with the host) warns and runs op by op
        from then on."""
        if depth >= self.slots_held:
            self._grow()
        self.tokens.index_copy_(0, self.slot_index, tokens)
        self.positions.copy_(self.start[:, None] + depth)
        if self.shared:
            self.mask[:, 0, 0, depth] = 0.0
        else:
            self.mask[:, 0, 0, self.width + depth] = True
        if self.graphs and self.graph is None:
            try:
                self._capture()
            except Exception as e:
                warnings.warn(f"capturing {type(self.model).__name__}'s decoding step as a CUDA graph failed ({e}); "
                              f"it runs op by op (sampling.enforce_eager=true skips the attempt)", RuntimeWarning,
                              stacklevel=2)
                self.graphs = False
        if not self.graphs:
            return self._step().index_select(0, self.slot_index).float()
        self.graph.replay()
        return self.logits.index_select(0, self.slot_index).float()
