"""Wall time and peak memory of one run of a method, and the time to build a large tree.

Peak memory: on CUDA, torch.cuda.max_memory_allocated (bytes above the allocation at the start); on CPU, the peak
of the process's resident set size above its value at the start, sampled every millisecond by a thread (an upper
bound on what the method allocated; memory the allocator keeps from an earlier phase can hide part of it).
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from dataclasses import dataclass

import torch

from ..tree import Rollout, RolloutTree


@dataclass
class Measured:
    seconds: float
    peak_bytes: int


def rss_bytes() -> int:
    """This process's resident set size, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def release_freed_memory() -> None:
    """Return memory freed by earlier phases to the OS (glibc malloc_trim), so it does not hide the next peak."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure(fn, device: torch.device, memory: bool = True) -> Measured:
    """Run fn() once; its wall time (seconds) and peak memory above the start (bytes). memory=False: time only, no
    sampling thread (peak_bytes 0). On the CPU the sampler wakes every millisecond and takes the GIL from the
    method's Python, which slows many small calls (the engine's packs) more than a few large ones (naive's)."""
    gc.collect()
    if not memory:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return Measured(time.perf_counter() - t0, 0)
    release_freed_memory()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return Measured(time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base)
    base = rss_bytes()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    return Measured(seconds, max(peak[0], rss_bytes()) - base)


def tree_build_seconds(rollouts: int = 64, tokens: int = 32_768, vocab: int = 50_000) -> float:
    """Seconds to build the tree of `rollouts` sequences of `tokens` tokens sharing a prompt of tokens - 768."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (tokens - 768,), generator=g)
    rs = [Rollout(torch.cat([prompt, torch.randint(0, vocab, (768,), generator=g)])) for _ in range(rollouts)]
    t0 = time.perf_counter()
    RolloutTree(rs)
    return time.perf_counter() - t0
