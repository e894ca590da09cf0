"""The training side's commands: `train`, `eval`, `export` and `vllm-serve`. `train` and `eval` parse their own
arguments (the run config's `--section.field value` overrides, `rl.config.parse_args`), before torch loads."""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from pathlib import Path


def add_commands(sub) -> None:
    """Register `train`, `eval`, `estimate`, `vllm-serve` and `export` on the top-level command's subparsers;
    `train`, `eval` and `estimate` take the rest of the command line (`raw`)."""
    t = sub.add_parser("train", help="RL post-training over prefix trees (GRPO, PPO, RLOO, REINFORCE++, DPO)",
                       add_help=False,
                       usage="branchreplay train [--config FILE.yaml] [--resume RUN_DIR] [--dry-run] [--threads N] "
                             "[--section.field VALUE ...]")
    t.set_defaults(func=_train, raw=True)
    e = sub.add_parser("eval", help="held-out accuracy of a model or checkpoint", add_help=False,
                       usage="branchreplay eval [--checkpoint DIR] [--config FILE.yaml] [--threads N] "
                            "[--section.field VALUE ...]")
    e.set_defaults(func=_eval, raw=True)
    m = sub.add_parser("estimate", help="will the tree help this run? token and FLOP ratios, speed-up and memory "
                                        "from your own prompts, before any training", add_help=False,
                       usage="branchreplay estimate [--config FILE.yaml] [--dataset FILE] [--completion-tokens N] "
                             "[--prompts N] [--section.field VALUE ...]")
    m.set_defaults(func=_estimate, raw=True)

    s = sub.add_parser("vllm-serve", help="a vLLM server for sampling.backend=vllm (from the venv of `make vllm`)")
    s.add_argument("--model", default="smollm2", help="the model spec the run trains: smollm2, a folder or a hub id")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--dtype", default="float32", help="the server's compute dtype (float32 on CPUs without bf16 units)")
    s.add_argument("--max-model-len", type=int, default=None, help="tokens of context (default: the model's)")
    s.add_argument("--threads", type=int, default=None, help="CPU cores for the server (default: all)")
    s.add_argument("--kv-cache-gib", type=float, default=4.0, help="GiB of KV cache the server reserves")
    s.add_argument("--lora-rank", type=int, default=None,
                   help="serve LoRA adapters up to this rank (a run with model.lora_r syncs its adapter)")
    s.add_argument("--venv", default=".venv-vllm", help="the vLLM virtual environment (`make vllm`)")
    s.set_defaults(func=_vllm_serve)

    x = sub.add_parser("export", help="a run's checkpoint as a Hugging Face model folder (transformers, vLLM); "
                                       "a LoRA adapter is merged")
    x.add_argument("checkpoint", metavar="RUN_DIR", help="a run folder (its latest checkpoint) or a checkpoint folder")
    x.add_argument("out", metavar="OUT", help="the new model folder (must not exist)")
    x.set_defaults(func=_export)


def _train(argv: list[str]) -> int:
    from .config import parse_args

    dry = "--dry-run" in argv
    config, options = parse_args([a for a in argv if a != "--dry-run"], ("--config", "--resume", "--threads"))
    _set_threads(options["--threads"])  # parsed before torch loads: a bad config is quick
    _plain_output()
    if dry:
        from rich.console import Console

        from .run.dry_run import dry_run

        return dry_run(config, Console())
    from .run.stops import RankDied, StepSkipped, TrainingAborted, TrainingFailed, TrainingInterrupted
    from .run.trainer import train

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StepSkipped)  # the step's line says it, once
            run_dir = train(config, options["--resume"])
    except (TrainingInterrupted, TrainingAborted) as e:
        print(e, file=sys.stderr)
        return 130
    except TrainingFailed as e:
        print(f"error: {e}", file=sys.stderr)
        if isinstance(e, RankDied):  # the process group is broken: its teardown could block or abort (gloo)
            sys.stderr.flush()
            os._exit(1)
        return 1
    except (ValueError, OSError):
        raise  # bad input: one line (config_command)
    except Exception:
        # Under torchrun the other ranks wait in a collective: leaving at once makes their next one fail now, naming
        # this rank and its error (rl/run/parallel.py), not at the collective timeout; the interpreter's teardown
        # of the process group could block.
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        raise
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, once
        print(f"run folder: {run_dir}")
    return 0


