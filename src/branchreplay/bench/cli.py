"""`branchreplay bench`: naive, TRL's padded batch, prompt sharing and branch replay side by side (runner.py), the
other objectives (objectives.py), and data parallelism on local processes (parallel.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..check.cli import DTYPES, torch_dtype


def add_commands(sub) -> None:
    """Register `bench` on the top-level command's subparsers."""
    b = sub.add_parser("bench", help="naive, padded batch, prompt sharing and branch replay, side by side in one "
                                      "process (same model, rollouts and loss)")
    b.add_argument("--loss", default="grpo", choices=["grpo", "ppo", "dpo"],
                   help="grpo: the four methods below; ppo: one PPO update (policy and critic), naive against branch "
                        "replay, on the scenarios; dpo: preference pairs of a --prompt-tokens prompt (default 4096) "
                        "and two --response-tokens responses, naive, TRL's padded batch and branch replay "
                        "(bench/objectives.py)")
    b.add_argument("--pairs", type=int, default=2, help="--loss dpo: preference pairs per step")
    b.add_argument("--scenario", default="shared-prompt",
                   help="shared-prompt, multi-turn, tree-sampled, a comma list of them, or all; low-sharing: a preset "
                        "grid where the tree saves little (short prompts, long responses; agent trajectories sharing "
                        "only their prompt)")
    b.add_argument("--prompt-tokens", type=_int_list, default=None,
                   help="prompt lengths to sweep, e.g. 1024,4096 (default per scenario: shared-prompt 2048, "
                        "multi-turn 512, tree-sampled 1024)")
    b.add_argument("--generations", type=_int_list, default=[8], help="shared-prompt: rollouts per prompt, e.g. 4,16")
    b.add_argument("--response-tokens", type=_int_list, default=[128],
                   help="shared-prompt and tree-sampled: response length(s) in tokens")
    b.add_argument("--turns", type=_int_list, default=[4], help="multi-turn: turns per trajectory (list)")
    b.add_argument("--reply-tokens", type=int, default=96, help="multi-turn: tokens per generated reply (trained)")
    b.add_argument("--tool-tokens", type=int, default=64, help="multi-turn: tokens per tool output (not trained)")
    b.add_argument("--branching", type=_int_list, default=[2, 1, 3],
                   help="multi-turn: fan-outs cycled over the partial trajectories at each turn (uneven tree)")
    b.add_argument("--trajectories", metavar="FILE.jsonl",
                   help="multi-turn: trajectories recorded from a real environment (scripts/record_trajectories.py) "
                        "instead of synthetic ones; bench them with the model that sampled them (--model)")
    b.add_argument("--model", default=None,
                   help="grpo: a model spec (e.g. smollm2) instead of the tiny bench Llama")
    b.add_argument("--fork-schedule", type=_fork_schedule, default=[(0, 2), (32, 4)],
                   help="tree-sampled: depth:fanout pairs in response tokens (default 0:2,32:4: 8 responses)")
    b.add_argument("--methods", default="naive,padded,prompt-sharing,branchreplay",
                   help="comma list; naive always runs (reference and speedup baseline)")
    b.add_argument("--prompt-sharing", default="auto", choices=["auto", "prefix-grouper", "equivalent"],
                   help="prompt-sharing implementation: the prefix-grouper package (auto: when installed) or ours")
    b.add_argument("--max-naive-seconds", type=float, default=120.0,
                   help="a naive (or padded / prompt-sharing) run projected to take longer is estimated from a "
                        "sample of its rollouts, scaled by FLOPs, and labelled estimated")
    b.add_argument("--max-memory-gib", type=float, default=None,
                   help="padded / prompt-sharing runs estimated to peak above this are sampled or skipped "
                        "(default: 60%% of available memory)")
    b.add_argument("--repeats", type=int, default=1, help="timed runs per full-size method (minimum time kept)")
    b.add_argument("--threads", type=int, default=None,
                   help="torch threads for the run (default: torch's; 1 is faster on an oversubscribed machine)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--nproc", type=int, default=1,
                   help="run naive data parallelism, prompt sharing and branchreplay on this many local processes "
                        "(gloo, 1 thread each) and print the shard plan for 8 ranks; float32, CPU")
    b.add_argument("--parallel", default="fsdp2", choices=["fsdp2", "ddp"], help="with --nproc: the strategy")
    b.add_argument("--dtype", default="float32", choices=DTYPES)
    b.add_argument("--device", default="auto", help="torch device; auto = cuda if available, else cpu")
    b.add_argument("--json", action="store_true", help="print one JSON object (rows: one per configuration x method)")
    b.add_argument("--plot", metavar="PATH.png", help="write speedup vs FLOP ratio and peak memory vs logical tokens")
    b.add_argument("--from-json", metavar="A.json,B.json",
                   help="run nothing: print the table (or, with --json, the merged JSON) and --plot of earlier "
                        "--json outputs, their rows concatenated")
    b.set_defaults(func=bench)



