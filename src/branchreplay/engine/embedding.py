"""The input embedding's gradient, summed over a step's packs and applied once.

PyTorch's embedding backward makes a dense [vocab, hidden] gradient (`nn.Embedding` without `sparse=True`): run once
per pack, a pass over the whole table for every pack, whatever its size. Here each pack's forward hands the decoder a
leaf copy of the embedding's output (a forward hook on the embedding module, removed after the forward); after the
pack's backward the leaf's gradient for the pack's tokens is kept, and once the step's packs are done, one forward of
the embedding over all the kept ids and one backward with the kept gradients add the same sum into `weight.grad`.
The hook catches the module's own output, so a model that transforms it afterwards (Gemma's scale, GPT-2's
positions) still does so, and the final backward runs through the module itself. The kept gradients never outgrow
one dense gradient: once they hold as many rows as the vocabulary, they are applied (`keep`).
Design notes and measurements: docs/notes/execution-stack.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class DeferredEmbeddingGrad:
    """Collects the gradient at the input embedding's output, pack by pack, and applies it in one backward.

    embedding: the decoder's input embedding module (`get_input_embeddings()`), whose weight requires grad."""

    def __init__(self, embedding: torch.nn.Module):
        self.embedding = embedding
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids [n], gradient [n, hidden])

    @contextlib.contextmanager
    def capture(self) -> Iterator[list]:
        """While inside, every call of the embedding under autograd returns a leaf copy of its output; yields the
        list of (ids, leaf) it made, for `keep` after the backward."""
        leaves = []

        def hook(module, args, output):
            if not torch.is_grad_enabled():
                return None
            leaf = output.detach().requires_grad_(True)
            leaves.append((args[0], leaf))
            return leaf

        handle = self.embedding.register_forward_hook(hook)
        try:
            yield leaves
        finally:
            handle.remove()

    def keep(self, leaves: list) -> None:
        """Keep the gradients the leaves of a pack's forward received in its backward; apply them all once they
        hold as many rows as the embedding has (more would take more memory than the dense gradient)."""
        for ids, leaf in leaves:
            if leaf.grad is not None:
                self.pending.append((ids.reshape(-1), leaf.grad.reshape(-1, leaf.shape[-1])))
        if sum(len(i) for i, _ in self.pending) >= self.embedding.weight.shape[0]:
            self.apply()

    def outputs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """([the embedding's output over every kept id], [their gradients]) for one `torch.autograd.backward`, and
        nothing kept after; two empty lists when nothing is kept."""
        if not self.pending:
            return [], []
        ids = torch.cat([i for i, _ in self.pending])
        grads = torch.cat([g for _, g in self.pending])
        self.pending = []
        return [self.embedding(ids)], [grads]

    def apply(self) -> None:
        """Add the kept gradients into the embedding weight's `.grad` (one dense pass over the table)."""
        outputs, grads = self.outputs()
        if outputs:
            torch.autograd.backward(outputs, grads)
