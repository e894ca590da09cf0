"""The `sampling` section of the run config: `SamplingConfig`, and the per-turn forks of multi-turn sampling.

Torch-free, so that the run config parses (and `--help` prints) before torch loads; `decode/loop.py`
samples with it.
Measurements behind its help texts: docs/notes/sampler.md.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

from ..fields import check, choice, help_of

Backend = Literal["hf", "vllm"]
CacheImplementation = Literal["auto", "static", "dynamic"]


@dataclass
class SamplingConfig:
    """How to sample one group. Raises ValueError naming the field and its accepted range when one is out of range."""

    temperature: float = field(default=1.0, metadata=help_of(
        "> 0; logits are divided by it before both sampling and the recorded logprob (and in training)"))
    top_p: float = field(default=1.0, metadata=help_of("in (0, 1]; nucleus filtering for sampling only (1.0 = off)"))
    top_k: int = field(default=0, metadata=help_of(">= 0; keep the k most likely tokens for sampling only (0 = off)"))
    max_new_tokens: int = field(default=64, metadata=help_of(">= 1; completion length limit in tokens"))
    branching: tuple[tuple[int, int], ...] = field(default=(), metadata=help_of(
        "((depth, factor), ...) with depths strictly increasing in [0, max_new_tokens) and factors >= 1: each live "
        "stream forks into `factor` streams before generating the token at `depth` (depth 0 = the first generated "
        "token). ((0, 2), (32, 4)) gives 2 streams from the start, each forking into 4 at depth 32: 8 samples. The "
        "product of the factors must equal grpo.num_generations. Empty (the default) means num_generations "
        "independent samples, i.e. ((0, num_generations),). Single-turn tasks only: a multi-turn task forks inside "
        "a turn with sampling.turn_branching"))
    turn_branching: tuple = field(default=(), metadata=help_of(
        "multi-turn tasks (agent.environment): how many replies each conversation draws at turn t, one entry per "
        "turn, turns past the list drawing 1. An entry is a factor f >= 1, or a ((depth, factor), ...) schedule as "
        "sampling.branching that also forks inside the turn. [2, 4]: 2 first replies, each continued 4 ways after "
        "the environment's answer, so trajectories share whole earlier turns; [[[0, 2], [16, 2]]]: 2 first replies "
        "that each fork at their 16th token. The product of every entry's factors must equal grpo.num_generations "
        "(trajectories that end early make smaller groups). Empty: [grpo.num_generations], independent "
        "trajectories that share only the opening messages"))

    cache_implementation: CacheImplementation = field(default="auto", metadata=help_of(
        "the in-process sampler's KV cache while every group of a step decodes together (transformers' name for "
        "it): 'static', preallocated and written in place, one fixed-shape decoding step over a power-of-two "
        "bucket of rows (replayed as a CUDA graph on CUDA; a finished stream's row decodes junk until the streams "
        "fit half the rows), each group's prompt held once where split prefix attention applies (float32 / float64 "
        "on the CPU, float32 on CUDA), else copied into each of its rows (up to twice the dynamic cache's memory); "
        "'dynamic', transformers' DynamicCache grown each step, finished streams' rows dropped at once; 'auto': "
        "static on CUDA; on the CPU, for Llama-architecture models (llama, qwen2, qwen3, mistral without a "
        "window) in float32 / float64 without LoRA, the plain decoding step of decode/rows/llama.py ("
        "MKL-packed projections, each group's prompt held once, generated keys in a store grown by doubling, "
        "only live streams decoded), else dynamic: on the CPU a finished stream's static row costs compute until the "
        "streams fit half the rows (at short prompts static takes about dynamic's time), while after a long shared "
        "start static is faster in less memory: set it for long prompts. The static "
        "rows' generated slots start at 64 and double when full, so a large max_new_tokens costs nothing until "
        "replies grow that long. The same samples "
        "either way, up to the attention's floating-point order. Multi-turn turns decode the same way, every "
        "conversation's reply of a turn in one loop (static: each conversation's history held once where split "
        "prefix attention applies). Models with "
        "sliding-window or recurrent layers or without SDPA attention decode with 'dynamic'"))
    enforce_eager: bool = field(default=False, metadata=help_of(
        "vLLM's name: on CUDA, run the static cache's decoding step op by op instead of capturing it once as a CUDA "
        "graph and replaying it (mixture-of-experts models and models sharded by FSDP2 always run it eagerly)"))
    pack_weights: bool = field(default=True, metadata=help_of(
        "the in-process (hf) sampler on the CPU in float32: run the linear layers from MKL-packed weights while "
        "sampling (`decode/packed_linears.py`: a faster decoding step), packed once per step, "
        "about one more copy of the packed matrices' bytes resident meanwhile; false: nn.Linear as it is"))
    max_num_seqs: int | None = field(default=None, metadata=help_of(
        "vLLM's name, for the in-process (hf) sampler: the most sequences sampled together. A step's groups "
        "(multi-turn: its items) sample in waves of max(1, max_num_seqs // grpo.num_generations), each wave "
        "prefilled and decoded on its own, so only a wave's KV caches are alive at once (multi-turn: every live "
        "conversation of the wave's items, up to num_generations each); null (the default): the whole step at "
        "once. Each group draws from its own generator, so waves change the samples only by the floating-point "
        "order of the batched matmuls. >= 1"))
    backend: Backend = field(default="hf", metadata=help_of(
        "'hf': sampling here with transformers (the prompt prefilled once per group); 'vllm': a vLLM server "
        "(`branchreplay vllm-serve --model SPEC`, in its own venv from `make vllm`) samples, with prefix caching, "
        "and gets the weights after every optimizer update; the run's own logprobs stay the old-policy ones and "
        "the mismatch is logged (sampling/logprob_diff_mean, sampling/mismatch_kl). GRPO, RLOO, REINFORCE++ and "
        "PPO, single- and multi-turn, with sampling.branching, LoRA (serve with --lora-rank) and torchrun. With "
        "top_p < 1 or top_k the server's logprobs are of the filtered, renormalised distribution (as TRL's vLLM), so "
        "the mismatch includes it"))
    vllm_url: str = field(default="http://127.0.0.1:8000", metadata=help_of(
        "the vLLM server of sampling.backend=vllm (it must read the files the weights are synced as: /dev/shm, or "
        "TMPDIR when set)"))
    vllm_timeout_s: float = field(default=600.0, metadata=help_of(
        "seconds one vLLM request may take before the server counts as not answering (the run then checkpoints "
        "and stops), > 0"))
    vllm_importance_sampling_cap: float | None = field(default=None, metadata=help_of(
        "TRL's truncated importance sampling (vllm_importance_sampling_correction, token_truncate): each trained "
        "token's policy term times min(exp(logp_old - logp_vllm), cap), > 0; null = off. Token-level losses only "
        "(algorithm grpo, not GSPO)"))

    @property
    def uses_vllm(self) -> bool:
        """Whether a vLLM server samples (backend vllm), not this process (hf)."""
        return self.backend == "vllm"

    def __post_init__(self):
        choice("sampling.backend", self.backend, Backend)
        choice("sampling.cache_implementation", self.cache_implementation, CacheImplementation)
        check("sampling.vllm_timeout_s", self.vllm_timeout_s > 0, "> 0 seconds", self.vllm_timeout_s)
        if self.max_num_seqs is not None:
            check("sampling.max_num_seqs", self.max_num_seqs >= 1, ">= 1 (or null: the whole step at once)",
                  self.max_num_seqs)
        if self.vllm_importance_sampling_cap is not None:
            check("sampling.vllm_importance_sampling_cap", self.vllm_importance_sampling_cap > 0, "> 0 (or null)",
                  self.vllm_importance_sampling_cap)
        check("sampling.temperature", self.temperature > 0, "> 0", self.temperature)
        check("sampling.top_p", 0 < self.top_p <= 1, "in (0, 1]", self.top_p)
        check("sampling.top_k", self.top_k >= 0, ">= 0 (0 = off)", self.top_k)
        check("sampling.max_new_tokens", self.max_new_tokens >= 1, ">= 1", self.max_new_tokens)
        self.branching = tuple((int(d), int(f)) for d, f in self.branching)
        depths = [d for d, _ in self.branching]
        check("sampling.branching", all(b > a for a, b in itertools.pairwise(depths)), "depths strictly increasing",
              self.branching)
        check("sampling.branching", not depths or (0 <= depths[0] and depths[-1] < self.max_new_tokens),
              f"depths in [0, max_new_tokens={self.max_new_tokens})", self.branching)
        check("sampling.branching", all(f >= 1 for _, f in self.branching), "factors >= 1", self.branching)
        self.turn_branching = tuple(self._turn_entry(t, e) for t, e in enumerate(self.turn_branching))

    def _turn_entry(self, t: int, entry):
        """One turn_branching entry: an int factor >= 1, or a schedule of (depth, factor) pairs (as `branching`)."""
        name = f"sampling.turn_branching[{t}]"
        if isinstance(entry, int) and not isinstance(entry, bool):
            check(name, entry >= 1, "a factor >= 1 or a list of [depth, factor] pairs", entry)
            return entry
        ok = isinstance(entry, (list, tuple)) and len(entry) > 0 and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, int) for x in p) for p in entry)
        check(name, ok, "a factor >= 1 or a non-empty list of [depth, factor] pairs", entry)
        pairs = tuple((int(d), int(f)) for d, f in entry)
        depths = [d for d, _ in pairs]
        check(name, all(b > a for a, b in itertools.pairwise(depths)) and 0 <= depths[0] and
              depths[-1] < self.max_new_tokens and all(f >= 1 for _, f in pairs),
              f"depths strictly increasing in [0, max_new_tokens={self.max_new_tokens}), factors >= 1", entry)
        return pairs


def turn_schedule(turn_branching: tuple, turn: int) -> dict[int, int]:
    """{generated depth: factor} of the replies drawn at `turn` (0-based) by a `SamplingConfig.turn_branching`:
    an int entry f forks at depth 0, a schedule as given, a turn past the list draws one reply."""
    if turn >= len(turn_branching):
        return {0: 1}
    entry = turn_branching[turn]
    return {0: entry} if isinstance(entry, int) else dict(entry)


def turn_factor(entry) -> int:
    """Replies one conversation draws at a turn with this turn_branching entry (the product of its factors)."""
    return entry if isinstance(entry, int) else math.prod(f for _, f in entry)
