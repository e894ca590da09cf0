"""`branchreplay bench`: four exact ways to compute the same GRPO gradient, side by side in one process, on the same
model (tiny Llama, `BENCH_MODEL`) and the same rollouts.

Methods (all give the naive gradient, to floating-point tolerance; each row reports its error):
    naive           each rollout alone, unpadded (`reference.naive_backward`): the reference.
    padded          TRL's padded batch, one [B, T_max] forward/backward (`baselines.padded_backward`).
    prompt-sharing  the prompt once, each suffix against the prompt's K/V repeated per suffix (Prefix Grouper;
                    `baselines.prompt_sharing_backward`, the PyPI package when installed, else our equivalent).
    branchreplay    the execution stack over the prefix tree (`engine.replay_backward`).

Scenarios (`Scenario`): shared-prompt (P + G x R), multi-turn (agent trajectories sharing earlier turns,
`scenarios.agent_trajectories`), tree-sampled (responses from a branching schedule, `scenarios.tree_sampled`).

Figures per (scenario configuration, method):
    logical tokens: sum of rollout lengths; physical: positions the method runs through the decoder (padded
        includes its pads); token_ratio = logical / physical.
    flops: `flops.Work.flops` (formula in `flops.FORMULA`); flop_ratio = naive flops / the method's flops, the
        speedup its FLOPs allow.
    seconds: wall time of one forward + backward (the minimum over --repeats), after a warm-up of every method.
    peak_bytes: peak memory above the start of the run (`measure`).
    max_rel_grad_err: `reference.max_rel_grad_err` against naive.

Estimates. A naive run whose projected time exceeds `max_seconds` stops after a sample of its first k rollouts
(at least 2, or a quarter of the budget); its time is the sample's, scaled by FLOPs(all) / FLOPs(sample), and the
row says `"estimated": true, "sample_rollouts": k`. The gradient reference is then naive on those k rollouts,
and every method's error is computed on the same k rollouts (an extra, untimed run; `grad_err_rollouts: k`).
Padded and prompt-sharing are run on a sample of their first k rollouts, the time scaled the same way and the peak
by the memory model (`baselines.*_peak_bytes`), when the full batch is estimated to exceed `max_memory_bytes` or
its time, projected from naive's seconds per FLOP, exceeds `max_seconds`; when not even one rollout fits, the row is
`"skipped"` with the estimated peak.

Peak memory: on CUDA, torch.cuda.max_memory_allocated (bytes above the allocation at the start); on CPU, the peak
of the process's resident set size above its value at the start, sampled every millisecond by a thread (an upper
bound on what the method allocated; memory the allocator keeps from an earlier phase can hide part of it).
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import threading
import time
from dataclasses import asdict, dataclass, field

import torch

from . import flops as F
from .baselines import (PROMPT_SHARING_LABELS, padded_backward, padded_peak_bytes, prefix_grouper_version,
                        prompt_sharing_backward, prompt_sharing_peak_bytes)
from .engine import replay_backward
from .losses import GRPOLoss
from .models import tiny_model
from .reference import max_rel_grad_err, naive_backward
from .scenarios import agent_trajectories, make_rollouts, shared_prompt, tree_sampled
from .tree import Rollout, RolloutTree

BENCH_MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=688, vocab_size=2048, max_position_embeddings=65_536)
MODEL_LABEL = "tiny llama: hidden 256, 4 layers, 4 heads (2 KV), MLP 688, vocab 2048"

METHODS = ("naive", "padded", "prompt-sharing", "branchreplay")
SCENARIOS = ("shared-prompt", "multi-turn", "tree-sampled")
DEFAULT_PROMPT_TOKENS = {"shared-prompt": 2048, "multi-turn": 512, "tree-sampled": 1024}


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


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (bytes), or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def tree_build_seconds(rollouts: int = 64, tokens: int = 32_768, vocab: int = 50_000) -> float:
    """Seconds to build the tree of `rollouts` sequences of `tokens` tokens sharing a prompt of tokens - 768."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (tokens - 768,), generator=g)
    rs = [Rollout(torch.cat([prompt, torch.randint(0, vocab, (768,), generator=g)])) for _ in range(rollouts)]
    t0 = time.perf_counter()
    RolloutTree(rs)
    return time.perf_counter() - t0


