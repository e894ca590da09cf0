"""Prompt sharing, exact (the gradients of the naive per-rollout computation, `naive.naive_backward`, to
floating-point tolerance): a baseline of `branchreplay bench` (its peak: `memory.py`).

prompt_sharing_backward: prompt-only sharing, as Prefix Grouper (Liu et al. 2025, arXiv:2506.05433; PyPI
`prefix-grouper`, verl `use_prefix_grouper`): each group's shared prompt runs once, every suffix against the prompt's
K/V repeated once per suffix, whose gradients sum back into the prompt's K/V through autograd; impl="prefix-grouper"
runs the package itself (its attention function over our SDPA adapter, `_pg_sdpa`), impl="equivalent" our own with
transformers' cache. A rollout's prompt: its positions before the first trained one (`padded.prompt_length`), as TRL
splits prompt and completion; rollouts with identical prompts form a group.
Design notes: docs/benchmarks.md ("Reading the tables").
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..losses import LossFn
from ..tree import ReplayResult, Rollout
from .padded import prompt_length, row_losses

PROMPT_SHARING_LABELS = {
    "prefix-grouper": "prompt-sharing (prefix-grouper {version}, prefix K/V repeated per suffix; SDPA adapter)",
    "equivalent": "prompt-sharing (prefix-grouper-equivalent, prefix K/V repeated per suffix)",
}


def prompt_groups(rollouts: list[Rollout]) -> list[tuple[int, list[int]]]:
    """(prompt length P, indices of the rollouts) per distinct prompt, in order of first appearance."""
    groups: dict[tuple, tuple[int, list[int]]] = {}
    for i, r in enumerate(rollouts):
        P = prompt_length(r)
        groups.setdefault((P, tuple(r.token_ids[:P].tolist())), (P, []))[1].append(i)
    return list(groups.values())


# -----------------------------------------------------------------------------
# prompt sharing (prefix-grouper and its equivalent)

def prompt_sharing_backward(model, rollouts: list[Rollout], loss: LossFn, *, temperature: float = 1.0,
                            impl: str = "equivalent") -> ReplayResult:
    """Prompt-only sharing: per group of rollouts with the same prompt, the prompt once and the G suffixes as one
    batch against the prompt's K/V repeated G times; one backward per group, gradients into `param.grad`.

    impl: "prefix-grouper" (the PyPI package; raises ImportError if it is not installed) or "equivalent".
    """
    if impl not in PROMPT_SHARING_LABELS:
        raise ValueError(f"impl must be one of {sorted(PROMPT_SHARING_LABELS)}, got {impl!r}")
    logprobs = [torch.zeros(len(r), dtype=torch.float32) for r in rollouts]
    entropy = [torch.zeros(len(r), dtype=torch.float32) for r in rollouts]
    total = 0.0
    run = _suffixes_prefix_grouper if impl == "prefix-grouper" else _suffixes_equivalent
    for P, members in prompt_groups(rollouts):
        suffixes = [rollouts[i].token_ids[P:] for i in members]
        predictors = run(model, rollouts[members[0]].token_ids[:P], suffixes)  # [G, S_max, H]
        S_max = predictors.shape[1]
        targets = torch.stack([torch.nn.functional.pad(s, (0, S_max - len(s))) for s in suffixes]).to(model.device)
        rows = [(g, torch.arange(len(s), device=model.device)) for g, s in enumerate(suffixes)]
        group = [rollouts[i] for i in members]
        # the LM head runs on the valid rows only (the rows predicting suffix tokens), inside row_losses
        result = row_losses(predictors, targets, group, [P] * len(group), rows, loss, temperature,
                             head=model.get_output_embeddings())
        for i, lp, ent in zip(members, result.logprobs, result.entropy, strict=True):
            logprobs[i], entropy[i] = lp, ent
        total += result.loss
    return ReplayResult(logprobs, entropy, total, None)


def _suffixes_equivalent(model, prompt: torch.Tensor, suffixes: list[torch.Tensor]) -> torch.Tensor:
    """Prompt [P] once with a cache; suffixes as one right-padded [G, S_max] batch against the prompt's K/V
    expanded to G rows (the cache's concatenation copies it: one copy per suffix, as Prefix Grouper's repeat).
    Returns the hidden states predicting each suffix token, [G, S_max, H] (row j predicts suffix token j)."""
    decoder = getattr(model, model.base_model_prefix)
    device, P, G = model.device, len(prompt), len(suffixes)
    S_max = max(len(s) for s in suffixes)
    out = decoder(input_ids=prompt[None].to(device), position_ids=torch.arange(P, device=device)[None],
                  use_cache=True)
    kv = [(layer.keys.expand(G, -1, -1, -1), layer.values.expand(G, -1, -1, -1)) for layer in out.cache.layers]
    cache = DynamicCache(ddp_cache_data=kv, config=model.config)
    ids = torch.stack([torch.nn.functional.pad(s, (0, S_max - len(s))) for s in suffixes]).to(device)
    mask = torch.zeros((G, P + S_max), dtype=torch.long, device=device)
    mask[:, :P] = 1
    for g, s in enumerate(suffixes):
        mask[g, P : P + len(s)] = 1
    position_ids = (P + torch.arange(S_max, device=device))[None].expand(G, -1)
    hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=position_ids, cache=cache,
                     use_cache=True).last_hidden_state  # [G, S_max, H]
    last = out.last_hidden_state[:, -1:].expand(G, -1, -1)  # the prompt's last position predicts suffix token 0
    return torch.cat([last, hidden[:, :-1]], dim=1)


_PG_ATTENTION = "branchreplay_prefix_grouper_sdpa"
_pg_masks: dict = {}


def _pg_sdpa(module, query, key, value, padding_mask, *args, **kwargs):
    """The attention function Prefix Grouper calls, as flash-attention would run it, on CPU-capable SDPA.

    Prefix Grouper hands it q [b, h, Lq, d], k/v [b, h_kv, Lk, d] and a 2D [b, Lk] padding mask, and relies on
    flash-attention's causal alignment to the bottom right (query i sits at key position Lk - Lq + i). Its own
    transformers registration calls `flash_attention_2` (CUDA only); passing its 2D mask to transformers' `sdpa`
    is wrong (the mask broadcasts as non-causal, or fails on shapes). Here the 2D mask becomes the 4D boolean
    mask SDPA needs (built once per forward and reused by every layer), or none when it is a plain causal square.
    """
    Lq, Lk = query.shape[2], key.shape[2]
    kwargs.pop("is_causal", None)
    if Lq == Lk and bool(padding_mask.all()):
        return transformers_sdpa()(module, query, key, value, None, *args, is_causal=True, **kwargs)
    memo = (padding_mask.data_ptr(), tuple(padding_mask.shape), Lq, Lk)
    if memo not in _pg_masks:
        q_pos = torch.arange(Lq, device=query.device)[:, None] + (Lk - Lq)
        causal = torch.arange(Lk, device=query.device)[None] <= q_pos  # [Lq, Lk]
        _pg_masks[memo] = (causal[None] & padding_mask.bool()[:, None, :])[:, None]  # [b, 1, Lq, Lk]
    return transformers_sdpa()(module, query, key, value, _pg_masks[memo], *args, is_causal=False, **kwargs)


def transformers_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def prefix_grouper_version() -> str | None:
    """The installed prefix-grouper's version, or None when it is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("prefix-grouper")
    except PackageNotFoundError:
        return None