def _eval(argv: list[str]) -> int:
    from .config import parse_args, run_config

    config, options = parse_args(argv, ("--config", "--checkpoint", "--threads"))  # before torch: a bad config is quick
    _set_threads(options["--threads"])
    _plain_output()
    from .data.rewards import RewardFunctionError
    from .run.evaluation import evaluate_cli

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


def _estimate(argv: list[str]) -> int:
    from .config import parse_args

    config, options = parse_args(argv, ("--config", "--dataset", "--completion-tokens", "--prompts"))
    _plain_output()
    from .estimate import estimate_cli

    print(estimate_cli(config, options["--dataset"], options["--completion-tokens"], options["--prompts"]))
    return 0


def _export(args) -> int:
    from .run.export import export

    try:
        diff = export(args.checkpoint, args.out)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} to {args.out} (reloaded with transformers: its logits differ from the "
          f"checkpoint's by at most {diff:.2g})")
    return 0


def _vllm_serve(args) -> int:
    """vllm-serve: a vLLM server for a model spec, run from the vLLM venv (`make vllm`) until it is stopped."""
    from .rollouts.vllm.client import serve_command, serve_environment
    from .rollouts.vllm.server_process import run_process_group

    python = Path(args.venv) / "bin" / "python"
    if not python.is_file():
        print(f"error: {python} does not exist: run `make vllm` (vLLM in its own venv) or pass --venv", file=sys.stderr)
        return 2
    folder = args.model
    if args.model == "smollm2":
        from ..models import model_folder

        folder = model_folder(args.model)  # converted from the GGUF on first use (same as train)
        if not Path(folder).is_dir():
            from ..models import load_model

            load_model(args.model)
    command = serve_command(folder, args.host, args.port, str(python), args.max_model_len, args.dtype,
                            args.kv_cache_gib, args.lora_rank)
    print("starting: " + " ".join(command), file=sys.stderr, flush=True)
    return run_process_group(command, env=serve_environment(args.threads))


def _plain_output() -> None:
    """No library progress bars when stderr is not a terminal (a log file, CI: `log.quiet_progress_bars`)."""
    if not sys.stderr.isatty():
        from .run.log import quiet_progress_bars

        quiet_progress_bars()


def _set_threads(value: str | None) -> None:
    """--threads N: torch's intra-op threads for the command (default: torch's own choice)."""
    if value is None:
        return
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--threads {value!r} must be a whole number >= 1")
    import torch

    torch.set_num_threads(int(value))


def config_command(name: str, command, usage: str, argv: list[str]) -> int:
    """`name` ("train" or "eval") runs `command(argv)`. --help prints the usage and the options people use,
    --help-all every option the command reads (config/help.py); a bad config, task, path or reward ends in one
    `error:` line and exit 2, printed once per node under torchrun (by LOCAL_RANK 0: every rank reads the same
    config and files). Raised after the ranks started their process group (a file one rank cannot write), the line
    is that rank's own, and the rank leaves at once (`os._exit`): the others' next collective then fails, naming it,
    where the group's teardown could block."""
    from .config import full_help, short_help

    if "--help-all" in argv:
        print(f"usage: {usage}\n")
        print(full_help(name))
        return 0
    if "-h" in argv or "--help" in argv:
        print(f"usage: {usage}\n")
        print(short_help(name))
        return 0
    try:
        return command(argv)
    except (ValueError, OSError) as e:  # OSError: a file that cannot be read, a hub id that cannot be reached
        started = _process_group_started()
        if started or os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        if started:
            sys.stderr.flush()
            os._exit(2)
        return 2


def _process_group_started() -> bool:
    """Whether this process is a rank of a started torch.distributed group (without importing torch for a config
    error that came before it)."""
    distributed = sys.modules.get("torch.distributed")
    return distributed is not None and distributed.is_available() and distributed.is_initialized()
