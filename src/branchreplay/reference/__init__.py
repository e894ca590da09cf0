"""The ground floor: other ways to compute the execution stack's gradient, each exact, none using the engine.

Modules: `naive` (each rollout alone through the unmodified Hugging Face forward: the reference of every exactness
check), `padded` (TRL's padded batch), `prompt_sharing` (each group's prompt once, as Prefix Grouper), `methods` (the
table of them by name, for `train.method` and the benchmark), `work` (the FLOPs each method computes), `memory` (their
estimated peaks), `shapes` (synthetic rollout sets of known shapes) and `float64` (Hugging Face's float32 casts made
float64 inside a `with` block, for exactness checks).
"""
