"""The `branchreplay` command: verify, bench, train, eval, export, vllm-serve."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DTYPES = ("float64", "float32", "bfloat16")  # torch dtype names; torch loads only in the command that runs


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _verify(args) -> int:
    import torch

    from .check.verify import verify_dpo, verify_model
    from .engine.families import FAMILIES, UnsupportedModelError, state_bytes_per_token
    from .models import RECURRENT_ARCHS, TINY_ARCHS, load_model, tiny_model

    if args.list:
        print("supported families: " + ", ".join(sorted(FAMILIES)))
        print("tiny configs (--arch): " + ", ".join(TINY_ARCHS + RECURRENT_ARCHS))
        return 0
    if args.loss == "dpo" and (args.mixed_precision or args.nproc > 1):
        print("error: --loss dpo checks one process without autocast: drop --mixed-precision and --nproc",
              file=sys.stderr)
        return 2
    if args.loss != "grpo" and args.nproc > 1:
        print(f"error: --nproc checks the data-parallel GRPO step; drop it for --loss {args.loss}", file=sys.stderr)
        return 2
    if args.mixed_precision and (args.dtype is not None or args.nproc > 1):
        print("error: --mixed-precision runs float32 parameters in one process: drop --dtype and --nproc",
              file=sys.stderr)
        return 2
    if args.nproc > 1 and args.device != "cpu":
        print(f"error: --nproc runs gloo processes on the CPU; drop --device {args.device}", file=sys.stderr)
        return 2
    args.dtype = args.dtype or "float64"
    dtype = torch.float32 if args.mixed_precision else _dtype(args.dtype)
    if args.nproc > 1:
        return _verify_data_parallel(args, dtype)
    try:
        if args.model:
            model, _ = load_model(args.model, dtype=dtype)
            name = args.model
        else:
            model = tiny_model(args.arch, dtype=dtype, seed=args.seed)
            name = args.arch
        model.to(args.device)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args.loss == "dpo":
            results, uncovered = verify_dpo(model, seed=args.seed, force=args.force), {}
        else:
            results, uncovered = verify_model(model, seed=args.seed, random_trees=args.random_trees,
                                              force=args.force, mixed_precision=args.mixed_precision,
                                              loss=args.loss)
    except UnsupportedModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a forced family that does not even run is a failed check, reported as one
        if not args.force:
            raise
        print(f"error: {model.config.model_type} fails under the engine with --force: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    passed = all(r.passed for r in results)
    full, sliding = state_bytes_per_token(model.config, dtype)
    summary = {
        "arch": model.config.model_type,
        "model": name,
        "loss": args.loss,
        "dtype": f"{args.mixed_precision} autocast, float32 parameters" if args.mixed_precision else args.dtype,
        "max_rel_grad_err": max(r.max_rel_grad_err for r in results),
        "max_abs_logprob_err": max(r.max_abs_logprob_err for r in results),
        "trees": len(results),
        "passed": passed,
        # the lengths at which the model or the engine switch computation, each crossed by a tree of its own
        "thresholds_covered": {r.threshold.split("=")[0]: int(r.threshold.split("=")[1]) for r in results
                               if r.threshold},
        "thresholds_not_covered": uncovered,
        # attention K/V a branch holds for its prefix, in the verified dtype: per prefix token (full-attention
        # layers), and at most, whatever the prefix length (sliding-window layers)
        "state_bytes_per_token": {"full_layers_per_token": full, "sliding_layers_max": sliding},
    }
    vs_f64 = dtype != torch.float64  # float32 / bfloat16: both sides measured from a float64 copy (verify.py)
    if vs_f64:
        summary["max_rel_grad_err_vs_f64"] = max(r.max_rel_grad_err_vs_f64 for r in results)
        summary["naive_rel_grad_err_vs_f64"] = max(r.naive_rel_grad_err_vs_f64 for r in results)
    if args.json:
        print(json.dumps(summary))
    else:
        extra = f"{'vs f64':>10}{'naive f64':>11}" if vs_f64 else ""
        print(f"{'tree':<30}{'rollouts':>9}{'logical':>9}{'physical':>9}{'grad err':>11}{'logprob err':>13}{extra}  ok")
        for r in results:
            extra = f"{r.max_rel_grad_err_vs_f64:>10.2e}{r.naive_rel_grad_err_vs_f64:>11.2e}" if vs_f64 else ""
            print(f"{r.shape:<30}{r.rollouts:>9}{r.logical_tokens:>9}{r.physical_tokens:>9}"
                  f"{r.max_rel_grad_err:>11.2e}{r.max_abs_logprob_err:>13.2e}{extra}  {'yes' if r.passed else 'NO'}")
        print("thresholds crossed: " + ", ".join(r.threshold for r in results if r.threshold))
        for name, why in uncovered.items():
            print(f"threshold not covered: {name} ({why})")
        if vs_f64:
            print(f"{summary['arch']} {summary['dtype']}: {'PASSED' if passed else 'FAILED'} (max relative grad error "
                  f"against float64: engine {summary['max_rel_grad_err_vs_f64']:.2e}, naive "
                  f"{summary['naive_rel_grad_err_vs_f64']:.2e}; bound: engine <= 1.5 x naive on every tree)")
        else:
            print(f"{summary['arch']} {args.dtype}: {'PASSED' if passed else 'FAILED'} "
                  f"(max relative grad error {summary['max_rel_grad_err']:.2e})")
        print(f"state per branch: {full} bytes per prefix token (full-attention layers) + at most {sliding} bytes "
              "(sliding-window layers)")
    return 0 if passed else 1


def _verify_data_parallel(args, dtype) -> int:
    """verify --nproc N: the sharded step on N local gloo processes against the naive reference (one JSON object
    with --json, else one line); exit 1 when not passed."""
    from .check.verify import verify_data_parallel

    spec = args.model or f"tiny:{args.arch}"
    summary = {"arch": args.arch if not args.model else args.model, "dtype": args.dtype,
               **verify_data_parallel(spec, dtype, args.nproc, args.parallel, seed=args.seed, force=args.force)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['arch']} {args.dtype}, {args.parallel} on {args.nproc} processes: "
              f"{'PASSED' if summary['passed'] else 'FAILED'} (max relative grad error "
              f"{summary['max_rel_grad_err']:.2e}, bound {summary['tolerance']:.0e}; {summary['trees']} trees, "
              f"imbalance {summary['imbalance']:.2f}, {summary['recomputed_positions']} positions recomputed)")
    return 0 if summary["passed"] else 1


def _bench_data_parallel(args) -> int:
    """bench --nproc N: each scenario configuration data-parallel on N local processes (bench/parallel.py)."""
    from .bench.parallel import format_data_parallel, run_data_parallel
    from .bench.scenarios import SCENARIOS, scenario_grid

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


def _bench(args) -> int:
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
    from .bench.output import format_table, merge_results, plot
    from .bench.runner import BenchOptions, run_bench
    from .bench.scenarios import SCENARIOS, scenario_grid

    try:
        if args.from_json:  # no run: the table (or merged JSON) and the plot of earlier --json outputs
            result = merge_results([json.loads(Path(p).read_text()) for p in args.from_json.split(",")])
        else:
            names = list(SCENARIOS) if args.scenario == "all" else args.scenario.split(",")
            scenarios = scenario_grid(names, args.prompt_tokens, args.generations, args.response_tokens, args.turns,
                                      args.reply_tokens, args.tool_tokens, args.branching, args.fork_schedule,
                                      args.trajectories)
            options = BenchOptions(dtype=_dtype(args.dtype), device=_device(args.device), seed=args.seed,
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
    from .bench.objectives import format_objective_table, run_dpo, run_ppo
    from .bench.runner import BENCH_MODEL, MODEL_LABEL
    from .bench.scenarios import SCENARIOS, scenario_grid

    if args.nproc > 1 or args.from_json or args.plot:
        print(f"error: --loss {args.loss} runs in one process and prints its table: drop --nproc, --from-json and "
              "--plot", file=sys.stderr)
        return 2
    import torch

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = _dtype(args.dtype)
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


def _train(argv: list[str]) -> int:
    from .rl.config import parse_args

    config, options = parse_args(argv, ("--config", "--resume", "--threads"))  # before torch: a bad config is quick
    _set_threads(options["--threads"])
    from .rl.trainer import RankDied, TrainingFailed, TrainingInterrupted, train

    try:
        run_dir = train(config, options["--resume"])
    except TrainingInterrupted as e:
        print(e, file=sys.stderr)
        return 130
    except TrainingFailed as e:
        print(f"error: {e}", file=sys.stderr)
        if isinstance(e, RankDied):  # the process group is broken: its teardown could block or abort (gloo)
            sys.stderr.flush()
            os._exit(1)
        return 1
    print(f"run folder: {run_dir}")
    return 0


def _eval(argv: list[str]) -> int:
    from .rl.config import parse_args, run_config

    config, options = parse_args(argv, ("--config", "--checkpoint", "--threads"))  # before torch: a bad config is quick
    _set_threads(options["--threads"])
    from .rl.evaluation import evaluate_cli
    from .rl.rewards import RewardFunctionError

    checkpoint = options["--checkpoint"]
    found = run_config(checkpoint) if checkpoint is not None and options["--config"] is None else None
    if found is not None:  # the config parse_args took
        print(f"config: {found} (the run's own; --config FILE to use another)", file=sys.stderr)
    try:
        evaluate_cli(config, checkpoint)
    except RewardFunctionError as e:
        print(f"error: the held-out evaluation failed: {e}", file=sys.stderr)
        return 1
    return 0


def _export(args) -> int:
    from .rl.export import export

    try:
        diff = export(args.checkpoint, args.out)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} to {args.out} (reloaded with transformers: logits within {diff:.1g})")
    return 0


def _device(name: str) -> str:
    """--device: 'auto' is cuda when available, else cpu."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _vllm_serve(args) -> int:
    """vllm-serve: a vLLM server for a model spec, run from the vLLM venv (`make vllm`) until it is stopped."""
    import subprocess

    from .rl.vllm_client import serve_command, serve_environment

    python = Path(args.venv) / "bin" / "python"
    if not python.is_file():
        print(f"error: {python} does not exist: run `make vllm` (vLLM in its own venv) or pass --venv", file=sys.stderr)
        return 2
    folder = args.model
    if args.model == "smollm2":
        from .models import model_folder

        folder = model_folder(args.model)  # converted from the GGUF on first use (same as train)
        if not Path(folder).is_dir():
            from .models import load_model

            load_model(args.model)
    command = serve_command(folder, args.host, args.port, str(python), args.max_model_len, args.dtype,
                            args.kv_cache_gib)
    print("starting: " + " ".join(command), file=sys.stderr, flush=True)
    try:
        return subprocess.call(command, env=serve_environment(args.threads))
    except KeyboardInterrupt:
        return 130


