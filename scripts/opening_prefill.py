"""A multi-turn step's openings prefilled per item (each item's `decode.forward.prefill` alone, as the sampler did) and
as one radix trie, their shared start once (`decode.forward.prefill_branches`, as `decode.turns.InProcessTurns` prefills
a step's first turn), side by side on SmolLM2-135M-Instruct in float32 (docs/benchmarks.md, "One trie per step"): for
each config, its first grpo.prompts_per_step training items, the two ways alternated --repeats times, each timed with
the resets and the chat template; the median seconds and the positions each prefills.

    .venv/bin/python scripts/opening_prefill.py configs/agent.yaml configs/guess_number.yaml
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from branchreplay.models import load_policy
from branchreplay.rl.agent.conversation import Conversation
from branchreplay.rl.agent.task import bind, load_agent_task
from branchreplay.rl.config.run import Config
from branchreplay.decode.forward import prefill, prefill_branches
from transformers import DynamicCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="+", help="multi-turn run configs (agent.environment set)")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    model, tokenizer = load_policy("smollm2", "float32", "cpu")
    for path in args.configs:
        config = Config.from_yaml(path)
        env, train, _ = load_agent_task(config)
        bind(env, tokenizer)
        items = {k: train[k] for k in range(config.grpo.prompts_per_step)}
        tools = getattr(env, "template_tools", None)
        openings = [Conversation.start(tokenizer, env.reset(item), tools=tools).ids for item in items.values()]

        def per_item():
            for item in items.values():
                prefill(model, Conversation.start(tokenizer, env.reset(item), tools=tools).ids)

        def together():
            ids = [Conversation.start(tokenizer, env.reset(item), tools=tools).ids for item in items.values()]
            prefill_branches(model, DynamicCache(config=model.config), 0, ids)

        fed = []
        hook = model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].numel()), with_kwargs=True)
        with torch.no_grad():
            together()
        hook.remove()

        ways = {"per item": per_item, "together": together}
        times = {name: [] for name in ways}
        with torch.no_grad():
            for r in range(args.repeats):
                for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                    t0 = time.perf_counter()
                    ways[name]()
                    times[name].append(time.perf_counter() - t0)
        a, b = (statistics.median(times[name]) for name in ways)
        print(f"{path}: {len(items)} openings of {min(map(len, openings))}-{max(map(len, openings))} tokens; per "
              f"item {sum(map(len, openings))} positions, {a:.2f} s; together {sum(fed)} positions, {b:.2f} s "
              f"({a / b:.2f}x); median of {args.repeats}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
