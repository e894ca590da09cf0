"""Build a DPO preference set from the default task: sample the policy, keep a correct and an incorrect answer per
prompt. The pairs of docs/dpo.md ("On SmolLM2") and docs/training.md ("DPO on preference pairs").

For each of the first --prompts questions of the train split (TaskConfig's default task), the policy samples --g
completions at temperature 1 (the trainer's sampler, `decode.loop.sample_group`, one seed per prompt); the
task's verifier scores them (`rl.data.rewards.make_reward`). A prompt with at least one completion scoring the maximum
and one scoring less gives one row, TRL's conversational preference format:

    {"prompt": [system and user messages, as the trainer's], "chosen": [{"role": "assistant", "content": ...}],
     "rejected": [{"role": "assistant", "content": ...}]}

chosen is the first best completion, rejected the first worse one. The text is decoded from the sampled ids, so
`branchreplay train --algorithm dpo` re-tokenizes it through the chat template (as TRL does with any preference
file). Prompts whose completions all score the same give no row; the counts are printed.

Run:  .venv/bin/python scripts/make_preference_set.py [--prompts 96] [--g 8] [--out runs/preferences.jsonl]
      then: .venv/bin/branchreplay train --config configs/dpo.yaml
About 5 s per prompt on 2 idle CPU cores (SmolLM2, G=8, 48 new tokens); the file is a few hundred kB, not committed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from branchreplay.decode.config import SamplingConfig
from branchreplay.decode.loop import eos_token_ids, sample_group
from branchreplay.models import chat_prompt_ids, load_policy
from branchreplay.rl.data.rewards import make_reward, score
from branchreplay.rl.data.tasks import TaskConfig, build_messages, load_task


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default="smollm2", help="model spec, as model.spec")
    parser.add_argument("--prompts", type=int, default=96, help="train questions to sample, from the first")
    parser.add_argument("--g", type=int, default=8, help="completions per question")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/preferences.jsonl")
    args = parser.parse_args()

    model, tokenizer = load_policy(args.model)
    train, _ = load_task(TaskConfig())
    reward = make_reward("task", train)
    sampling, eos = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens), eos_token_ids(model, tokenizer)
    rows, same, start = [], 0, time.perf_counter()
    for k in range(min(args.prompts, len(train))):
        item = train[k]
        messages = build_messages(item["question"])
        generator = torch.Generator(model.device).manual_seed(args.seed * 1_000_003 + k)
        with torch.no_grad():
            samples = sample_group(model, chat_prompt_ids(tokenizer, messages), args.g, sampling, eos, generator)
        rewards = score(reward, tokenizer, [item], [samples]).tolist()
        if (k + 1) % 8 == 0:
            print(f"{k + 1} prompts, {len(rows)} pairs, {time.perf_counter() - start:.0f} s", file=sys.stderr)
        best = max(rewards)
        chosen = next((s for s, r in zip(samples, rewards, strict=True) if r == best), None)
        rejected = next((s for s, r in zip(samples, rewards, strict=True) if r < best), None)
        if rejected is None:
            same += 1
            continue
        text = [tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in (chosen, rejected)]
        rows.append({"prompt": messages, "chosen": [{"role": "assistant", "content": text[0]}],
                     "rejected": [{"role": "assistant", "content": text[1]}]})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{out}: {len(rows)} pairs from {min(args.prompts, len(train))} prompts ({same} with equal rewards, "
          f"skipped) in {time.perf_counter() - start:.0f} s; a DPO step takes dpo.pairs_per_step of them (8 by "
          "default), all of them when there are fewer")


if __name__ == "__main__":
    main()
