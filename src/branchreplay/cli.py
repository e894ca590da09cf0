"""The `branchreplay` command, a dispatcher over each wing's own commands: verify (check/cli.py), bench
(bench/cli.py), train, eval, export and vllm-serve (rl/cli.py)."""

from __future__ import annotations

import argparse
import sys

from .bench import cli as bench_cli
from .check import cli as check_cli
from .rl import cli as rl_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="branchreplay", description=__doc__)
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
