r"""Record the trajectories of one multi-turn training step, for `branchreplay bench --scenario multi-turn
--trajectories FILE --model ...` (issue 13: the bench on real trajectories from the real environment, recorded
once, so that the bench does not sample; docs/agents.md, "On SmolLM2-135M-Instruct", and the figures in
docs/notes/2026-12-01-recorded-trajectories.md).

Builds the run's trainer from the config (`branchreplay train`'s arguments: --config FILE and --section.field
overrides) and runs its sampling for --step (the trainer's source, `sample` then `score`: the same seeded
trajectories that step trains on), then writes one JSON object per trajectory: item (its group), ids, loss_mask
(1 on assistant tokens), reward, turns, tool_calls, ended_by. Prints the trajectories' token counts and the tree's
token ratio.

Run:  .venv/bin/python scripts/record_trajectories.py --config configs/guess_number.yaml \
          --out results/recorded-trajectories-2026-12/guess-number-trajectories.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from branchreplay.rl.config import parse_args
from branchreplay.rl.run.trainer import Trainer
from branchreplay.tree import RolloutTree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--step", type=int, default=1, help="which training step's trajectories (>= 1)")
    args, rest = parser.parse_known_args()
    config, _ = parse_args(rest, options=("--config",))
    if config.agent.environment is None:
        sys.exit("error: the config has no agent.environment: record_trajectories needs a multi-turn task")
    source = Trainer(config).source
    batch = source.score(source.sample(args.step))
    rows = [{"item": k, "ids": t.conversation.ids, "loss_mask": [int(m) for m in t.conversation.loss_mask],
             "reward": t.reward, "turns": t.turns, "tool_calls": t.tool_calls, "ended_by": t.ended_by}
            for k, group in enumerate(batch.trajectories) for t in group]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = [RolloutTree(group).stats for group in batch.rollouts]
    logical, physical = sum(s.logical_tokens for s in stats), sum(s.physical_tokens for s in stats)
    print(f"{len(rows)} trajectories of {len(batch.trajectories)} items written to {args.out}: {logical} tokens, "
          f"{physical} unique (token ratio {logical / physical:.2f}), mean turns "
          f"{sum(r['turns'] for r in rows) / len(rows):.2f}, tool calls {sum(r['tool_calls'] for r in rows)}")


if __name__ == "__main__":
    main()
