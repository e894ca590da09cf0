"""`branchreplay verify`: the execution stack against the naive per-rollout computation (verify.py), on a tiny random
config or a user's model, in one process or on N local gloo processes."""

from __future__ import annotations

import json
import sys

DTYPES = ("float64", "float32", "bfloat16")  # torch dtype names; torch loads only in the command that runs
LOSSES = ("grpo", "ppo", "rloo", "dpo")


def torch_dtype(name: str):
    """The torch dtype of a name of `DTYPES`."""
    import torch

    return getattr(torch, name)


def add_commands(sub) -> None:
    """Register `verify` on the top-level command's subparsers."""
    v = sub.add_parser("verify", help="check replay_backward against the naive per-rollout computation")
    v.add_argument("--arch", default="llama", help="tiny random config, e.g. llama, mistral, gemma2, mixtral "
                                                    "(--list shows all)")
    v.add_argument("--model", help="a local HF folder, a .gguf file, or 'smollm2' (overrides --arch)")
    v.add_argument("--dtype", default=None, choices=DTYPES, help="parameter dtype (default float64)")
    v.add_argument("--loss", default="grpo", choices=LOSSES,
                   help="grpo: the GRPO loss on trees of every shape; ppo: PPO's policy loss and a critic made from "
                        "the model (its value loss; rows <shape>/critic); rloo: RLOO's sequence-level loss "
                        "(engine.sequence); dpo: every DPO loss type on pair trees (engine.sequence)")
    v.add_argument("--mixed-precision", choices=["bfloat16"],
                   help="float32 parameters, both computations under torch.autocast in this dtype: what `train "
                        "--model.dtype bfloat16` runs (instead of --dtype)")
    v.add_argument("--device", default="cpu", help="torch device of both computations, e.g. cuda")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--random-trees", type=int, default=3)
    v.add_argument("--shapes", help="a comma list of tree shapes to check alone, e.g. short-beside-long (default: "
                                    "every shape, each length threshold and --random-trees random trees)")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.add_argument("--list", action="store_true", help="list the supported families and exit")
    v.add_argument("--force", action="store_true",
                   help="run the check on a family that is not in the registry (the engine guesses its layout)")
    v.add_argument("--nproc", type=int, default=1,
                   help="check the data-parallel step of --loss on this many local processes (gloo) instead: the "
                        "trainer's own sharded update (rl/policy.py) against the naive reference in one process")
    v.add_argument("--parallel", default="fsdp2", choices=["fsdp2", "ddp"],
                   help="with --nproc: FSDP2 (per decoder layer) or DDP semantics (replicated)")
    v.set_defaults(func=verify)


def verify(args) -> int:
    """`branchreplay verify`: exit 0 when exact, 1 when not, 2 for bad arguments."""
    if args.list:
        from ..engine.families import FAMILIES
        from ..tiny_models import ALL_TINY_ARCHS

        print("supported families: " + ", ".join(sorted(FAMILIES)))
        print("tiny configs (--arch): " + ", ".join(ALL_TINY_ARCHS))
        return 0
    refused = _refused(args)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    args.dtype = args.dtype or "float64"
    dtype = torch_dtype("float32" if args.mixed_precision else args.dtype)
    if args.nproc > 1:
        return _verify_data_parallel(args, dtype)
    return _verify_one_process(args, dtype)


def _refused(args) -> str:
    """What in `args` does not go together (the flag to drop), or ""."""
    if args.loss == "dpo" and args.mixed_precision:
        return "--loss dpo checks without autocast: drop --mixed-precision"
    if args.mixed_precision and (args.dtype is not None or args.nproc > 1):
        return "--mixed-precision runs float32 parameters in one process: drop --dtype and --nproc"
    if args.nproc > 1 and args.device != "cpu":
        return f"--nproc runs gloo processes on the CPU; drop --device {args.device}"
    if args.shapes is not None:
        from ..reference.shapes import SHAPES

        if args.loss == "dpo" or args.nproc > 1:
            return "--shapes picks the trees of the one-process check of grpo, ppo or rloo: drop --shapes"
        unknown = [name for name in args.shapes.split(",") if name not in SHAPES]
        if unknown or not args.shapes:
            return f"--shapes {args.shapes!r}: name one or more of {', '.join(SHAPES)}"
    return ""


