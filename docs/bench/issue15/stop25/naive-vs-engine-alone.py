import sys, torch, time, statistics as st
from torch.profiler import profile, ProfilerActivity
from branchreplay.bench.runner import Bench, BenchOptions
from branchreplay.check.shapes import make_rollouts, shared_prompt
torch.set_num_threads(int(sys.argv[1])); P, G, R = map(int, sys.argv[2:5])
b = Bench(BenchOptions(methods=("naive", "padded", "branchreplay")))
b.warm_up()
g = torch.Generator().manual_seed(0)
rollouts = make_rollouts(shared_prompt(P, G, R, b.model.config.vocab_size, g), g)
t = {k: [] for k in ("naive", "branchreplay")}
for i in range(int(sys.argv[5])):
    for k in (t if i % 2 == 0 else list(t)[::-1]):
        s = time.perf_counter(); b.call(k, rollouts); t[k].append(time.perf_counter() - s)
print({k: (round(min(v), 4), round(st.median(v), 4)) for k, v in t.items()})
for k in (t if len(sys.argv) < 7 else []):
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(2): b.call(k, rollouts)
    print("=====", k)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=16))
