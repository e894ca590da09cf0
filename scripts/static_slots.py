"""The static cache with a generous max_new_tokens and short replies (docs/benchmarks.md, "The static rows' slots in
buckets"): a randomly initialised model of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads) with a
--vocab vocabulary, float32, whose replies end within a few dozen tokens because --eos-ids of its ids end a reply.
`sample_groups` on --prompts random prompts of 120 tokens x G, each --max-new-tokens, with
sampling.cache_implementation static and dynamic, alternated, --repeats times each: the median wall seconds, the
peak resident memory above the start (one more run each, `bench.measure`), the mean reply length.

Run it from another checkout's sources to time that one (`PYTHONPATH=that/src python scripts/static_slots.py`).

    .venv/bin/python scripts/static_slots.py --max-new-tokens 64 4096
"""

from __future__ import annotations

import argparse
import statistics

import torch

from branchreplay.bench.measure import measure
from branchreplay.tiny_models import tiny_model
from branchreplay.decode.config import SamplingConfig
from branchreplay.decode.loop import sample_groups

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, max_position_embeddings=8192)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-new-tokens", type=int, nargs="+", default=[64, 4096])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--eos-ids", type=int, default=256, help="ids 0 .. N-1 end a reply")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    model = tiny_model("llama", dtype=torch.float32, vocab_size=args.vocab, **SMOLLM2_SHAPE)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(args.eos_ids, args.vocab, (120,), generator=g).tolist() for _ in range(args.prompts)]
    eos = set(range(args.eos_ids))
    for max_new_tokens in args.max_new_tokens:
        lengths = {}

        def run(cache: str, new: int = max_new_tokens) -> None:
            config = SamplingConfig(temperature=1.0, max_new_tokens=new, cache_implementation=cache)
            groups = sample_groups(model, prompts, args.num_generations, config, eos,
                                   [torch.Generator().manual_seed(k) for k in range(len(prompts))])
            replies = [len(s.completion_ids) for group in groups for s in group]
            lengths[cache] = (sum(replies) / len(replies), max(replies))

        times = {cache: [] for cache in ("static", "dynamic")}
        for _ in range(args.repeats):
            for cache in times:
                times[cache].append(measure(lambda: run(cache), model.device, memory=False).seconds)
        for cache, values in times.items():
            peak = measure(lambda: run(cache), model.device).peak_bytes
            mean, longest = lengths[cache]
            print(f"max_new_tokens {max_new_tokens:5d}  {cache:8s} {statistics.median(values):7.2f} s  peak "
                  f"{peak / 2**30:6.2f} GiB above the start  replies {mean:.1f} tokens on average, {longest} at most")


if __name__ == "__main__":
    main()
