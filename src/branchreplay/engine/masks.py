"""Tree masks of a pack: which keys each query of a pack of sibling nodes may see. Pure functions of positions.

A pack is the concatenated tokens of sibling nodes starting at position P, run as one query sequence. Per query:
`local` [S] is its position within its node, `segment` [S] the index of its node in the pack. A query (segment s,
absolute position P + t) sees every prefix key and the keys of its own segment at positions <= P + t, and, in a
sliding-window layer, only keys k with q - k < window (transformers' `sliding_window_overlay`).

Masks are additive (0 where allowed, the dtype's minimum elsewhere), [1, 1, S, K] in the model's dtype: eager
attention adds the mask, so a boolean one would be silently wrong.
"""

from __future__ import annotations

import torch

from .cache import kept_positions
from .families import Chunk


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean [S, K] -> additive mask [1, 1, S, K] of `dtype` on the same device."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


def own_keys_tree_mask(local: torch.Tensor, segment: torch.Tensor, dtype: torch.dtype,
                       blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Tree mask [1, 1, S, S] over a pack's own keys (for split prefix attention, `attention.py`): a query sees the
    earlier or equal positions of its own segment, and all of its own image block (`blocks`, see `tree_mask`)."""
    same = segment[None] == segment[:, None]
    return additive(same & ((local[None] <= local[:, None]) | same_block(blocks)), dtype)


def same_block(blocks: torch.Tensor | None) -> torch.Tensor | bool:
    """[S, S] whether query and key lie in one image block (`blocks` [S]: block id, -1 for text; transformers'
    `blockwise_overlay`), False without blocks."""
    if blocks is None:
        return False
    return (blocks[None] == blocks[:, None]) & (blocks[:, None] >= 0)


def takes_tree_mask(num_nodes: int, P: int, recurrent: bool) -> bool:
    """Whether a pack of `num_nodes` nodes at position P takes the engine's tree mask. A root alone takes
    transformers' causal mask, which SDPA can skip; so do the single-node packs of recurrent families (whose SSM
    layers read a 2D mask). Otherwise ours: one additive tensor that every layer shares, where transformers' boolean
    mask is converted, and saved for backward, once per layer by SDPA (4x the memory on a 4-layer model)."""
    return num_nodes > 1 or (P > 0 and not recurrent)


def tree_mask(P: int, local: torch.Tensor, segment: torch.Tensor, windows: list[int | None], dtype: torch.dtype,
              mask_mapping: bool, blocks: torch.Tensor | None = None):
    """Tree mask [1, 1, S, K + S] of a pack at position P, per distinct window of `windows` (per decoder layer, None
    for full attention). The K prefix keys are those the layer's cache serves (`cache.kept_positions`): all P in a
    full layer, the last window - 1 in a sliding one, at their absolute positions. `blocks` [S]: each query's image
    block id (-1 for text, `vision.py`): a query also sees the later keys of its own block, in sliding layers within
    the window (transformers' Gemma3 masks: full OR(causal, block), sliding AND(window, OR(causal, block))).

    Returns {"full_attention": mask, "sliding_attention": mask} (those present) when the decoder takes a mask
    mapping (and "chunked_attention" for `families.Chunk` layers: keys of the query's own chunk), else the one
    mask. Raises ValueError when layers mix windows but the decoder takes one mask."""
    device = local.device
    q_pos = P + local

    def build(window):
        kept = kept_positions(P, window)
        k_pos = torch.cat([torch.arange(P - kept, P, device=device), q_pos])
        k_seg = torch.cat([torch.full((kept,), -1, device=device), segment])
        own = k_seg[None] == segment[:, None]
        allowed = (k_seg[None] == -1) | (own & (k_pos[None] <= q_pos[:, None]))
        if blocks is not None:  # the pack's own keys only: an image block lies inside one node
            allowed[:, kept:] |= own[:, kept:] & same_block(blocks)
        if isinstance(window, Chunk):  # transformers' `chunked_overlay`: the query's own block of C positions
            allowed = allowed & (k_pos[None] // window == q_pos[:, None] // window)
        elif window is not None:
            allowed = allowed & (q_pos[:, None] - k_pos[None] < window)
        return additive(allowed, dtype)

    kinds = {w: build(w) for w in set(windows)}
    if mask_mapping:
        full = kinds.get(None)
        sliding = next((m for w, m in kinds.items() if w is not None and not isinstance(w, Chunk)), None)
        chunked = next((m for w, m in kinds.items() if isinstance(w, Chunk)), None)
        return {k: m for k, m in (("full_attention", full), ("sliding_attention", sliding),
                                  ("chunked_attention", chunked)) if m is not None}
    if len(kinds) > 1:
        raise ValueError(f"layers mix windows {sorted(kinds, key=str)} but the decoder takes one mask")
    return next(iter(kinds.values()))
