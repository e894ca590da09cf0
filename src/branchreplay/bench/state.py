"""The attention state a branch holds for its prefix: bounded by the window W in sliding-window layers, growing with
the prefix length P in full-attention layers.

Read from the engine itself, not computed from a formula: while `replay_logprobs` runs one prompt of P tokens
with a few short branches, every `PrefixCache` the engine builds records the bytes of the ancestors' `NodeState`s
it is given (the K/V kept along the branch's path, which the execution stack holds until the branch's backward);
the figure is the largest such total. The prompt runs as one node (chunk_tokens = P): with chunks of c < P tokens
every chunk on the path keeps its own last W - 1 positions, so a sliding layer holds ceil(P / c) * (W - 1).

    python -m branchreplay.bench.state      # Mistral tiny (W = 16) vs Llama tiny, P = 256, 1024, 4096
"""

from __future__ import annotations

import torch

from ..engine import EngineConfig, replay_logprobs
from ..engine.cache import observe_states
from ..engine.families import layer_windows, state_bytes_per_token
from ..tiny_models import tiny_model
from ..tree import Rollout, RolloutTree


def kept_state_bytes(model, prompt_tokens: int, branches: int = 2, branch_tokens: int = 8, seed: int = 0) -> int:
    """Bytes of ancestor K/V the engine hands a branch of a prompt of `prompt_tokens` tokens (see the module
    docstring): the largest total over the `PrefixCache`s built while `replay_logprobs` runs the prompt and
    `branches` branches of `branch_tokens` tokens each (random tokens, seeded)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=g).tolist()
    rollouts = [
        Rollout(prompt + torch.randint(0, vocab, (branch_tokens,), generator=g).tolist(),
                [0] * prompt_tokens + [1] * branch_tokens)
        for _ in range(branches)
    ]
    seen: list[int] = []

    def record(ancestors):
        seen.append(sum(t.numel() * t.element_size() for state in ancestors for layer in state for t in layer))

    with observe_states(record):
        replay_logprobs(model, RolloutTree(rollouts), engine=EngineConfig(chunk_tokens=prompt_tokens))
    return max(seen)


def state_rows(prompt_lengths=(256, 1024, 4096), archs=("mistral", "llama"), dtype=torch.float32) -> list[dict]:
    """One row per (arch, P): the bytes the engine held and what `state_bytes_per_token` predicts for them
    (full-layer bytes per token * P + min(P, W - 1) positions of the sliding layers, which share one W here)."""
    rows = []
    for arch in archs:
        model = tiny_model(arch, dtype=dtype, max_position_embeddings=max(prompt_lengths) + 64)
        full, sliding = state_bytes_per_token(model.config, dtype)
        w = min((w for w in layer_windows(model.config) if w is not None), default=None)
        for P in prompt_lengths:
            predicted = full * P + (sliding * min(P, w - 1) // (w - 1) if w else 0)
            rows.append(dict(arch=arch, window=w, prompt_tokens=P, kept_bytes=kept_state_bytes(model, P),
                             predicted_bytes=predicted))
    return rows


def format_state_table(rows: list[dict]) -> str:
    """The rows as a small text table: prompt length down, one column of kept bytes per arch."""
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    label = {a: f"{a} (W={r['window']})" if r["window"] else f"{a} (full)" for a in archs for r in rows
             if r["arch"] == a}
    lines = [f"{'P':>6}" + "".join(f"{label[a]:>22}" for a in archs)]
    for P in dict.fromkeys(r["prompt_tokens"] for r in rows):
        cells = {r["arch"]: r["kept_bytes"] for r in rows if r["prompt_tokens"] == P}
        lines.append(f"{P:>6}" + "".join(f"{cells[a]:>22,}" for a in archs))
    return "\n".join(lines)


if __name__ == "__main__":
    print("bytes of attention K/V kept for a branch of a P-token prompt (tiny models, float32)")
    print(format_state_table(state_rows()))
