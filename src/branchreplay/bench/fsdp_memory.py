"""The parameter and gradient bytes a rank holds during an FSDP2 step, in its two modes
(`engine/parallel/distributed.py`).

CPU has no allocator statistics to read, so `HeldBytes` counts tensors: this rank's parameter shards, the full
(unsharded) parameters FSDP2 holds at the moment (a freed one has a storage of 0 bytes), the sharded, unsharded
and accumulated gradients, and the replicated parameters (embeddings, final norm, LM head) with their gradients. It
samples that sum before and after every decoder layer's forward and whenever a gradient lands on a full parameter
(`register_post_accumulate_grad_hook`: during the layer's backward, before the reduce-scatter frees it), and keeps
the largest. Activations, the prefix cache and the optimizer state are not counted: they do not depend on the mode.
It reads FSDP2's internals (`FSDPParam`), which only this measurement needs.
"""

from __future__ import annotations


def _storages(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped; a DTensor by its local tensor): FSDP2's full
    parameters of a layer are views of one all-gather buffer, counted once."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        storage = (t._local_tensor if hasattr(t, "_local_tensor") else t).untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class HeldBytes:
    """Peak parameter + gradient bytes held by this rank (module docstring). `dp`: an
    `engine.parallel.distributed.DataParallel` with strategy "fsdp2"; `peak` (bytes) since construction or `reset`.
    Use as a context manager: the hooks are removed on exit."""

    def __init__(self, dp):
        self.dp, self.peak, self.handles, self.hooked = dp, 0, [], set()
        self.params = [fp for layer in dp.layers for fp in layer._get_fsdp_state()._fsdp_param_group.fsdp_params]

    def __enter__(self) -> HeldBytes:
        for layer in self.dp.layers:
            self.handles.append(layer.register_forward_pre_hook(lambda *_: self.sample()))
            self.handles.append(layer.register_forward_hook(lambda *_: self.sample()))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def reset(self) -> None:
        self.peak = 0

    def now(self) -> int:
        """Bytes held at this moment."""
        tensors = []
        for fp in self.params:
            full = getattr(fp, "_unsharded_param", None)
            tensors += [fp.sharded_param, fp.sharded_param.grad, full, full.grad if full is not None else None,
                        fp.unsharded_accumulated_grad]
            if full is not None and id(full) not in self.hooked and full.requires_grad:  # made at FSDP2's lazy init
                self.hooked.add(id(full))
                self.handles.append(full.register_post_accumulate_grad_hook(lambda _: self.sample()))
        return _storages(tensors + [t for p in self.dp.replicated for t in (p, p.grad)])

    def sample(self) -> None:
        self.peak = max(self.peak, self.now())