def _bench_data_parallel(args) -> int:
    """bench --nproc N: each scenario configuration data-parallel on N local processes (bench/parallel.py)."""
    from .parallel import format_data_parallel, run_data_parallel
    from .scenarios import SCENARIOS, scenario_grid

    names = SCENARIOS if args.scenario == "all" else tuple(args.scenario.split(","))
    scenarios = scenario_grid(names, args.prompt_tokens, args.generations, args.response_tokens, args.turns,
                              args.reply_tokens, args.tool_tokens, args.branching, args.fork_schedule)
    results = [run_data_parallel(s, args.nproc, args.parallel, seed=args.seed, max_seconds=args.max_naive_seconds)
               for s in scenarios]
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
    else:
        print("\n\n".join(format_data_parallel(r) for r in results))
    return 0


def _int_list(text: str) -> list[int]:
    """"1024,4096" -> [1024, 4096]; every value must be a positive integer."""
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _fork_schedule(text: str) -> list[tuple[int, int]]:
    """"0:2,32:4" -> [(0, 2), (32, 4)] (response depth in tokens : fan-out)."""
    try:
        return [(int(d), int(f)) for d, f in (item.split(":") for item in text.split(",") if item)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected depth:fanout pairs like 0:2,32:4, got {text!r}") from None


def bench(args) -> int:
    """`branchreplay bench`: the table (or JSON) on stdout, progress on stderr; exit 2 for bad arguments."""
    if (args.model or args.trajectories) and (args.loss != "grpo" or args.nproc > 1):
        print("error: --model and --trajectories run with --loss grpo in one process: drop --nproc and --loss",
              file=sys.stderr)
        return 2
    if args.trajectories and args.scenario != "multi-turn":
        print("error: --trajectories are a multi-turn scenario's rollouts: pass --scenario multi-turn", file=sys.stderr)
        return 2
    if args.loss != "grpo":
        return _bench_objective(args)
    if args.nproc > 1:
        return _bench_data_parallel(args)
    from .output import format_table, merge_results, plot
    from .runner import BenchOptions, run_bench
    from .scenarios import SCENARIOS, scenario_grid

    try:
        if args.from_json:  # no run: the table (or merged JSON) and the plot of earlier --json outputs
            result = merge_results([json.loads(Path(p).read_text()) for p in args.from_json.split(",")])
        else:
            names = list(SCENARIOS) if args.scenario == "all" else args.scenario.split(",")
            scenarios = scenario_grid(names, args.prompt_tokens, args.generations, args.response_tokens, args.turns,
                                      args.reply_tokens, args.tool_tokens, args.branching, args.fork_schedule,
                                      args.trajectories)
            options = BenchOptions(dtype=torch_dtype(args.dtype), device=_device(args.device), seed=args.seed,
                                   methods=tuple(args.methods.split(",")), max_seconds=args.max_naive_seconds,
                                   max_memory_bytes=int(args.max_memory_gib * 2**30) if args.max_memory_gib else None,
                                   prompt_sharing=args.prompt_sharing, repeats=args.repeats, threads=args.threads,
                                   model=args.model)
            # progress on stderr; stdout carries only the table or the JSON
            result = run_bench(scenarios, options, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except (OSError, ValueError, ImportError) as e:
        print(f"error: {'--from-json: ' if args.from_json else ''}{e}", file=sys.stderr)
        return 2
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def _bench_objective(args) -> int:
    """bench --loss ppo | dpo: naive against branch replay (and DPO's padded batch) for that objective
    (bench/objectives.py)."""
    from .objectives import format_objective_table, run_dpo, run_ppo
    from .runner import BENCH_MODEL, MODEL_LABEL
    from .scenarios import SCENARIOS, scenario_grid

    if args.nproc > 1 or args.from_json or args.plot:
        print(f"error: --loss {args.loss} runs in one process and prints its table: drop --nproc, --from-json and "
              "--plot", file=sys.stderr)
        return 2
    import torch

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch_dtype(args.dtype)
    try:
        if args.loss == "ppo":
            names = list(SCENARIOS) if args.scenario == "all" else args.scenario.split(",")
            scenarios = scenario_grid(names, args.prompt_tokens, args.generations, args.response_tokens, args.turns,
                                      args.reply_tokens, args.tool_tokens, args.branching, args.fork_schedule)
            rows = run_ppo(scenarios, BENCH_MODEL, dtype, args.seed, log)
        else:
            rows = run_dpo(args.prompt_tokens or [4096], args.response_tokens, args.pairs, BENCH_MODEL, dtype,
                           args.seed, log)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    header = f"{MODEL_LABEL}, {args.dtype}, cpu, {torch.get_num_threads()} threads"
    print(json.dumps({"loss": args.loss, "model": MODEL_LABEL, "rows": rows}) if args.json
          else format_objective_table(args.loss, rows, header))
    return 0


def _device(name: str) -> str:
    """--device: 'auto' is cuda when available, else cpu."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