# -----------------------------------------------------------------------------
# scenarios

@dataclass(frozen=True)
class Scenario:
    """One benchmark configuration. Sizes in tokens; the fields a scenario does not use are None.

    shared-prompt: prompt_tokens, generations, response_tokens.
    multi-turn: prompt_tokens, turns, reply_tokens, tool_tokens, branching (see `scenarios.agent_trajectories`).
    tree-sampled: prompt_tokens, response_tokens, fork_schedule ((depth, fan-out), ...; `scenarios.tree_sampled`).
    """

    name: str
    prompt_tokens: int
    generations: int | None = None
    response_tokens: int | None = None
    turns: int | None = None
    reply_tokens: int | None = None
    tool_tokens: int | None = None
    branching: tuple[int, ...] | None = None
    fork_schedule: tuple[tuple[int, int], ...] | None = None

    def sequences(self, vocab: int, g: torch.Generator):
        if self.name == "shared-prompt":
            return shared_prompt(self.prompt_tokens, self.generations, self.response_tokens, vocab, g)
        if self.name == "multi-turn":
            return agent_trajectories(self.prompt_tokens, self.turns, self.reply_tokens, self.tool_tokens,
                                      self.branching, vocab, g)
        return tree_sampled(self.prompt_tokens, self.response_tokens, self.fork_schedule, vocab, g)

    def params(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "name"}

    def label(self) -> str:
        if self.name == "shared-prompt":
            return f"P={self.prompt_tokens} G={self.generations} R={self.response_tokens}"
        if self.name == "multi-turn":
            b = ",".join(map(str, self.branching))
            return (f"P={self.prompt_tokens} turns={self.turns} reply={self.reply_tokens} "
                    f"tool={self.tool_tokens} fork={b}")
        forks = ",".join(f"{f}@{d}" for d, f in self.fork_schedule)
        return f"P={self.prompt_tokens} R={self.response_tokens} fork={forks}"


def scenario_grid(names=("shared-prompt",), prompt_tokens=None, generations=(8,), response_tokens=(128,),
                  turns=(4,), reply_tokens: int = 96, tool_tokens: int = 64, branching=(2, 1, 3),
                  fork_schedule=((0, 2), (32, 4))) -> list[Scenario]:
    """Every combination of the listed sizes, per scenario: shared-prompt over prompt_tokens x generations x
    response_tokens, multi-turn over prompt_tokens x turns, tree-sampled over prompt_tokens x response_tokens.
    prompt_tokens None: each scenario's default (DEFAULT_PROMPT_TOKENS)."""
    out = []
    for name in names:
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
        ps = prompt_tokens or (DEFAULT_PROMPT_TOKENS[name],)
        if name == "shared-prompt":
            out += [Scenario(name, P, generations=G, response_tokens=R)
                    for P, G, R in itertools.product(ps, generations, response_tokens)]
        elif name == "multi-turn":
            out += [Scenario(name, P, turns=t, reply_tokens=reply_tokens, tool_tokens=tool_tokens,
                             branching=tuple(branching)) for P, t in itertools.product(ps, turns)]
        else:
            sched = tuple(tuple(x) for x in fork_schedule)
            for P, R in itertools.product(ps, response_tokens):
                if max(d for d, _ in sched) >= R:
                    raise ValueError(f"tree-sampled: fork depths {sched} must be below --response-tokens {R}")
                out.append(Scenario(name, P, response_tokens=R, fork_schedule=sched))
    return out


# -----------------------------------------------------------------------------
# the benchmark

