"""`branchreplay bench`: four exact ways to compute the same GRPO gradient, side by side in one process, on the same
model (tiny Llama, `BENCH_MODEL`) and rollouts: naive (each rollout alone: the reference), padded (TRL's padded
batch) and prompt-sharing (Prefix Grouper), looked up in `reference.methods.METHODS`, and branchreplay
(`engine.replay_backward`), on the scenarios of `Scenario`.

Figures per (scenario configuration, method): logical and physical tokens and their ratio; flops (`reference.work`) and
flop_ratio (naive's / the method's); seconds, the best forward + backward of --repeats rounds after a warm-up,
interleaved across the methods so that a machine's drift moves them alike; peak_bytes (`measure`); max_rel_grad_err
against naive. Estimates: a naive run projected past `max_seconds` stops after a sample of its first k rollouts,
its time scaled by FLOPs(all) / FLOPs(sample) and every method's error taken on those k rollouts; padded and
prompt-sharing are sampled likewise when projected past `max_memory_bytes` or `max_seconds` (peak by
`reference.memory`), or "skipped" when no rollout fits. Such rows say `"estimated": true, "sample_rollouts": k`.
How to read its figures: docs/benchmarks.md ("Reading the tables").
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from ..engine import replay_backward
from ..engine.planner import available_memory_bytes
from ..losses import GRPOLoss
from ..models import load_model
from ..reference import work as F
from ..reference.methods import METHODS as REFERENCES
from ..reference.naive import max_rel_grad_err, naive_backward
from ..reference.prompt_sharing import PROMPT_SHARING_LABELS, prefix_grouper_version, prompt_groups
from ..reference.shapes import make_rollouts, shared_prompt
from ..tiny_models import tiny_model
from ..tree import Rollout, RolloutTree, forests
from .measure import measure, tree_build_seconds
from .scenarios import Scenario, recorded_items

BENCH_MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=688, vocab_size=2048, max_position_embeddings=65_536)
MODEL_LABEL = "tiny llama: hidden 256, 4 layers, 4 heads (2 KV), MLP 688, vocab 2048"

METHODS = ("naive", "padded", "prompt-sharing", "branchreplay")


@dataclass
class BenchOptions:
    """How `run_bench` runs.

    methods: which of METHODS to run; naive always runs (it is the reference and the speedup's denominator).
    max_seconds: longest full run of naive, padded or prompt-sharing (seconds); longer ones are estimated from a
        sample of their rollouts (module docstring). CLI: --max-naive-seconds.
    max_memory_bytes: padded and prompt-sharing runs estimated to peak above this are sampled or skipped;
        None: 60% of the device's available memory at the start (`engine.planner.available_memory_bytes`).
    prompt_sharing: "auto" (prefix-grouper when installed, else the equivalent), "prefix-grouper", "equivalent".
    repeats: timed runs of each full-size method, interleaved round by round across the methods; the minimum time
        is kept, and the peak of the first round (the only one that samples memory). An estimated run is timed
        once, with the sampler (its row's notes say so).
    threads: torch intra-op threads for the run (restored after); None leaves torch's setting. On a machine whose
        cores are oversubscribed, 1 thread can be many times faster than 2 (OpenMP workers wait on each other).
    model: a model spec (`models.load_model`, e.g. "smollm2") instead of the tiny bench model; the synthetic
        scenarios draw ids in its vocabulary, recorded trajectories must come from its tokenizer.
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
    model: str | None = None

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
        if options.model is None:
            self.model = tiny_model("llama", dtype=options.dtype, seed=options.seed, **BENCH_MODEL)
            self.label = MODEL_LABEL
        else:
            self.model = load_model(options.model, dtype=options.dtype)[0]
            self.label = options.model
        self.model = self.model.to(self.device)
        self.shape = F.ModelShape.of(self.model)
        self.loss = GRPOLoss()
        self.max_bytes = options.max_memory_bytes or int(0.6 * (available_memory_bytes(self.device) or 2**62))
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
        if method == "branchreplay":
            return replay_backward(self.model, trees_of(rollouts), self.loss)
        options = {"impl": self.ps_impl} if method == "prompt-sharing" else {}
        return REFERENCES[method].backward(self.model, rollouts, self.loss, **options)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                for p in self.model.parameters()]

    def work(self, method: str, rollouts: list[Rollout]) -> F.Work:
        if method == "branchreplay":
            return sum((F.tree_work(t) for t in trees_of(rollouts)), F.NOTHING)
        return REFERENCES[method].work(rollouts)

    def peak_model(self, method: str, rollouts: list[Rollout]) -> int | None:
        peak_bytes = REFERENCES[method].peak_bytes if method in REFERENCES else None
        return None if peak_bytes is None else peak_bytes(rollouts, self.model.config, self.o.dtype)

    def warm_up(self) -> None:
        """One call of every method on a small rollout set: the first call of a method is slower (allocator,
        kernels). Then one branch replay of a 4096-position tree: the engine fits its memory model once per model and
        scale (a tree of 4096 positions or more probes at scale 256, `planner.memory_model`), which a training run
        pays once, not in every timed step."""
        g = torch.Generator().manual_seed(self.o.seed + 1)
        rollouts = make_rollouts(shared_prompt(64, 2, 16, self.model.config.vocab_size, g), g)
        for method in self.methods:
            self.call(method, rollouts)
        if "branchreplay" in self.methods:
            self.call("branchreplay", make_rollouts(shared_prompt(4094, 2, 1, self.model.config.vocab_size, g), g))

    # -- timed runs --------------------------------------------------------------------------------------------

    def run_full(self, method: str, rollouts: list[Rollout]) -> _Run:
        """One timed run of `method` on every rollout (the repeats come later: `repeat`)."""
        result = []
        m = measure(lambda: result.append(self.call(method, rollouts)), self.device)
        engine = None
        if method == "branchreplay":
            engine = {k: getattr(result[-1], k) for k in ("replayed_packs", "predicted_peak_bytes", "schedule")
                      if hasattr(result[-1], k)}
        return _Run(m.seconds, m.peak_bytes, len(rollouts), self.grads(), engine=engine)

    def repeat(self, runs: dict[str, _Run], rollouts: list[Rollout]) -> None:
        """repeats - 1 more rounds of every method that ran in full, one method after the other within a round,
        timed without the memory sampler; each keeps its minimum time (and the first round's peak)."""
        full = [m for m, run in runs.items() if not run.estimated and not run.skipped]
        for _ in range(self.o.repeats - 1):
            for method in full:
                m = measure(functools.partial(self.call, method, rollouts), self.device, memory=False)
                runs[method].seconds = min(runs[method].seconds, m.seconds)

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
            return _Run(m.seconds, m.peak_bytes, k, self.grads())
        return _Run(m.seconds * total_flops / state["flops"], m.peak_bytes, k, self.grads(), estimated=True,
                    notes=[f"time estimated from the first {k} of {len(rollouts)} rollouts ({m.seconds:.1f} s, one run "
                           "with the memory sampler), scaled by FLOPs; peak is the sample's"])

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
                    notes=[f"{why}: ran the first {lo} of {n} rollouts ({m.seconds:.1f} s, one run with the memory "
                           "sampler), time scaled by FLOPs, peak by the memory model"])

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
        if scenario.trajectories is not None:  # one group per recorded item, as the trainer's
            for r, item in zip(rollouts, recorded_items(scenario.trajectories), strict=True):
                r.group = item
        trees = trees_of(rollouts)
        stats = sum((t.stats for t in trees[1:]), trees[0].stats)
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
        self.repeat(runs, rollouts)
        for method, run in runs.items():
            if log:
                log(f"  {method}: " + (run.skipped or f"{run.seconds:.2f} s{' (estimated)' if run.estimated else ''}, "
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


def trees_of(rollouts: list[Rollout]) -> list[RolloutTree]:
    """The trees the engine runs, as for a trainer's step: one per group (by `Rollout.group` when every rollout has
    one, recorded trajectories: their item; else per distinct prompt, `prompt_sharing.prompt_groups`), then the groups
    that share a start as one forest (`tree.forests`: items that open with the same messages share them)."""
    if all(r.group is not None for r in rollouts):
        groups: dict = {}
        for r in rollouts:
            groups.setdefault(r.group, []).append(r)
        return forests([RolloutTree(members) for members in groups.values()])
    return forests([RolloutTree([rollouts[i] for i in members]) for _, members in prompt_groups(rollouts)])


def run_bench(scenarios: list[Scenario], options: BenchOptions | None = None, log=None) -> dict:
    """Every method of `options` on every scenario configuration, after one warm-up. Returns one dict:
    run-wide fields and `rows`, one per (configuration, method) (keys in the module docstring and `Bench.config`)."""
    options = BenchOptions() if options is None else options
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
    return out


def _result(options: BenchOptions, bench: Bench, rows: list[dict]) -> dict:
    return {
        "model": bench.label,
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
