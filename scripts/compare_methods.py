"""One training config run with each `train.method` side by side, in one process, in lockstep (docs/convergence.md).

Every method gets its own Trainer built from the same config and seed (`--train.method` set per trainer). Step s
runs for each method in turn, so their per-step times are measured under the same conditions. After every step the
script records each run's metrics, whether the sampled completions are identical to the first method's, and the
distance between the parameters: max |theta_m - theta_first| over every entry, and ||theta_m - theta_first|| /
||theta_first|| over all of them. Evaluation (held-out accuracy) runs before training and on train.eval_steps.

Writes OUT/metrics.jsonl (one line per step and method) and OUT/convergence.png (reward, held-out accuracy, loss,
KL, entropy, time per step split into sampling and training, parameter distance; one line per method).

    .venv/bin/python scripts/compare_methods.py --config configs/convergence.yaml \
        --out results/convergence-2026-12/smollm2-naive --methods branchreplay,naive
    .venv/bin/python scripts/compare_methods.py --tiny --model.dtype float64 --train.steps 24 --out /tmp/tiny64

--tiny: the tests' stand-ins (a random tiny Llama, a byte tokenizer, a toy task; seconds per step), for float64
runs that must stay equal to ~1e-10. Any `--section.field value` after the options overrides the config.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from branchreplay.models import load_policy
from branchreplay.reference.float64 import keep_float64
from branchreplay.rl.config import Config, apply_overrides
from branchreplay.rl.run.trainer import Trainer
from branchreplay.tiny_models import tiny_model

EOS = 2


class ByteTokenizer:
    """--tiny's tokenizer (the stand-in of tests/test_rl_run_trainer.py): bytes 3..255 are text, id 2 is EOS, no BOS;
    template 'S:<system>|U:<user>|A:'."""

    eos_token_id = EOS
    bos_token_id = None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "|".join(f"{m['role'][0].upper()}:{m['content'][:24]}" for m in messages)
        return text + ("|A:" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": [max(b, 3) for b in text.encode()]})

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i >= 3).decode("latin-1")


TINY_DATA = [{"question": f"{a}+{b}=?", "answer": str(a + b), "metadata": {}} for a in range(4) for b in range(4)]
"""--tiny's toy task: 16 sums of two digits."""


def byte_reward(completions, **kwargs):
    """--tiny's reward: the fraction of lower-case ASCII letters, so random completions spread over [0, 1]."""
    return [sum(c.islower() for c in text) / max(len(text), 1) for text in completions]


PANELS = [("reward", "reward (mean over the step's rollouts)"), ("eval/accuracy", "held-out accuracy"),
          ("loss", "loss"), ("kl", "KL to the reference (k3)"), ("entropy", "entropy (nats per token)"),
          ("time/step_s", "seconds per step (solid: sampling, dashed: training)"),
          ("param/max_abs_diff", "max |theta - theta_first method|")]


def make_trainer(config: Config, tiny: bool, stack: contextlib.ExitStack) -> Trainer:
    """The run's Trainer. tiny: the stand-ins of tests/test_rl_run_trainer.py (tiny Llama of vocab 256, byte tokenizer,
    toy arithmetic task), as above. In float64 the model computes its RMSNorms in float64 too
    (`reference.float64.keep_float64`; transformers' run in float32), before the Trainer copies it into the reference
    model."""
    dtype = config.model.dtype
    if tiny:
        model, tokenizer = tiny_model("llama", dtype=getattr(torch, dtype), seed=0), ByteTokenizer()
        data = dict(train_data=TINY_DATA, eval_data=TINY_DATA[:8], reward_fn=byte_reward)
    else:
        model, tokenizer = load_policy(config.model.spec, dtype, config.model.device)
        data = {}
    if dtype == "float64":
        stack.enter_context(keep_float64(model))
    return Trainer(config, model=model, tokenizer=tokenizer, **data)


def distance(a: Trainer, b: Trainer) -> dict:
    pa, pb = [p.detach() for p in a.model.parameters()], [p.detach() for p in b.model.parameters()]
    diff = max((x - y).abs().max().item() for x, y in zip(pa, pb, strict=True))
    norm = sum(((x - y).double() ** 2).sum().item() for x, y in zip(pa, pb, strict=True)) ** 0.5
    scale = sum((x.double() ** 2).sum().item() for x in pa) ** 0.5
    return {"param/max_abs_diff": diff, "param/rel_l2_diff": norm / scale}


