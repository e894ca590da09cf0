import sys, time, statistics as st, torch
from branchreplay.bench.runner import BENCH_MODEL, trees_of
from branchreplay.check.padded import padded_backward
from branchreplay.check.shapes import make_rollouts, shared_prompt
from branchreplay.engine import replay_backward, EngineConfig
from branchreplay.losses import GRPOLoss
from branchreplay.models import tiny_model
torch.set_num_threads(int(sys.argv[1])); P, G, R = map(int, sys.argv[2:5])
model = tiny_model("llama", dtype=torch.float32, seed=0, **BENCH_MODEL)
g = torch.Generator().manual_seed(0)
rollouts = make_rollouts(shared_prompt(P, G, R, model.config.vocab_size, g), g)
trees, loss = trees_of(rollouts), GRPOLoss()
fns = {"padded": lambda: padded_backward(model, rollouts, loss),
       "batch": lambda: replay_backward(model, trees, loss, engine=EngineConfig(max_batch_tokens=int(sys.argv[6]))),
       "alone": lambda: replay_backward(model, trees, loss, engine=EngineConfig(max_batch_tokens=1))}
t = {k: [] for k in fns}
for r in range(int(sys.argv[5])):
    for k, f in fns.items():
        s = time.perf_counter(); f(); t[k].append(time.perf_counter() - s); model.zero_grad(set_to_none=True)
for k, v in t.items():
    v = v[2:]; print(k, "min %.4f median %.4f" % (min(v), st.median(v)))