@dataclass
class BenchOptions:
    """How `run_bench` runs.

    methods: which of METHODS to run; naive always runs (it is the reference and the speedup's denominator).
    max_seconds: longest full run of naive, padded or prompt-sharing (seconds); longer ones are estimated from a
        sample of their rollouts (module docstring). CLI: --max-naive-seconds.
    max_memory_bytes: padded and prompt-sharing runs estimated to peak above this are sampled or skipped;
        None: 60% of MemAvailable at the start.
    prompt_sharing: "auto" (prefix-grouper when installed, else the equivalent), "prefix-grouper", "equivalent".
    repeats: timed runs of each full-size method; the minimum time and the maximum peak are kept.
    threads: torch intra-op threads for the run (restored after); None leaves torch's setting. On a machine whose
        cores are oversubscribed, 1 thread can be many times faster than 2 (OpenMP workers wait on each other).
    """

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    methods: tuple[str, ...] = METHODS
    max_seconds: float = 120.0
    max_memory_bytes: int | None = None
    prompt_sharing: str = "auto"
    repeats: int = 1
    threads: int | None = None

    def __post_init__(self):
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
        if self.prompt_sharing not in ("auto", *PROMPT_SHARING_LABELS):
            raise ValueError(f"prompt_sharing must be auto, prefix-grouper or equivalent, got {self.prompt_sharing!r}")
        if self.max_seconds <= 0 or self.repeats < 1 or (self.threads is not None and self.threads < 1):
            raise ValueError("max_seconds must be > 0, repeats >= 1 and threads >= 1")


@dataclass
class _Run:
    """One method's timed run: on the first `k` rollouts (all, unless estimated)."""

    seconds: float | None
    peak_bytes: int | None
    k: int
    grads: list[torch.Tensor] | None = None
    estimated: bool = False
    peak_estimated: bool = False
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)
    engine: dict | None = None  # branchreplay: what the engine reports about its run (packs replayed, ...)