def _verify_one_process(args, dtype) -> int:
    from ..engine.families import UnsupportedModelError
    from ..models import load_model
    from ..tiny_models import tiny_model
    from .verify import verify_dpo, verify_model

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
                                              loss=args.loss,
                                              shapes=tuple(args.shapes.split(",")) if args.shapes else None)
    except UnsupportedModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a forced family that does not even run is a failed check, reported as one
        if not args.force:
            raise
        print(f"error: {model.config.model_type} fails under the engine with --force: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    summary = _summary(args, model, name, dtype, results, uncovered)
    if args.json:
        print(json.dumps(summary))
    else:
        _print_table(args, summary, results, uncovered)
    return 0 if summary["passed"] else 1


def _summary(args, model, name: str, dtype, results, uncovered) -> dict:
    """The one JSON object of `verify --json`."""
    import torch

    from ..engine.families import state_bytes_per_token

    full, sliding = state_bytes_per_token(model.config, dtype)
    summary = {
        "arch": model.config.model_type,
        "model": name,
        "loss": args.loss,
        "dtype": f"{args.mixed_precision} autocast, float32 parameters" if args.mixed_precision else args.dtype,
        "max_rel_grad_err": max(r.max_rel_grad_err for r in results),
        "max_abs_logprob_err": max(r.max_abs_logprob_err for r in results),
        "trees": len(results),
        "passed": all(r.passed for r in results),
        # the lengths at which the model or the engine switch computation, each crossed by a tree of its own
        "thresholds_covered": {r.threshold.split("=")[0]: int(r.threshold.split("=")[1]) for r in results
                               if r.threshold},
        "thresholds_not_covered": uncovered,
        # attention K/V a branch holds for its prefix, in the verified dtype: per prefix token (full-attention
        # layers), and at most, whatever the prefix length (sliding-window layers)
        "state_bytes_per_token": {"full_layers_per_token": full, "sliding_layers_max": sliding},
    }
    if dtype != torch.float64:  # float32 / bfloat16: both sides compared with a float64 copy (verify.py)
        summary["max_rel_grad_err_vs_f64"] = max(r.max_rel_grad_err_vs_f64 for r in results)
        summary["naive_rel_grad_err_vs_f64"] = max(r.naive_rel_grad_err_vs_f64 for r in results)
    return summary


def _print_table(args, summary: dict, results, uncovered) -> None:
    """One row per tree, the thresholds crossed, the verdict and the state a branch holds."""
    from .verify import VS_FLOAT64_FACTOR

    vs_f64 = "max_rel_grad_err_vs_f64" in summary
    extra = f"{'vs f64':>10}{'naive f64':>11}" if vs_f64 else ""
    print(f"{'tree':<30}{'rollouts':>9}{'logical':>9}{'physical':>9}{'grad err':>11}{'logprob err':>13}{extra}  ok")
    for r in results:
        extra = f"{r.max_rel_grad_err_vs_f64:>10.2e}{r.naive_rel_grad_err_vs_f64:>11.2e}" if vs_f64 else ""
        print(f"{r.shape:<30}{r.rollouts:>9}{r.logical_tokens:>9}{r.physical_tokens:>9}"
              f"{r.max_rel_grad_err:>11.2e}{r.max_abs_logprob_err:>13.2e}{extra}  {'yes' if r.passed else 'NO'}")
    print("thresholds crossed: " + (", ".join(r.threshold for r in results if r.threshold) or "none"))
    for name, why in uncovered.items():
        print(f"threshold not covered: {name} ({why})")
    verdict = "PASSED" if summary["passed"] else "FAILED"
    if vs_f64:
        print(f"{summary['arch']} {summary['dtype']}: {verdict} (max relative grad error against float64: engine "
              f"{summary['max_rel_grad_err_vs_f64']:.2e}, naive {summary['naive_rel_grad_err_vs_f64']:.2e}; bound: "
              f"engine <= {VS_FLOAT64_FACTOR:g} x naive's largest over the trees)")
    else:
        print(f"{summary['arch']} {args.dtype}: {verdict} (max relative grad error {summary['max_rel_grad_err']:.2e})")
    full, sliding = summary["state_bytes_per_token"].values()
    print(f"state per branch: {full} bytes per prefix token (full-attention layers) + at most {sliding} bytes "
          "(sliding-window layers)")


def _verify_data_parallel(args, dtype) -> int:
    """verify --nproc N: the sharded update of --loss on N local gloo processes against the naive reference (one
    JSON object with --json, else one line); exit 1 when not passed."""
    from .parallel import verify_data_parallel

    spec = args.model or f"tiny:{args.arch}"
    summary = {"arch": args.arch if not args.model else args.model, "dtype": args.dtype, "loss": args.loss,
               **verify_data_parallel(spec, dtype, args.nproc, args.parallel, seed=args.seed, force=args.force,
                                      loss=args.loss)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['arch']} {args.dtype} --loss {args.loss}, {args.parallel} on {args.nproc} processes: "
              f"{'PASSED' if summary['passed'] else 'FAILED'} (max relative grad error "
              f"{summary['max_rel_grad_err']:.2e}, bound {summary['tolerance']:.0e}; {summary['trees']} trees, "
              f"imbalance {summary['imbalance']:.2f}, {summary['recomputed_positions']} positions recomputed)")
    return 0 if summary["passed"] else 1
