"""The `branchreplay` command: verify, bench (and train / eval once the trainer is in)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .state import FAMILIES, UnsupportedModelError

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _verify(args) -> int:
    from .models import TINY_ARCHS, load_model, tiny_model
    from .verify import verify_model

    if args.list:
        print("supported families: " + ", ".join(sorted(FAMILIES)))
        print("tiny configs (--arch): " + ", ".join(TINY_ARCHS))
        return 0
    dtype = DTYPES[args.dtype]
    if args.model:
        model, _ = load_model(args.model, dtype=dtype)
        name = args.model
    else:
        model = tiny_model(args.arch, dtype=dtype, seed=args.seed)
        name = args.arch
    try:
        results = verify_model(model, seed=args.seed, random_trees=args.random_trees)
    except UnsupportedModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    passed = all(r.passed for r in results)
    summary = {
        "arch": model.config.model_type,
        "model": name,
        "dtype": args.dtype,
        "max_rel_grad_err": max(r.max_rel_grad_err for r in results),
        "max_abs_logprob_err": max(r.max_abs_logprob_err for r in results),
        "trees": len(results),
        "passed": passed,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{'tree':<22}{'rollouts':>9}{'logical':>9}{'physical':>9}{'grad err':>11}{'logprob err':>13}  ok")
        for r in results:
            print(f"{r.shape:<22}{r.rollouts:>9}{r.logical_tokens:>9}{r.physical_tokens:>9}"
                  f"{r.max_rel_grad_err:>11.2e}{r.max_abs_logprob_err:>13.2e}  {'yes' if r.passed else 'NO'}")
        print(f"{summary['arch']} {args.dtype}: {'PASSED' if passed else 'FAILED'} "
              f"(max relative grad error {summary['max_rel_grad_err']:.2e})")
    return 0 if passed else 1


def _bench(args) -> int:
    from .bench import bench_shared_prompt

    figures = bench_shared_prompt(args.prompt_tokens, args.generations, args.response_tokens,
                                  dtype=DTYPES[args.dtype], device=args.device)
    if args.json:
        print(json.dumps(figures))
        return 0
    f = figures
    print(f"shared-prompt: prompt {f['prompt_tokens']} + {f['generations']} x {f['response_tokens']} tokens, "
          f"{f['model']}, {f['dtype']}, {f['device']}, {f['threads']} threads")
    print(f"  positions     logical {f['logical_tokens']}  physical {f['physical_tokens']}  "
          f"ratio {f['token_ratio']:.2f}")
    print(f"  wall time     naive {f['naive_s']:.2f} s  replay {f['replay_s']:.2f} s  speedup {f['speedup']:.2f}x "
          f"({f['speedup'] / f['token_ratio']:.2f} of the token ratio)")
    mib = 2**20
    print(f"  peak memory   naive {f['naive_peak_bytes'] / mib:.0f} MiB  replay {f['replay_peak_bytes'] / mib:.0f} MiB")
    print(f"  gradients     max relative error {f['max_rel_grad_err']:.2e}")
    print(f"  tree build    64 rollouts x 32k tokens: {f['tree_build_s_64x32k'] * 1000:.0f} ms")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="branchreplay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="check replay_backward against the naive per-rollout computation")
    v.add_argument("--arch", default="llama", help="tiny random config: llama, qwen2, qwen3, mistral, gpt2")
    v.add_argument("--model", help="a local HF folder, a .gguf file, or 'smollm2' (overrides --arch)")
    v.add_argument("--dtype", default="float64", choices=list(DTYPES))
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--random-trees", type=int, default=3)
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.add_argument("--list", action="store_true", help="list the supported families and exit")
    v.set_defaults(func=_verify)

    b = sub.add_parser("bench", help="naive vs branch replay, side by side in one process")
    b.add_argument("--scenario", default="shared-prompt", choices=["shared-prompt"])
    b.add_argument("--prompt-tokens", type=int, default=2048)
    b.add_argument("--generations", type=int, default=8)
    b.add_argument("--response-tokens", type=int, default=128)
    b.add_argument("--dtype", default="float32", choices=list(DTYPES))
    b.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=_bench)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