class Bench:
    """The model, loss and options shared by every configuration of one `run_bench`."""

    def __init__(self, options: BenchOptions):
        self.o = options
        self.device = torch.device(options.device)
        self.model = tiny_model("llama", dtype=options.dtype, seed=options.seed, **BENCH_MODEL).to(self.device)
        self.shape = F.ModelShape.of(self.model)
        self.loss = GRPOLoss()
        self.max_bytes = options.max_memory_bytes or int(0.6 * (available_memory_bytes() or 2**62))
        impl = options.prompt_sharing
        if impl == "auto":
            impl = "prefix-grouper" if prefix_grouper_version() else "equivalent"
        elif impl == "prefix-grouper" and not prefix_grouper_version():
            raise ImportError("prompt_sharing='prefix-grouper' needs the PyPI package: pip install prefix-grouper")
        self.ps_impl = impl
        self.ps_label = PROMPT_SHARING_LABELS[impl].format(version=prefix_grouper_version())
        self.methods = ("naive",) + tuple(m for m in METHODS[1:] if m in options.methods)

    # -- methods -----------------------------------------------------------------------------------------------

    def call(self, method: str, rollouts: list[Rollout]):
        """Zero the gradients, then one forward + backward of `method` on `rollouts`; returns its result."""
        self.model.zero_grad(set_to_none=True)
        if method == "naive":
            return naive_backward(self.model, rollouts, self.loss)
        if method == "padded":
            return padded_backward(self.model, rollouts, self.loss)
        if method == "prompt-sharing":
            return prompt_sharing_backward(self.model, rollouts, self.loss, impl=self.ps_impl)
        return replay_backward(self.model, RolloutTree(rollouts), self.loss)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                for p in self.model.parameters()]

    def work(self, method: str, rollouts: list[Rollout]) -> F.Work:
        if method == "naive":
            return F.naive_work(rollouts)
        if method == "padded":
            return F.padded_work(rollouts)
        if method == "prompt-sharing":
            return F.prompt_sharing_work(rollouts)
        return F.tree_work(RolloutTree(rollouts))

    def peak_model(self, method: str, rollouts: list[Rollout]) -> int | None:
        if method == "padded":
            return padded_peak_bytes(rollouts, self.model.config, self.o.dtype)
        if method == "prompt-sharing":
            return prompt_sharing_peak_bytes(rollouts, self.model.config, self.o.dtype)
        return None

    def warm_up(self) -> None:
        """One call of every method on a small rollout set: the first call of a method is about 2x slower."""
        g = torch.Generator().manual_seed(self.o.seed + 1)
        rollouts = make_rollouts(shared_prompt(64, 2, 16, self.model.config.vocab_size, g), g)
        for method in self.methods:
            self.call(method, rollouts)

    # -- timed runs --------------------------------------------------------------------------------------------

    def run_full(self, method: str, rollouts: list[Rollout]) -> _Run:
        best, result = None, []
        for _ in range(self.o.repeats):
            m = measure(lambda: result.append(self.call(method, rollouts)), self.device)
            best = m if best is None else Measured(min(best.seconds, m.seconds), max(best.peak_bytes, m.peak_bytes))
        engine = None
        if method == "branchreplay":
            engine = {k: getattr(result[-1], k) for k in ("replayed_packs", "predicted_peak_bytes")
                      if hasattr(result[-1], k)}
        return _Run(best.seconds, best.peak_bytes, len(rollouts), self.grads(), engine=engine)

    def run_naive(self, rollouts: list[Rollout], total_flops: int) -> _Run:
        """Naive, rollout by rollout; stops early (estimated) once its projected time exceeds max_seconds."""
        state = {"k": 0, "flops": 0}
        limit = self.o.max_seconds

        def fn():
            self.model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            for r in rollouts:
                naive_backward(self.model, [r], self.loss)
                state["k"] += 1
                state["flops"] += F.naive_work([r]).flops(self.shape)
                elapsed = time.perf_counter() - t0
                projected = elapsed * total_flops / state["flops"]
                if state["k"] < len(rollouts) and projected > limit and (state["k"] >= 2 or elapsed >= limit / 4):
                    break

        m = measure(fn, self.device)
        k = state["k"]
        if k == len(rollouts):
            run = _Run(m.seconds, m.peak_bytes, k, self.grads())
            if self.o.repeats > 1:
                again = self.run_full("naive", rollouts)
                run = _Run(min(run.seconds, again.seconds), max(run.peak_bytes, again.peak_bytes), k, again.grads)
            return run
        return _Run(m.seconds * total_flops / state["flops"], m.peak_bytes, k, self.grads(), estimated=True,
                    notes=[f"time estimated from the first {k} of {len(rollouts)} rollouts ({m.seconds:.1f} s), "
                           "scaled by FLOPs; peak is the sample's"])

    def run_batched(self, method: str, rollouts: list[Rollout], total_flops: int, seconds_per_flop: float) -> _Run:
        """Padded or prompt-sharing: full if it fits in memory and time, else on its largest fitting first k."""
        n = len(rollouts)

        def fits(k: int) -> bool:  # in memory, and in time (a sample of one rollout always runs if it fits)
            sample = rollouts[:k]
            est_s = self.work(method, sample).flops(self.shape) * seconds_per_flop
            in_time = k == 1 or est_s <= self.o.max_seconds * (1.0 if k == n else 0.5)
            return self.peak_model(method, sample) <= self.max_bytes and in_time

        if fits(n):
            return self.run_full(method, rollouts)
        lo, hi = 0, n - 1  # largest k in [0, n - 1] that fits (fits is monotone in k)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        full_peak = self.peak_model(method, rollouts)
        why = (f"estimated peak {full_peak / 2**30:.1f} GiB > limit {self.max_bytes / 2**30:.1f} GiB"
               if full_peak > self.max_bytes else
               f"projected time {total_flops * seconds_per_flop:.0f} s > {self.o.max_seconds:.0f} s")
        if lo == 0:
            return _Run(None, full_peak, 0, skipped=f"skipped: {why}, even for one rollout", peak_estimated=True)
        sample = rollouts[:lo]
        m = measure(lambda: self.call(method, sample), self.device)
        scale_t = total_flops / self.work(method, sample).flops(self.shape)
        scale_m = full_peak / self.peak_model(method, sample)
        return _Run(m.seconds * scale_t, int(m.peak_bytes * scale_m), lo, self.grads(), estimated=True,
                    peak_estimated=True,
                    notes=[f"{why}: ran the first {lo} of {n} rollouts ({m.seconds:.1f} s), time scaled by FLOPs, "
                           "peak by the memory model"])

    def grad_err(self, method: str, run: _Run, rollouts: list[Rollout], ref: list[torch.Tensor], ref_k: int):
        """Error of `method` against naive on the first ref_k rollouts (re-running it untimed there if its timed run
        covered a different set); None when that does not fit."""
        if method == "naive":
            return 0.0
        if run.grads is not None and run.k == ref_k:
            return max_rel_grad_err(run.grads, ref)
        sample = rollouts[:ref_k]
        peak = self.peak_model(method, sample)
        if peak is not None and peak > self.max_bytes:
            run.notes.append(f"gradient not checked: the {ref_k}-rollout reference set does not fit")
            return None
        self.call(method, sample)
        return max_rel_grad_err(self.grads(), ref)

    # -- one configuration ----------------------------------------------------------------------------------------

    def config(self, scenario: Scenario, log=None) -> list[dict]:
        g = torch.Generator().manual_seed(self.o.seed)
        rollouts = make_rollouts(scenario.sequences(self.model.config.vocab_size, g), g)
        stats = RolloutTree(rollouts).stats
        works = {m: self.work(m, rollouts) for m in self.methods}
        flops = {m: w.flops(self.shape) for m, w in works.items()}
        runs: dict[str, _Run] = {}
        for method in self.methods:
            if log:
                log(f"{scenario.name} {scenario.label()}: {method} ...")
            if method == "naive":
                runs[method] = self.run_naive(rollouts, flops["naive"])
            elif method == "branchreplay":
                runs[method] = self.run_full(method, rollouts)
            else:
                naive = runs["naive"]
                seconds_per_flop = naive.seconds / flops["naive"]
                runs[method] = self.run_batched(method, rollouts, flops[method], seconds_per_flop)
            run = runs[method]
            if log:
                log(f"  {method}: " + (run.skipped or f"{run.seconds:.1f} s{' (estimated)' if run.estimated else ''}, "
                                       f"peak {run.peak_bytes / 2**20:.0f} MiB"))
        ref, ref_k = runs["naive"].grads, runs["naive"].k
        rows = []
        for method in self.methods:
            run = runs[method]
            err = None if run.skipped else self.grad_err(method, run, rollouts, ref, ref_k)
            w = works[method]
            naive_s = runs["naive"].seconds
            speedup = naive_s / run.seconds if run.seconds else None
            flop_ratio = flops["naive"] / flops[method]
            rows.append({
                "scenario": scenario.name,
                "config": scenario.params(),
                "label": scenario.label(),
                "method": method,
                "method_label": self.ps_label if method == "prompt-sharing" else method,
                "rollouts": len(rollouts),
                "tree_nodes": stats.nodes,
                "tree_depth": stats.depth,
                "logical_tokens": stats.logical_tokens,
                "physical_tokens": w.positions,
                "token_ratio": stats.logical_tokens / w.positions,
                "attention_keys": w.attention_keys,
                "head_rows": w.head_rows,
                "flops": flops[method],
                "flop_ratio": flop_ratio,
                "seconds": run.seconds,
                "speedup": speedup,
                "speedup_of_flop_limit": speedup / flop_ratio if speedup else None,
                "peak_bytes": run.peak_bytes,
                "max_rel_grad_err": err,
                "grad_err_rollouts": ref_k if err is not None else None,
                "estimated": run.estimated,
                "peak_estimated": run.peak_estimated,
                "sample_rollouts": run.k if run.estimated else None,
                "skipped": run.skipped,
                "notes": run.notes,
                "engine": run.engine,
            })
            self.model.zero_grad(set_to_none=True)
        return rows


