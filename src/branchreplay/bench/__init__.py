"""`branchreplay bench`: naive, padded batch, prompt sharing and branch replay side by side, in one process.

`runner` (the methods on one model and workload), `scenarios` (the workloads), `baselines` (padded and prompt
sharing), `flops` (the FLOP formula per method), `measure` (wall time and peak memory), `output` (merge, table,
plot), `state` (the attention state a branch holds, read from the engine).
"""
