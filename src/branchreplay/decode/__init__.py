"""In-process generation: a step's groups sampled with each prompt (and each shared start) prefilled once.

    sample_groups(model, prompts, G, SamplingConfig(...), eos_ids, generators)   # one list of Samples per prompt

Modules: `config` (`SamplingConfig`, the `sampling` section of the run config; torch-free), `loop` (the decoding
loop: branching forks, finished streams dropped), `draw` (top-k / top-p filtering and the inverse-transform draw),
`forward` (prefill, a trie of branches, one decoding step, cache forks), `rows/` (where the streams of several groups
decode, and the rule that chooses: the plain Llama step, a static cache, transformers' dynamic cache),
`packed_linears` (MKL-packed weights while sampling on the CPU), `turns` (multi-turn replies, a conversation's cache
kept from turn to turn). It runs the model and the engine's attention; it knows nothing of RL.
"""