def run_bench(scenarios: list[Scenario], options: BenchOptions = BenchOptions(), log=None) -> dict:
    """Every method of `options` on every scenario configuration, after one warm-up. Returns one dict:
    run-wide fields and `rows`, one per (configuration, method) (keys in the module docstring and `Bench.config`).
    For a single shared-prompt configuration it also carries the summary keys of earlier versions: logical_tokens,
    physical_tokens (the tree's), token_ratio, naive_s, replay_s, speedup, naive_peak_bytes, replay_peak_bytes,
    max_rel_grad_err (branchreplay's), prompt_tokens, generations, response_tokens."""
    threads = torch.get_num_threads()
    if options.threads:
        torch.set_num_threads(options.threads)
    try:
        bench = Bench(options)
        bench.warm_up()
        rows = []
        for scenario in scenarios:
            rows += bench.config(scenario, log)
        out = _result(options, bench, rows)
    finally:
        torch.set_num_threads(threads)
    if len(scenarios) == 1 and scenarios[0].name == "shared-prompt":
        out.update(_summary(scenarios[0], rows))
    return out


def _result(options: BenchOptions, bench: Bench, rows: list[dict]) -> dict:
    return {
        "model": MODEL_LABEL,
        "dtype": str(options.dtype).replace("torch.", ""),
        "device": str(bench.device),
        "threads": torch.get_num_threads(),
        "flop_formula": F.FORMULA,
        "n_params_nonembedding": bench.shape.n_params,
        "prompt_sharing": bench.ps_label,
        "prompt_sharing_impl": bench.ps_impl,
        "max_seconds": options.max_seconds,
        "max_memory_bytes": bench.max_bytes,
        "repeats": options.repeats,
        "rows": rows,
        "tree_build_s_64x32k": tree_build_seconds(),
    }


