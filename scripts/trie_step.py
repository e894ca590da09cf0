"""A step before and after a change (issue 31: one trie per step, multi-turn turns in one decoding loop), side by
side: `branchreplay train` from a checkout of the head before it (--before: the root of a git worktree) and from
this one, interleaved (before, after, after, before, ...), on these workloads with evaluation off:

  demo    configs/demo.yaml: the default task's prompts share the system prompt and the few-shot turns
  tools   the demo with a system prompt of tool definitions (about 1,000 tokens of JSON schemas, then the task's
          instruction) shared by every prompt; grpo.entropy_coef 1e-4 so that every group trains
  guess   configs/guess_number.yaml: multi-turn, every game opens with the same rules
  agent   configs/agent.yaml: multi-turn with the calculator tool, turn_branching [2, 4]
  agent-forks  the same with turn_branching [[[0, 2], [16, 2]], 2]: first replies that fork at their 16th token

For each it prints the step's `tree/token_ratio` (logical over physical positions of the step's rollouts) and the
median over the steps after the first of `time/sample_s`, `time/train_s` and `time/step_s`, per checkout.

    git worktree add /tmp/before <commit> && .venv/bin/python scripts/trie_step.py --before /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from branchreplay.rl.config.task import SYSTEM_PROMPT

ROOT = Path(__file__).resolve().parent.parent


def tool_definitions(count: int = 6) -> str:
    """A system prompt of `count` made-up tools as JSON schemas (1,024 SmolLM2 tokens for 6), then the default
    task's instruction, so that the rewards stay as the demo's."""
    tools = [{"type": "function", "function": {
        "name": f"tool_{k}_{verb}",
        "description": f"{verb.capitalize()} the {noun} named in the request and return the result as JSON; fails "
                       f"with an error message when the {noun} does not exist.",
        "parameters": {"type": "object", "properties": {
            "name": {"type": "string", "description": f"the {noun}'s name"},
            "limit": {"type": "integer", "description": "the most results to return"},
            "verbose": {"type": "boolean", "description": "whether to include every field"}},
            "required": ["name"]}}}
        for k, (verb, noun) in enumerate(zip(["search", "open", "read", "count", "list", "sum"] * 2,
                                             ["file", "record", "page", "table", "user", "order"] * 2))][:count]
    return "You may call these tools:\n" + json.dumps(tools, indent=1) + "\n\n" + SYSTEM_PROMPT


WORKLOADS = ("demo", "tools", "guess", "agent", "agent-forks")
CONFIGS = {"demo": "demo.yaml", "guess": "guess_number.yaml", "agent": "agent.yaml"}


def workload_config(workload: str, out: Path) -> Path:
    """The run config of `workload`: a file of configs/, or one derived from it (written to `out`: JSON on the
    command line would be read as YAML): for tools the demo's with the tool definitions as its system prompt, for
    agent-forks the agent's with forks inside the first turn."""
    if workload in CONFIGS:
        return ROOT / "configs" / CONFIGS[workload]
    config = yaml.safe_load((ROOT / "configs" / ("demo.yaml" if workload == "tools" else "agent.yaml")).read_text())
    if workload == "tools":
        config["task"]["system_prompt"] = tool_definitions()
        config["grpo"]["entropy_coef"] = 1e-4
    else:
        config["sampling"]["turn_branching"] = [[[0, 2], [16, 2]], 2]
    path = out / f"{workload}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(checkout: Path, workload: str, steps: int, out: Path) -> list[dict]:
    """`branchreplay train` of `workload` with the package of `checkout` (its src/ first on the path); its step
    records (the run's folder is removed: the final checkpoint is about 1.6 GB)."""
    folder = Path(tempfile.mkdtemp(prefix=f"{workload}-", dir=out))
    command = [sys.executable, "-m", "branchreplay", "train", "--config", str(workload_config(workload, out)),
               "--train.steps", str(steps), "--train.eval_steps", "-1", "--train.output_dir", str(folder)]
    env = {**os.environ, "PYTHONPATH": str(checkout / "src")}
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT, env=env)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(folder)
    return [r for r in rows if "time/step_s" in r]


def median(runs: list[list[dict]], key: str) -> float:
    return statistics.median(r[key] for rows in runs for r in rows[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the root of a checkout of the head before")
    ap.add_argument("--steps", type=int, default=3, help="training steps per run (the first is not counted)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per checkout and workload, interleaved")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="trie-step-"))
    checkouts = {"before": args.before.resolve(), "after": ROOT}
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| workload | checkout | token ratio | sampling per step | training per step | step |")
    print("|---|---|---|---|---|---|")
    for workload in args.workloads:
        runs = {name: [] for name in checkouts}
        for k in range(args.repeats):
            order = list(checkouts) if k % 2 == 0 else list(reversed(checkouts))
            for name in order:
                runs[name].append(run(checkouts[name], workload, args.steps, out))
        for name in checkouts:
            ratio = statistics.mean(r["tree/token_ratio"] for rows in runs[name] for r in rows)
            print(f"| {workload} | {name} | {ratio:.2f} | {median(runs[name], 'time/sample_s'):.2f} s | "
                  f"{median(runs[name], 'time/train_s'):.2f} s | {median(runs[name], 'time/step_s'):.2f} s |",
                  flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    shutil.rmtree(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
