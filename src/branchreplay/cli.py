"""The `branchreplay` command: the commands of each wing (check/cli.py: verify; bench/cli.py: bench; rl/cli.py:
train, eval, export, vllm-serve) under one parser whose help says what the tool does, with an example per command."""

from __future__ import annotations

import argparse
import sys

from .bench import cli as bench_cli
from .check import cli as check_cli
from .rl import cli as rl_cli

DESCRIPTION = """\
RL post-training of LLMs (GRPO, PPO, RLOO, REINFORCE++, DPO) whose rollouts share prefixes: each shared prefix
runs once, as a tree, and the gradients equal the per-rollout computation's."""

EXAMPLES = """\
examples:
  branchreplay train --config configs/demo.yaml           GRPO on the default model and task
  branchreplay train --task.dataset my.jsonl --task.reward my_rewards:correct --dry-run
                                                          check your own rewards on a few completions first
  branchreplay estimate --config configs/demo.yaml        will the tree help? its ratios, speed-up and memory
  branchreplay eval --checkpoint runs/demo                the held-out score of a run's latest checkpoint
  branchreplay export runs/demo my-model                  the checkpoint as a Hugging Face model folder
  branchreplay verify --model path/to/model               is your model's family exact here?
  branchreplay bench --scenario shared-prompt             the tree against naive, side by side
  branchreplay vllm-serve --model smollm2                 a vLLM server for sampling.backend=vllm

Each command's options: branchreplay COMMAND --help (train and eval: --help-all for every field).
Documentation: docs/index.md of the repository (`make docs` builds the site into site/); the config
reference: docs/reference/config.md."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="branchreplay", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for wing in (check_cli, bench_cli, rl_cli):
        wing.add_commands(sub)
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "raw", False):  # train / eval parse the rest themselves (the run config's overrides)
        return rl_cli.config_command(args.command, args.func, sub.choices[args.command].usage, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