def _suffixes_prefix_grouper(model, prompt: torch.Tensor, suffixes: list[torch.Tensor]) -> torch.Tensor:
    """Prefix Grouper's own path: `concat_input` packs [prompt, suffix_1, ..., suffix_G] into one row, position ids
    restart at P for each suffix, its attention function (registered with transformers) runs the prompt causally
    and each suffix against `repeat_interleave`d prompt K/V, `split_output(include_prefix_last=1)` unpacks.
    Returns [G, S_max, H] like `_suffixes_equivalent`."""
    from prefix_grouper import PrefixGrouper
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface

    register_attention()  # "prefix_grouper_attention"
    AttentionInterface.register(_PG_ATTENTION, _pg_sdpa)
    decoder = getattr(model, model.base_model_prefix)
    device, P, G = model.device, len(prompt), len(suffixes)
    S_max = max(len(s) for s in suffixes)
    prompt_mask = torch.ones((1, P), dtype=torch.bool, device=device)
    suffix_ids = torch.zeros((G, S_max), dtype=torch.long, device=device)
    suffix_mask = torch.zeros((G, S_max), dtype=torch.bool, device=device)
    for g, s in enumerate(suffixes):
        suffix_ids[g, : len(s)] = s.to(device)
        suffix_mask[g, : len(s)] = True
    pg = PrefixGrouper.from_ungrouped_masks(prompt_mask, suffix_mask, group_sizes=G, padding_mode="right",
                                            device=device)
    ids = pg.concat_input(prompt[None].to(device), prompt_mask, suffix_ids, suffix_mask)  # [1, P + sum S]
    position_ids = torch.cat([torch.arange(P)] + [torch.arange(P, P + len(s)) for s in suffixes])[None].to(device)
    previous = model.config._attn_implementation
    model.set_attn_implementation("prefix_grouper_attention")
    try:
        hidden = decoder(input_ids=ids, position_ids=position_ids, use_cache=False, prefix_grouper=pg,
                         prefix_grouper_attn_func=_PG_ATTENTION).last_hidden_state  # [1, P + sum S, H]
    finally:
        model.set_attn_implementation(previous)
        _pg_masks.clear()
    _, _, suffix_hidden, _ = pg.split_output(hidden, include_prefix_last=1)  # [G, S_max + 1, H]
    return suffix_hidden[:, :-1]
