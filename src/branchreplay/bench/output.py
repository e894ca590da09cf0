"""The benchmark's results for people: several `--json` runs merged, a table, and a plot."""

from __future__ import annotations

from .runner import METHODS
from .scenarios import SCENARIOS


def merge_results(results: list[dict]) -> dict:
    """One result from several `--json` outputs (e.g. runs of a sweep made one at a time): the rows concatenated,
    the run-wide fields of the first. Raises ValueError when they were taken on a different model, dtype,
    device or thread count, whose rows would not be comparable."""
    keys = ("model", "dtype", "device", "threads")
    for r in results[1:]:
        diff = [k for k in keys if r.get(k) != results[0].get(k)]
        if diff:
            raise ValueError(f"cannot merge bench results run with different {', '.join(diff)}: "
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


def sweeps(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """The runs of rows (one method's) that differ in exactly one numeric size of one scenario: (the swept config
    key, its rows sorted by it), for each run of at least two rows. Rows of different scenarios, or that differ in
    more than one size or in a schedule, are never on one line."""
    out = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        mine = [r for r in rows if r["scenario"] == scenario]
        keys = sorted({k for r in mine for k in r.get("config", {})})
        for swept in keys:
            lines: dict[tuple, list[dict]] = {}
            for r in mine:
                fixed = tuple((k, str(r.get("config", {}).get(k))) for k in keys if k != swept)
                lines.setdefault(fixed, []).append(r)
            for line in lines.values():
                numeric = all(isinstance(r.get("config", {}).get(swept), (int, float)) for r in line)
                if numeric and len({r.get("config", {})[swept] for r in line}) == len(line) >= 2:
                    out.append((swept, sorted(line, key=lambda r: r.get("config", {})[swept])))
    return out


def plot(result: dict, path: str) -> None:
    """Two panels to `path` (PNG, matplotlib Agg): speedup vs FLOP ratio (with the line speedup = FLOP ratio),
    and peak memory vs logical tokens, points per method (markers by scenario), joined only along one swept size
    of one scenario (`sweeps`), the line labelled with that size's range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = dict(zip(SCENARIOS, "osD", strict=True))
    colors = dict(zip(METHODS, ("tab:gray", "tab:orange", "tab:blue", "tab:green"), strict=True))
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
        b.scatter([], [], color=colors[method], label=label)
        for swept, line in sweeps(mine):  # lines only along one swept size of one scenario, labelled with it
            b.plot([r["logical_tokens"] for r in line], [r["peak_bytes"] / 2**20 for r in line],
                   color=colors[method], lw=1)
            b.annotate(f"{swept} {line[0]['config'][swept]}..{line[-1]['config'][swept]}",
                       (line[-1]["logical_tokens"], line[-1]["peak_bytes"] / 2**20), fontsize=6,
                       color=colors[method], xytext=(3, 0), textcoords="offset points")
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