def _set_threads(value: str | None) -> None:
    """--threads N: torch's intra-op threads for the command (default: torch's own choice)."""
    if value is None:
        return
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--threads {value!r} must be a whole number >= 1")
    import torch

    torch.set_num_threads(int(value))


def _config_command(command, usage: str, argv: list[str]) -> int:
    """train / eval: --help prints the usage and every config field; a bad config, task, path or reward ends in one
    `error:` line and exit 2."""
    from .rl.config import help_text

    if "-h" in argv or "--help" in argv:
        print(f"usage: {usage}\n")
        print(help_text())
        return 0
    try:
        return command(argv)
    except (ValueError, OSError) as e:  # OSError: a file that cannot be read, a hub id that cannot be reached
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="branchreplay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="check replay_backward against the naive per-rollout computation")
    v.add_argument("--arch", default="llama", help="tiny random config, e.g. llama, mistral, gemma2, mixtral "
                                                    "(--list shows all)")
    v.add_argument("--model", help="a local HF folder, a .gguf file, or 'smollm2' (overrides --arch)")
    v.add_argument("--dtype", default=None, choices=DTYPES, help="parameter dtype (default float64)")
    v.add_argument("--loss", default="grpo", choices=["grpo", "ppo", "rloo", "dpo"],
                   help="grpo: the GRPO loss on trees of every shape; ppo: PPO's policy loss and a critic made from "
                        "the model (its value loss; rows <shape>/critic); rloo: RLOO's sequence-level loss "
                        "(engine.sequence); dpo: every DPO loss type on pair trees (engine.sequence)")
    v.add_argument("--mixed-precision", choices=["bfloat16"],
                   help="float32 parameters, both computations under torch.autocast in this dtype: what `train "
                        "--model.dtype bfloat16` runs (instead of --dtype)")
    v.add_argument("--device", default="cpu", help="torch device of both computations, e.g. cuda")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--random-trees", type=int, default=3)
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.add_argument("--list", action="store_true", help="list the supported families and exit")
    v.add_argument("--force", action="store_true",
                   help="run the check on a family that is not in the registry (the engine guesses its layout)")
    v.add_argument("--nproc", type=int, default=1,
                   help="check the data-parallel step on this many local processes (gloo) instead")
    v.add_argument("--parallel", default="fsdp2", choices=["fsdp2", "ddp"],
                   help="with --nproc: FSDP2 (per decoder layer) or DDP semantics (replicated)")
    v.set_defaults(func=_verify)

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
    b.set_defaults(func=_bench)

    t = sub.add_parser("train", help="GRPO post-training with branch replay", add_help=False,
                       usage="branchreplay train [--config FILE.yaml] [--resume RUN_DIR] [--threads N] "
                             "[--section.field VALUE ...]")
    t.set_defaults(func=_train)
    e = sub.add_parser("eval", help="held-out accuracy of a model or checkpoint", add_help=False,
                       usage="branchreplay eval [--checkpoint DIR] [--config FILE.yaml] [--threads N] "
                            "[--section.field VALUE ...]")
    e.set_defaults(func=_eval)

    s = sub.add_parser("vllm-serve", help="a vLLM server for sampling.backend=vllm (from the venv of `make vllm`)")
    s.add_argument("--model", default="smollm2", help="the model spec the run trains: smollm2, a folder or a hub id")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--dtype", default="float32", help="the server's compute dtype (float32 on CPUs without bf16 units)")
    s.add_argument("--max-model-len", type=int, default=None, help="tokens of context (default: the model's)")
    s.add_argument("--threads", type=int, default=None, help="CPU cores for the server (default: all)")
    s.add_argument("--kv-cache-gib", type=float, default=4.0, help="GiB of KV cache the server reserves")
    s.add_argument("--venv", default=".venv-vllm", help="the vLLM virtual environment (`make vllm`)")
    s.set_defaults(func=_vllm_serve)

    x = sub.add_parser("export", help="a run's checkpoint as a Hugging Face model folder (transformers, vLLM); "
                                       "a LoRA adapter is merged")
    x.add_argument("checkpoint", metavar="RUN_DIR", help="a run folder (its latest checkpoint) or a checkpoint folder")
    x.add_argument("out", metavar="OUT", help="the new model folder (must not exist)")
    x.set_defaults(func=_export)

    args, rest = parser.parse_known_args(argv)
    if args.func in (_train, _eval):
        return _config_command(args.func, sub.choices[args.command].usage, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
