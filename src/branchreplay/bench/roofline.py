"""The decoding roofline: how many tokens per second a sampler could reach on this machine, and how far it is.

One decoding step of B streams at context length L (prompt plus the tokens generated so far):

    FLOPs(B, L) = 2 * B * N_matmul + 4 * B * layers * heads * head_dim * L
    bytes(B, L) = N_matmul * w + 2 * B * layers * kv_heads * head_dim * L * a

N_matmul: the parameters of the matrices (the LM head included, the input embedding's lookup not); w and a: the
bytes per weight and per cached key/value element. A step takes at least max(FLOPs / peak FLOP rate, bytes / memory
bandwidth) seconds (the roofline model, Williams, Waterman and Patterson, CACM 2009), so T new tokens from a prompt
of P tokens take at least the sum over L = P .. P + T - 1, a ceiling of B * T / that sum tokens per second (on a GPU
too, with its peaks). `peak_matmul_flops` and `memory_bandwidth` measure this machine's two peaks.
Measurements: docs/benchmarks.md ("The sampler against the roofline").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models import head_dim, kv_heads


@dataclass(frozen=True)
class DecodeShape:
    """What one decoding step costs per stream, from a model's config: matmul parameters, layers, query heads, KV
    heads, head dimension (elements), and the bytes per weight and per cached element."""

    matmul_params: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    weight_bytes: int
    cache_bytes: int

    @classmethod
    def of(cls, model) -> DecodeShape:
        """The shape of a transformers causal LM (attention layers; the LM head counted even when tied to the
        input embedding, whose lookup is not a matmul)."""
        config = model.config.get_text_config()
        embedding = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and p is not embedding)
        matrices += head.numel() if head is embedding else 0
        heads = config.num_attention_heads
        size = next(model.parameters()).element_size()
        return cls(matrices, config.num_hidden_layers, heads, kv_heads(config), head_dim(config), size, size)

    def flops(self, streams: int, context: int) -> float:
        """FLOPs of one step of `streams` streams at context length `context` (tokens)."""
        return 2.0 * streams * self.matmul_params + 4.0 * streams * self.layers * self.heads * self.head_dim * context

    def bytes(self, streams: int, context: int) -> float:
        """Bytes read by one step: every weight once, every stream's cached keys and values."""
        cache = 2.0 * streams * self.layers * self.kv_heads * self.head_dim * context * self.cache_bytes
        return self.matmul_params * self.weight_bytes + cache


@dataclass(frozen=True)
class Roofline:
    """The ceiling of a decode of `streams` streams, `new_tokens` tokens each after a `prompt_tokens` prompt, on a
    machine of `flops_per_s` and `bytes_per_s`: seconds (at least), tokens per second (at most), and whether the
    bytes or the FLOPs bound it (the larger share of the summed step times)."""

    streams: int
    prompt_tokens: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    bound: str

    @classmethod
    def of(cls, shape: DecodeShape, streams: int, prompt_tokens: int, new_tokens: int, flops_per_s: float,
           bytes_per_s: float) -> Roofline:
        compute = sum(shape.flops(streams, prompt_tokens + t) / flops_per_s for t in range(new_tokens))
        memory = sum(shape.bytes(streams, prompt_tokens + t) / bytes_per_s for t in range(new_tokens))
        seconds = sum(max(shape.flops(streams, prompt_tokens + t) / flops_per_s,
                          shape.bytes(streams, prompt_tokens + t) / bytes_per_s) for t in range(new_tokens))
        return cls(streams, prompt_tokens, new_tokens, seconds, streams * new_tokens / seconds,
                   "memory" if memory >= compute else "compute")


def peak_matmul_flops(n: int = 2048, dtype: torch.dtype = torch.float32, repeats: int = 5,
                      device: str = "cpu") -> float:
    """FLOP/s of an [n, n] @ [n, n] matmul in `dtype` with torch's current threads: the best of `repeats` timed
    runs after one warm-up (2 n^3 FLOPs each)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2.0 * n ** 3 / _best_seconds(lambda: a @ b, repeats, device)


def memory_bandwidth(mib: int = 512, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s of copying a `mib` MiB tensor into another (read plus write: twice its size per copy), the best of
    `repeats` timed copies after one warm-up."""
    src = torch.empty(mib * 2 ** 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() / _best_seconds(lambda: dst.copy_(src), repeats, device)


def _best_seconds(fn, repeats: int, device: str) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best
