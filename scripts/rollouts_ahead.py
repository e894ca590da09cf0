"""Rollouts drawn ahead (grpo.max_staleness 1) against the synchronous loop, side by side in one run
(docs/rollouts_ahead.md, "What it buys" and "Convergence: synchronous against one step ahead";
docs/benchmarks.md, "Rollouts one step ahead").

What overlap buys where generation and training have devices of their own (verl's split pools), on this 2-core
machine: each workload runs three ways, each in a fresh process, one after another:

    sync-1-core     the synchronous loop, one thread pinned to core 0 (the pinning each side has below)
    ahead           the trainer, one thread on core 0; its sampler process, one thread on core 1
    sync-2-cores    the synchronous loop, two threads on both cores (each phase has the whole machine)

A step's time is the trainer's critical path (time/step_s: waiting for the batch, then training it); the first
step of `ahead` waits for a whole draw, as a synchronous step samples. Evaluation is off. Prints and writes, per
workload and way, the seconds of every step and the ratios (total of steps 1..N, and steady steps 2..N).

    .venv/bin/python scripts/rollouts_ahead.py --steps 5 --out results/rollouts-ahead-2026-12/rollouts-ahead.json
    .venv/bin/python scripts/rollouts_ahead.py --curve 20 --out results/rollouts-ahead-2026-12/curve

--curve N trains configs/demo.yaml N steps synchronously (both cores) and one step ahead (pinned as above) from the
same seed, and writes their metrics and reward curves (metrics.jsonl, reward.png) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = {"demo": "configs/demo.yaml", "agent": "configs/agent.yaml", "guess-number": "configs/guess_number.yaml"}
WAYS = {  # (grpo.max_staleness, the trainer's cores, the sampler process's cores, threads each)
    "sync-1-core": (0, {0}, None, 1),
    "ahead": (1, {0}, {1}, 1),
    "sync-2-cores": (0, {0, 1}, None, 2),
}


def run_one(config_path: str, way: str, steps: int, out: Path, eval_steps: int = -1) -> list[dict]:
    """Train `config_path` `steps` steps the `way` way in this process; returns its metrics rows."""
    ahead, cores, sampler_cores, threads = WAYS[way]
    os.sched_setaffinity(0, cores)
    import torch

    torch.set_num_threads(threads)
    from branchreplay.rl.config import Config
    from branchreplay.rl.run.trainer import Trainer

    config = Config.from_yaml(config_path, [f"--train.steps={steps}", f"--train.eval_steps={eval_steps}",
                                            f"--train.output_dir={out}", "--train.save_steps=0",
                                            f"--grpo.max_staleness={ahead}", "--train.report_to=none"])
    trainer = Trainer(config)
    if sampler_cores is not None:
        os.sched_setaffinity(trainer.source.process.process.pid, sampler_cores)
    run = trainer.fit()
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def child(args) -> None:
    """One (workload, way) in this process; its rows to --rows."""
    rows = run_one(WORKLOADS.get(args.workload, args.workload), args.way, args.steps, Path(args.run),
                   args.eval_steps)
    Path(args.rows).write_text(json.dumps(rows))


def spawn(workload: str, way: str, steps: int, eval_steps: int = -1) -> list[dict]:
    """(workload, way) in a fresh process: its metrics rows."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.json"
        subprocess.run([sys.executable, __file__, "--child", "--workload", workload, "--way", way, "--steps",
                        str(steps), "--eval-steps", str(eval_steps), "--run", str(Path(tmp) / "run"), "--rows",
                        str(rows)], check=True)
        return json.loads(rows.read_text())


def compare(steps: int, out: Path) -> None:
    """Every workload every way; prints the table and writes it with the raw step times."""
    load = os.getloadavg()
    results = {}
    for workload in WORKLOADS:
        for way in WAYS:
            began = time.perf_counter()
            rows = [r for r in spawn(workload, way, steps) if r.get("step", 0) >= 1]
            results[(workload, way)] = {"step_s": [r["time/step_s"] for r in rows],
                                        "sample_wait_s": [r["time/sample_s"] for r in rows],
                                        "train_s": [r["time/train_s"] for r in rows],
                                        "reward": [r.get("reward") for r in rows],
                                        "process_s": time.perf_counter() - began}
            print(workload, way, [round(s, 2) for s in results[(workload, way)]["step_s"]], flush=True)
    table = []
    for workload in WORKLOADS:
        total = {way: sum(results[(workload, way)]["step_s"]) for way in WAYS}
        steady = {way: sum(results[(workload, way)]["step_s"][1:]) for way in WAYS}
        table.append({"workload": workload, **{f"{way} s": round(total[way], 2) for way in WAYS},
                      "sync-1-core / ahead": round(total["sync-1-core"] / total["ahead"], 3),
                      "sync-2-cores / ahead": round(total["sync-2-cores"] / total["ahead"], 3),
                      "steady sync-1-core / ahead": round(steady["sync-1-core"] / steady["ahead"], 3),
                      "steady sync-2-cores / ahead": round(steady["sync-2-cores"] / steady["ahead"], 3)})
    for row in table:
        print(json.dumps(row))
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; after: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": steps, "load_average_before": load, "table": table,
                               "raw": {f"{w} {way}": r for (w, way), r in results.items()}}, indent=1) + "\n")


def curve(steps: int, out: Path) -> None:
    """configs/demo.yaml `steps` steps synchronously (both cores) and one step ahead (pinned), the same seed."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for way in ("sync-2-cores", "ahead"):
        for r in spawn("demo", way, steps, eval_steps=10):
            rows.append({"way": way, **{k: v for k, v in r.items() if isinstance(v, (int, float, str))}})
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for k, way in enumerate(("sync-2-cores", "ahead")):
        mine = [r for r in rows if r["way"] == way]
        label = "synchronous" if way.startswith("sync") else "one step ahead (grpo.max_staleness 1)"
        trained = [r for r in mine if r["step"] >= 1]
        axes[0].plot([r["step"] for r in trained], [r["reward"] for r in trained], color=f"C{k}", label=label)
        held = [r for r in mine if "eval/accuracy" in r]
        axes[1].plot([r["step"] for r in held], [r["eval/accuracy"] for r in held], "o-", color=f"C{k}", label=label)
        axes[2].plot([r["step"] for r in trained], [r["time/step_s"] for r in trained], color=f"C{k}", label=label)
    for ax, title in zip(axes, ("reward (training batch)", "held-out accuracy", "seconds per step"), strict=True):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.suptitle(f"configs/demo.yaml, seed 0, {steps} steps: synchronous vs one step ahead", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="steps per workload and way")
    ap.add_argument("--curve", type=int, default=0, help="instead: N steps of configs/demo.yaml, both ways")
    ap.add_argument("--out", default="runs/rollouts-ahead.json",
                    help="the JSON file of the step times; with --curve, the folder of metrics.jsonl and reward.png")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--way", help=argparse.SUPPRESS)
    ap.add_argument("--eval-steps", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
    elif args.curve:
        curve(args.curve, Path(args.out))
    else:
        compare(args.steps, Path(args.out))


if __name__ == "__main__":
    main()
