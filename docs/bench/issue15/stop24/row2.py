import gc, sys, time, statistics as st, torch
from branchreplay.bench.runner import BENCH_MODEL, trees_of
from branchreplay.check.padded import padded_backward
from branchreplay.check.reference import naive_backward
from branchreplay.check.shapes import make_rollouts, shared_prompt
from branchreplay.engine import replay_backward
from branchreplay.losses import GRPOLoss
from branchreplay.models import tiny_model
torch.set_num_threads(int(sys.argv[1])); P, G, R = map(int, sys.argv[2:5]); use_gc = sys.argv[6] == "gc"
model = tiny_model("llama", dtype=torch.float32, seed=0, **BENCH_MODEL)
g = torch.Generator().manual_seed(0)
rollouts = make_rollouts(shared_prompt(P, G, R, model.config.vocab_size, g), g)
loss = GRPOLoss()
fns = {"naive": lambda: naive_backward(model, rollouts, loss), "padded": lambda: padded_backward(model, rollouts, loss),
       "branchreplay": lambda: replay_backward(model, trees_of(rollouts), loss)}
t = {k: [] for k in fns}
for r in range(int(sys.argv[5])):
    for k, f in fns.items():
        model.zero_grad(set_to_none=True)
        if use_gc: gc.collect()
        s = time.perf_counter(); f(); t[k].append(time.perf_counter() - s)
for k, v in t.items():
    v = v[2:]; print(k, "min %.4f median %.4f" % (min(v), st.median(v)))
