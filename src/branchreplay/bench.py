"""`branchreplay bench`: naive and branch replay side by side, in one process, on the same model and rollouts.

Wall time is measured after a warm-up of both methods. Peak memory: on CUDA, torch.cuda.max_memory_allocated
(bytes above the allocation at the start); on CPU, the peak of the process's resident set size above its value at
the start, sampled every millisecond by a thread (an upper bound on what the method allocated; memory the allocator
keeps from an earlier phase can hide part of it).
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from dataclasses import dataclass

import torch

from .engine import replay_backward
from .losses import GRPOLoss
from .models import tiny_model
from .reference import max_rel_grad_err, naive_backward
from .scenarios import make_rollouts, shared_prompt
from .tree import Rollout, RolloutTree

BENCH_MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=688, vocab_size=2048, max_position_embeddings=65_536)


@dataclass
class Measured:
    seconds: float
    peak_bytes: int


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _release_freed_memory() -> None:
    """Return memory freed by earlier phases to the OS (glibc malloc_trim), so it does not hide the next peak."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure(fn, device: torch.device) -> Measured:
    """Run fn() once; its wall time (seconds) and peak memory above the start (bytes)."""
    gc.collect()
    _release_freed_memory()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return Measured(time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base)
    base = _rss_bytes()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    return Measured(seconds, max(peak[0], _rss_bytes()) - base)


def tree_build_seconds(rollouts: int = 64, tokens: int = 32_768, vocab: int = 50_000) -> float:
    """Seconds to build the tree of `rollouts` sequences of `tokens` tokens sharing a prompt of tokens - 768."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (tokens - 768,), generator=g)
    rs = [Rollout(torch.cat([prompt, torch.randint(0, vocab, (768,), generator=g)])) for _ in range(rollouts)]
    t0 = time.perf_counter()
    RolloutTree(rs)
    return time.perf_counter() - t0


def bench_shared_prompt(prompt_tokens: int = 2048, generations: int = 8, response_tokens: int = 128,
                        dtype=torch.float32, device: str = "cpu", seed: int = 0) -> dict:
    """Naive vs replay on a prompt of `prompt_tokens` and `generations` responses of `response_tokens`, tiny Llama
    (hidden 256, 4 layers, vocab 2048). Returns the figures as a dict (keys documented in the README)."""
    device = torch.device(device)
    model = tiny_model("llama", dtype=dtype, seed=seed, **BENCH_MODEL).to(device)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    rollouts = make_rollouts(shared_prompt(prompt_tokens, generations, response_tokens, vocab, g), g)
    warmup = make_rollouts(shared_prompt(64, 2, 16, vocab, g), g)
    loss = GRPOLoss()

    def naive(rs):
        model.zero_grad(set_to_none=True)
        naive_backward(model, rs, loss)

    def replay(rs):
        model.zero_grad(set_to_none=True)
        replay_backward(model, RolloutTree(rs), loss)

    naive(warmup)
    replay(warmup)
    m_naive = measure(lambda: naive(rollouts), device)
    g_naive = [p.grad.clone() for p in model.parameters()]
    m_replay = measure(lambda: replay(rollouts), device)
    g_replay = [p.grad.clone() for p in model.parameters()]
    stats = RolloutTree(rollouts).stats
    return {
        "scenario": "shared-prompt",
        "model": "tiny llama: hidden 256, 4 layers, 4 heads (2 KV), vocab 2048",
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens,
        "generations": generations,
        "response_tokens": response_tokens,
        "logical_tokens": stats.logical_tokens,
        "physical_tokens": stats.physical_tokens,
        "token_ratio": stats.token_ratio,
        "naive_s": m_naive.seconds,
        "replay_s": m_replay.seconds,
        "speedup": m_naive.seconds / m_replay.seconds,
        "naive_peak_bytes": m_naive.peak_bytes,
        "replay_peak_bytes": m_replay.peak_bytes,
        "max_rel_grad_err": max_rel_grad_err(g_replay, g_naive),
        "tree_build_s_64x32k": tree_build_seconds(),
    }
