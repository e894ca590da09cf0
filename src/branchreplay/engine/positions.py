"""Position limits and rotary encodings whose frequencies depend on the length of the forward call.

transformers' `dynamic_rope_update` (modeling_rope_utils.py, transformers 5.24) recomputes a rotary embedding's
frequencies on every call from `seq_len = max(position_ids) + 1` of THAT call: "longrope" (Phi-3; PhiMoE's cos/sin
scale too) takes its long factors when seq_len > original_max_position_embeddings; "dynamic" (dynamic NTK) scales
its base when seq_len > max_position_embeddings and keeps the largest seq_len seen until a call below resets it, so
its output depends on earlier calls. Every other rotary type, and the Llama-4 style attention scale, is the same
whatever the forward's length. The engine runs a rollout's positions in several calls, so a rollout's REGIME is
what its full forward uses (`regime`), the rollouts of one regime run together (`regimes`), and
`held_at_length(model, T)` makes every rotary call see seq_len = T (one position T - 1 appended to the position ids,
its cos / sin dropped) from a fresh dynamic state.
Design notes and measurements: docs/notes/execution-stack.md.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence

import torch


def _types_of(module) -> dict[str | None, str]:
    """{layer type or None: rope type} of a rotary embedding module (Gemma-style modules key them by layer type)."""
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, str):
        return {None: rope_type}
    return dict(rope_type) if isinstance(rope_type, dict) else {}


def _length_dependent(rope_type: str) -> bool:
    """Whether transformers picks this rotary type's frequencies per call from the call's length: "longrope" and
    the "dynamic" types (module docstring)."""
    return rope_type == "longrope" or "dynamic" in rope_type


def length_dependent_rotaries(model) -> list[torch.nn.Module]:
    """The rotary embedding modules of `model` whose frequencies depend on the forward's length."""
    return [m for m in model.modules() if any(_length_dependent(t) for t in _types_of(m).values())]


def _rope_parameters(module, layer_type: str | None) -> dict:
    params = module.config.rope_parameters
    return params[layer_type] if layer_type is not None else params


def regime(rotaries: Sequence[torch.nn.Module], length: int) -> tuple:
    """What a full forward of `length` tokens selects in each of `rotaries`: for longrope, whether it takes the long
    factors (length > original_max_position_embeddings); for dynamic, the length it scales for (0 at or below
    max_position_embeddings, where the original frequencies apply). Rollouts of one regime share every rotary value.
    """
    key = []
    for module in rotaries:
        for layer_type, rope_type in _types_of(module).items():
            if rope_type == "longrope":
                key.append(length > _rope_parameters(module, layer_type)["original_max_position_embeddings"])
            elif "dynamic" in rope_type:
                key.append(length if length > module.original_max_seq_len else 0)
    return tuple(key)


def regimes(rotaries: Sequence[torch.nn.Module], lengths: Sequence[int]) -> list[tuple[int, list[int]]]:
    """Rollout indices grouped by `regime`, in order of first appearance: [(a length of the regime, indices)]."""
    groups: dict[tuple, list[int]] = {}
    for i, length in enumerate(lengths):
        groups.setdefault(regime(rotaries, length), []).append(i)
    return [(max(lengths[i] for i in members), members) for members in groups.values()]


def rope_thresholds(model) -> dict[str, int]:
    """The rollout lengths (tokens) past which a rotary embedding of `model` changes its frequencies, by name:
    "longrope original_max_position_embeddings" and "dynamic max_position_embeddings" (a layer type, for models
    that key their rotary parameters by one, is added in brackets)."""
    out = {}
    for module in length_dependent_rotaries(model):
        for layer_type, rope_type in _types_of(module).items():
            where = "" if layer_type is None else f" [{layer_type}]"
            if rope_type == "longrope":
                n = _rope_parameters(module, layer_type)["original_max_position_embeddings"]
                out[f"longrope original_max_position_embeddings{where}"] = n
            elif "dynamic" in rope_type:
                out[f"dynamic max_position_embeddings{where}"] = module.original_max_seq_len
    return out


def _reset_dynamic(module) -> None:
    for layer_type, rope_type in _types_of(module).items():
        if "dynamic" in rope_type:
            prefix = "" if layer_type is None else f"{layer_type}_"
            setattr(module, f"{prefix}inv_freq", getattr(module, f"{prefix}original_inv_freq").clone())
            setattr(module, f"{prefix}max_seq_len_cached", module.original_max_seq_len)


def _snapshot(module) -> dict:
    """The mutable state a rotary forward may change: its buffers (cloned: longrope updates them in place) and its
    plain attributes (cached length, attention scale, the long frequencies it builds lazily)."""
    return {
        "buffers": {name: b.clone() for name, b in module.named_buffers(recurse=False)},
        "attributes": {k: v for k, v in vars(module).items() if not k.startswith("_")},
    }


def _restore(module, snapshot: dict) -> None:
    for name in [k for k in vars(module) if not k.startswith("_") and k not in snapshot["attributes"]]:
        delattr(module, name)
    for name, value in snapshot["attributes"].items():
        setattr(module, name, value)
    for name, value in snapshot["buffers"].items():
        setattr(module, name, value)  # a registered buffer stays one, with its persistence


def _forced_forward(module, length: int):
    """`module.forward` seeing seq_len = length in every call (position length - 1 appended, its outputs dropped),
    from a fresh dynamic state each time."""
    original = type(module).forward

    def forward(self, x, position_ids, *args, **kwargs):
        _reset_dynamic(self)  # each call as the first one: a call with larger positions cannot leave its frequencies
        last = position_ids.new_full((*position_ids.shape[:-1], 1), length - 1)
        outputs = original(self, x, torch.cat([position_ids, last], dim=-1), *args, **kwargs)
        S = position_ids.shape[-1]
        if not all(isinstance(o, torch.Tensor) and o.shape[-2] == S + 1 for o in outputs):
            raise RuntimeError(f"{type(self).__name__} returned outputs not shaped [..., positions, dim]: cannot hold "
                               "its length-dependent frequencies at the rollout's length")
        return tuple(o[..., :S, :] for o in outputs)

    return types.MethodType(forward, module)


@contextlib.contextmanager
def held_at_length(model, length: int, rotaries: Sequence[torch.nn.Module] | None = None) -> Iterator[None]:
    """While inside, every length-dependent rotary embedding of `model` computes cos / sin as in a single forward
    of `length` positions from a fresh dynamic state (a call whose positions reach past `length - 1`, such as the
    planner's memory probe, sees its own length); on exit each module is restored exactly as it was.
    A model without such embeddings is left untouched."""
    rotaries = length_dependent_rotaries(model) if rotaries is None else rotaries
    snapshots = [_snapshot(m) for m in rotaries]
    try:
        for module in rotaries:
            _reset_dynamic(module)
            module.forward = _forced_forward(module, length)
        yield
    finally:
        for module, snapshot in zip(rotaries, snapshots, strict=True):
            vars(module).pop("forward", None)
            _restore(module, snapshot)