def _summary(scenario: Scenario, rows: list[dict]) -> dict:
    by = {r["method"]: r for r in rows}
    naive, replay = by["naive"], by.get("branchreplay")
    out = {
        "scenario": scenario.name,
        "prompt_tokens": scenario.prompt_tokens,
        "generations": scenario.generations,
        "response_tokens": scenario.response_tokens,
        "logical_tokens": naive["logical_tokens"],
        "naive_s": naive["seconds"],
        "naive_peak_bytes": naive["peak_bytes"],
        "naive_estimated": naive["estimated"],
    }
    if replay:
        out.update({
            "physical_tokens": replay["physical_tokens"],
            "token_ratio": replay["token_ratio"],
            "replay_s": replay["seconds"],
            "speedup": replay["speedup"],
            "replay_peak_bytes": replay["peak_bytes"],
            "max_rel_grad_err": replay["max_rel_grad_err"],
        })
    return out


def bench_shared_prompt(prompt_tokens: int = 2048, generations: int = 8, response_tokens: int = 128,
                        dtype=torch.float32, device: str = "cpu", seed: int = 0) -> dict:
    """Naive vs replay on one shared-prompt configuration (the summary keys of `run_bench`)."""
    scenario = Scenario("shared-prompt", prompt_tokens, generations=generations, response_tokens=response_tokens)
    options = BenchOptions(dtype=dtype, device=device, seed=seed, methods=("naive", "branchreplay"))
    return run_bench([scenario], options)


# -----------------------------------------------------------------------------
# output

def merge_results(results: list[dict]) -> dict:
    """One result from several `--json` outputs (e.g. runs of a sweep made one at a time): the rows concatenated,
    the run-wide fields of the first. Raises ValueError when they were measured on a different model, dtype,
    device or thread count, whose rows would not be comparable."""
    keys = ("model", "dtype", "device", "threads")
    for r in results[1:]:
        diff = [k for k in keys if r.get(k) != results[0].get(k)]
        if diff:
            raise ValueError(f"cannot merge bench results measured with different {', '.join(diff)}: "
                             f"{[r.get(k) for k in diff]} vs {[results[0].get(k) for k in diff]}")
    return {**results[0], "rows": [row for r in results for row in r["rows"]]}


