"""Llama 4's attention temperature tuning under the execution stack: `QueryTemperature`.

A Llama4TextAttention layer without RoPE (`config.no_rope_layers`), with `config.attn_temperature_tuning`, scales
its queries at position p by

    1 + attn_scale * log1p(floor((p + 1) / floor_scale))

(float32, then times the queries and cast back to their dtype: transformers' modeling_llama4.py). transformers takes
p = cache.get_seq_length() + i for the i-th query of the forward: right for one sequence and for the rows of a
batch that all start at P, wrong for a pack of several sibling nodes run as one query sequence, whose i-th query
sits at P + its index within its node. While the engine runs a forward, `QueryTemperature.at(position_ids)` turns
the layers' own scaling off (`attn_temperature_tuning`, an instance attribute, restored on exit) and applies the
same scale at the pack's position ids with a forward hook on their `q_proj` (removed on exit). Those layers have no
query norm (transformers norms the queries of RoPE layers only), so scaling the projection is scaling the queries.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

_scaling: weakref.WeakSet = weakref.WeakSet()  # the layers a `QueryTemperature.at` scales right now
_lock = threading.Lock()


def _tuned_layers(model) -> list[torch.nn.Module]:
    """The attention modules of `model` that scale their queries by position (module docstring)."""
    return [m for m in model.modules() if type(m).__name__ == "Llama4TextAttention"
            and getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True)]


class QueryTemperature:
    """The temperature-tuned attention layers of `model` (none for any other family: `at` is then a no-op).

    Raises:
        RuntimeError: such a layer also norms its queries (`qk_norm`), which would come after the scale.
    """

    def __init__(self, model: torch.nn.Module):
        self.layers = _tuned_layers(model)
        if any(hasattr(m, "qk_norm") for m in self.layers):
            raise RuntimeError("a Llama 4 NoPE layer norms its queries after the temperature scale: the engine cannot "
                               "apply the scale at the pack's positions; report the model")

    @contextlib.contextmanager
    def at(self, position_ids: torch.Tensor) -> Iterator[None]:
        """While inside, each tuned layer scales its queries at `position_ids` [rows, S] (the decoder's, rows 1 or
        the forward's batch) instead of at transformers' guess. Raises ValueError for position ids of another
        shape (multimodal rotary positions), RuntimeError while another `at` scales the same layers."""
        if not self.layers:
            yield
            return
        if position_ids.dim() != 2:
            raise ValueError(f"temperature tuning takes position ids [rows, S], got {tuple(position_ids.shape)}")
        with _lock:
            if any(layer in _scaling for layer in self.layers):
                raise RuntimeError("two engine forwards at once on one Llama 4 model (threads, or a forward inside "
                                   "another's): its query temperature would be applied twice; run them one at a time")
            _scaling.update(self.layers)
        handles, switched = [], []
        try:
            for layer in self.layers:
                scale = (torch.log1p(torch.floor((position_ids.float() + 1.0) / layer.floor_scale)) * layer.attn_scale
                         + 1.0)[..., None]  # [rows, S, 1] float32, as transformers computes it
                handles.append(layer.q_proj.register_forward_hook(
                    lambda module, args, out, scale=scale: (out * scale).to(out.dtype)))
                switched.append((layer, layer.__dict__["attn_temperature_tuning"]))
                layer.attn_temperature_tuning = False
            yield
        finally:
            for handle in handles:
                handle.remove()
            for layer, previous in switched:
                layer.attn_temperature_tuning = previous
            with _lock:
                for layer in self.layers:
                    _scaling.discard(layer)