def plot(rows: list[dict], methods: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(17, 7.5))
    for ax, (key, label) in zip(axes.flat, PANELS, strict=True):
        for k, method in enumerate(methods):
            points = [(r["step"], r[key]) for r in rows if r["method"] == method and r.get(key) is not None]
            if key == "param/max_abs_diff" and k == 0:
                continue
            style = dict(color=f"C{k}", label=method, marker="o" if key == "eval/accuracy" else None, ms=4,
                         lw=1.4 if k == 0 else 1.0, ls="-" if k == 0 else "--")
            if key == "time/step_s":
                sampling = [(r["step"], r["time/sample_s"]) for r in rows if r["method"] == method and r["step"]]
                training = [(r["step"], r["time/train_s"]) for r in rows if r["method"] == method and r["step"]]
                ax.plot(*zip(*sampling, strict=True), color=f"C{k}", label=f"{method} sampling")
                ax.plot(*zip(*training, strict=True), color=f"C{k}", ls="--", label=f"{method} training")
            elif points:
                ax.plot(*zip(*points, strict=True), **style)
        if key == "param/max_abs_diff":
            ax.set_yscale("symlog", linthresh=1e-12)
            largest = max((r[key] for r in rows if r.get(key) is not None), default=0.0)
            ax.set_ylim(0, max(largest * 10, 1e-11))  # a few decades, labelled, also when the distance is constant
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes.flat[-1].axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="YAML config (default: the dataclass defaults; --tiny: the tests' settings)")
    ap.add_argument("--methods", default="branchreplay,naive", help="comma list of train.method values; the "
                    "first is the one the others are compared with")
    ap.add_argument("--out", required=True, help="folder for metrics.jsonl and convergence.png")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny Llama and toy task (nothing downloaded)")
    ap.add_argument("--plot-only", action="store_true", help="summarize and plot OUT/metrics.jsonl as it is (a run "
                    "stopped early)")
    args, overrides = ap.parse_known_args()
    methods = args.methods.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = max(r["step"] for r in rows if r["method"] == methods[-1])
        rows = [r for r in rows if r["step"] <= steps]
        summarize(rows, methods, steps, out, f"{args.config or 'tiny'}: " + " vs ".join(methods) + f", {steps} steps")
        return
    if args.tiny:
        base = {"model": {"spec": "tiny:llama"}, "sampling": {"temperature": 0.7, "max_new_tokens": 6},
                "grpo": {"num_generations": 4, "prompts_per_step": 2, "learning_rate": 1e-2, "beta": 0.05,
                         "lr_scheduler": "constant"},
                "train": {"steps": 24, "eval_steps": 8}}
        config = Config.from_dict(apply_overrides(base, overrides))
    elif args.config:
        config = Config.from_yaml(args.config, overrides)
    else:
        config = Config.from_dict(apply_overrides({}, overrides))
    trainers, stack = {}, contextlib.ExitStack()
    for method in methods:
        cfg = Config.from_dict({**config.to_dict(), "train": {**config.to_dict()["train"], "method": method,
                                                               "log_completions": True,
                                                               "output_dir": str(out / f"run-{method}")}})
        trainers[method] = make_trainer(cfg, args.tiny, stack)
    rows = []
    eval_steps, steps = config.train.eval_steps, config.train.steps
    with open(out / "metrics.jsonl", "w") as log:
        def write(row):
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(" ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                           if k in ("step", "method", "reward", "loss", "kl", "eval/accuracy", "time/sample_s",
                                    "time/train_s", "param/max_abs_diff", "same_completions")), flush=True)

        if eval_steps >= 0:
            for method, t in trainers.items():
                write({"step": 0, "method": method, **t.evaluate()})
        for step in range(1, steps + 1):
            completions = {}
            for method, t in trainers.items():
                t0 = time.perf_counter()
                record = t.train_step(step) or {"step": step}
                t.step = step
                completions[method], t.completion_rows = t.completion_rows, []
                record["time/wall_s"] = time.perf_counter() - t0
                if eval_steps >= 0 and (step == steps or (eval_steps and step % eval_steps == 0)):
                    record.update(t.evaluate())
                first = trainers[methods[0]]
                same = completions[method] == completions[methods[0]]
                write({**record, "method": method, "same_completions": same, **distance(t, first)})
    summarize(rows, methods, steps, out,
              f"{config.model.spec}, {config.model.dtype}, seed {config.train.seed}: " + " vs ".join(methods))


def summarize(rows: list[dict], methods: list[str], steps: int, out: Path, title: str) -> None:
    """OUT/summary.json (steps with identical completions from the start, the largest parameter difference, mean
    seconds per step of each method) and OUT/convergence.png."""
    differ = [r["step"] for r in rows if r.get("same_completions") is False]
    summary = {"methods": methods, "steps": steps,
               "token_identical_steps": min(differ) - 1 if differ else steps,
               "max_param_diff": max(r["param/max_abs_diff"] for r in rows if "param/max_abs_diff" in r)}
    for method in methods:
        mine = [r for r in rows if r["method"] == method and r["step"] > 0]
        for key in ("time/sample_s", "time/train_s", "time/step_s"):
            summary[f"{method} mean {key}"] = sum(r[key] for r in mine if key in r) / max(len(mine), 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    plot(rows, methods, out / "convergence.png", title)


if __name__ == "__main__":
    main()
