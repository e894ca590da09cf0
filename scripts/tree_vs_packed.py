"""One shared-prompt configuration three ways, interleaved in one process: TRL's padded batch, the engine forced
into the dense packed schedule (every rollout alone) and forced into the tree (every shared node kept). Prints the
schedule the defaults pick, then min / median seconds of each after 2 warm-up rounds: what the schedule's cost model
(`engine/schedule.py`) is checked against.

    .venv/bin/python scripts/tree_vs_packed.py 2 64 8 256 12      # threads P G R rounds
"""

import gc
import statistics as st
import sys
import time

import torch

from branchreplay.bench.runner import Bench, BenchOptions, trees_of
from branchreplay.reference.shapes import make_rollouts, shared_prompt
from branchreplay.engine import EngineConfig, replay_backward
from branchreplay.engine.config import EVERY_SHARED_NODE

torch.set_num_threads(int(sys.argv[1]))
P, G, R = map(int, sys.argv[2:5])
rounds = int(sys.argv[5])
b = Bench(BenchOptions(methods=("naive", "padded", "branchreplay")))
b.warm_up()
g = torch.Generator().manual_seed(0)
rollouts = make_rollouts(shared_prompt(P, G, R, b.model.config.vocab_size, g), g)
fns = {"padded": lambda: b.call("padded", rollouts),
       "packed": lambda: replay_backward(b.model, trees_of(rollouts), b.loss,
                                         engine=EngineConfig(pack_overhead_tokens=10**9)),
       "tree": lambda: replay_backward(b.model, trees_of(rollouts), b.loss, engine=EngineConfig(**EVERY_SHARED_NODE))}
print(replay_backward(b.model, trees_of(rollouts), b.loss).schedule, end=" default; ")
t = {k: [] for k in fns}
for r in range(rounds):
    order = list(fns) if r % 2 == 0 else list(fns)[::-1]
    for k in order:
        b.model.zero_grad(set_to_none=True)
        gc.collect()
        s = time.perf_counter()
        fns[k]()
        t[k].append(time.perf_counter() - s)
print(f"threads {sys.argv[1]} P={P} G={G} R={R}:",
      ", ".join(f"{k} {min(v[2:]):.4f}/{st.median(v[2:]):.4f}" for k, v in t.items()))
