"""The hf and vllm sampling backends side by side, per step, on the demo's settings: single-turn, a branching
schedule, multi-turn with the calculator, and LoRA (docs/vllm.md, "hf against vLLM on 2 CPU cores").

    .venv/bin/branchreplay vllm-serve --model smollm2 --lora-rank 16 &      # once, about 2 minutes to start
    .venv/bin/python scripts/vllm_backends.py [--steps 3] [--cases single-turn branching multi-turn lora]

Each case runs `branchreplay train` once per backend, one after the other (nothing else should run: 2 cores), with
evaluation off, and the table gives the mean over the steps of each run's `time/sample_s` (of it the weight sync),
`time/train_s` and `time/step_s` from its metrics.jsonl, and the mean vLLM-vs-run logprob difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = {
    "single-turn": ["--config", "configs/demo.yaml"],
    "branching": ["--config", "configs/demo.yaml", "--sampling.branching", "[[0, 2], [16, 4]]"],
    "multi-turn": ["--config", "configs/agent.yaml"],
    "lora": ["--config", "configs/demo.yaml", "--model.lora_r", "16", "--model.lora_alpha", "32",
             "--grpo.learning_rate", "1e-4"],
}


def run(case: str, backend: str, steps: int, out: Path) -> list[dict]:
    """One `branchreplay train` of `case` with `backend`; its step records."""
    folder = out / f"{case}-{backend}"
    command = [str(Path(sys.executable).parent / "branchreplay"), "train", *CASES[case], "--sampling.backend",
               backend, "--train.steps", str(steps), "--train.eval_steps", "-1", "--train.output_dir", str(folder)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step_s" in r]


def mean(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    return f"{statistics.mean(values):.1f}" if values else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="vllm-backends-"))
    print(f"load average before: {os.getloadavg()[0]:.2f}; runs in {out}")
    print("| case | backend | sampling per step | of it, weight sync | training per step | step | logprob mismatch |")
    print("|---|---|---|---|---|---|---|")
    for case in args.cases:
        for backend in ("hf", "vllm"):
            rows = run(case, backend, args.steps, out)
            diff = [r["sampling/logprob_diff_mean"] for r in rows if "sampling/logprob_diff_mean" in r]
            print(f"| {case} | {backend} | {mean(rows, 'time/sample_s')} s | "
                  f"{mean(rows, 'time/weight_sync_s') if backend == 'vllm' else '-'} s | "
                  f"{mean(rows, 'time/train_s')} s | {mean(rows, 'time/step_s')} s | "
                  f"{f'{max(diff):.0e} nats' if diff else '-'} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