def format_table(result: dict) -> str:
    """The rows as a table for people, with the run-wide facts above and the notes below."""
    lines = [f"{result['model']}, {result['dtype']}, {result['device']}, {result['threads']} threads; "
             f"prompt-sharing = {result['prompt_sharing']}",
             f"FLOPs (fwd+bwd) = {result['flop_formula']}; N_nonembedding = {result['n_params_nonembedding']:,}",
             "speedup = naive time / method time; of-limit = speedup / flop-ratio; grad err = max relative error "
             "against naive; * = estimated from a sample (see notes)", ""]
    w = max([len(r["label"]) for r in result["rows"]] + [6]) + 2
    head = (f"{'scenario':<14}{'config':<{w}}{'method':<15}{'logical':>9}{'physical':>10}{'tok-ratio':>10}"
            f"{'GFLOP':>9}{'flop-ratio':>11}{'time s':>10}{'speedup':>9}{'of-limit':>9}{'peak MiB':>10}"
            f"{'grad err':>10}")
    lines += [head, "-" * len(head)]
    notes = []
    for r in result["rows"]:
        star = "*" if r["estimated"] else " "
        t = f"{r['seconds']:.2f}{star}" if r["seconds"] is not None else "skipped"
        sp = f"{r['speedup']:.2f}" if r["speedup"] else "-"
        lim = f"{r['speedup_of_flop_limit']:.2f}" if r["speedup_of_flop_limit"] else "-"
        peak = f"{r['peak_bytes'] / 2**20:.0f}{'*' if r['peak_estimated'] else ' '}" if r["peak_bytes"] is not None \
            else "-"
        err = f"{r['max_rel_grad_err']:.1e}" if r["max_rel_grad_err"] is not None else "-"
        if r["grad_err_rollouts"] is not None and r["grad_err_rollouts"] < r["rollouts"]:
            err += f"@{r['grad_err_rollouts']}"
        lines.append(f"{r['scenario']:<14}{r['label']:<{w}}{r['method']:<15}{r['logical_tokens']:>9}"
                     f"{r['physical_tokens']:>10}{r['token_ratio']:>10.2f}{r['flops'] / 1e9:>9.1f}"
                     f"{r['flop_ratio']:>11.2f}{t:>10}{sp:>9}{lim:>9}{peak:>10}{err:>10}")
        for note in ([r["skipped"]] if r["skipped"] else []) + r["notes"]:
            notes.append(f"  {r['scenario']} {r['label']} {r['method']}: {note}")
    if any(r["grad_err_rollouts"] is not None and r["grad_err_rollouts"] < r["rollouts"] for r in result["rows"]):
        notes.append("  grad err@k: computed on the first k rollouts (naive was estimated from that sample)")
    lines += ([""] + ["notes:"] + notes) if notes else []
    lines.append(f"tree build alone, a fixed case of 64 rollouts x 32k tokens (not this run's tree): "
                 f"{result['tree_build_s_64x32k'] * 1000:.0f} ms")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Two panels to `path` (PNG, matplotlib Agg): speedup vs FLOP ratio (with the line speedup = FLOP ratio),
    and peak memory vs logical tokens, one line per method (markers by scenario)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = dict(zip(SCENARIOS, "osD"))
    colors = dict(zip(METHODS, ("tab:gray", "tab:orange", "tab:blue", "tab:green")))
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    rows = [r for r in result["rows"] if r["seconds"] is not None]
    for method in METHODS:
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["logical_tokens"])
        if not mine:
            continue
        label = f"prompt-sharing ({result['prompt_sharing_impl']})" if method == "prompt-sharing" else method
        for r in mine:
            a.scatter(r["flop_ratio"], r["speedup"], color=colors[method], marker=markers[r["scenario"]],
                      facecolors="none" if r["estimated"] else colors[method])
        a.scatter([], [], color=colors[method], label=label)
        b.plot([r["logical_tokens"] for r in mine], [r["peak_bytes"] / 2**20 for r in mine], color=colors[method],
               label=label)
        for r in mine:
            b.scatter(r["logical_tokens"], r["peak_bytes"] / 2**20, color=colors[method],
                      marker=markers[r["scenario"]], facecolors="none" if r["peak_estimated"] else colors[method])
    top = max([r["flop_ratio"] for r in rows] + [r["speedup"] or 1 for r in rows] + [1.0])
    a.plot([1, top], [1, top], "k--", lw=0.8, label="speedup = FLOP ratio")
    for name, m in markers.items():
        if any(r["scenario"] == name for r in rows):
            a.scatter([], [], color="k", marker=m, label=name)
    a.set(xlabel="FLOP ratio (naive FLOPs / method FLOPs)", ylabel="speedup over naive (wall time)",
          title="speedup vs FLOP ratio (hollow: estimated)")
    a.legend(fontsize=7, loc="upper left")
    b.set(xlabel="logical tokens", ylabel="peak memory (MiB)", xscale="log", yscale="log",
          title="peak memory vs logical tokens (hollow: estimated)")
    b.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"branchreplay bench: {result['model']}, {result['dtype']}, {result['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
