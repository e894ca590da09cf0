"""The LM head: logprobs and entropy at the positions that carry a loss, in checkpointed chunks, with the logits as
the families' ForCausalLM forwards compute them: logits = transform(lm_head(hidden)).

The engine runs the decoder (the base model) itself and applies the output projection only at positions that carry
a loss, so every transform that a ForCausalLM forward applies to `lm_head(hidden)` has to be applied here too. They
are read from the config in this one place (transformers 5.24, every `*ForCausalLM.forward` that touches its
logits):
    multiplier: Cohere / Cohere2 `logits * config.logit_scale`; FalconH1 `logits * config.lm_head_multiplier`;
    divisor: Granite, GraniteMoe, GraniteMoeShared, GraniteMoeHybrid `logits / config.logits_scaling`;
    softcap: Gemma2 / Gemma3 and others `softcap * tanh(logits / softcap)`, `config.final_logit_softcapping`;
in that order. Any other transform is caught by `check_head`, which compares this head with the model's own
ForCausalLM logits on a few tokens once per model and refuses a mismatch by name.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..models import base_decoder
from ..value import is_value_model


class HeadMismatchError(ValueError):
    """The model's ForCausalLM computes its logits in a way that `LogitTransform` does not reproduce."""


@dataclass(frozen=True)
class LogitTransform:
    """logits -> softcap(logits * multiplier / divisor), each step skipped at its neutral value (1, 1, None)."""

    multiplier: float = 1.0
    divisor: float = 1.0
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[*, V] logits of `lm_head` -> [*, V] logits of the ForCausalLM forward, in the same dtype."""
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def logit_transform(config) -> LogitTransform:
    """The transform a ForCausalLM of this config applies to `lm_head(hidden)` (module docstring)."""
    multiplier = 1.0
    for name in ("logit_scale", "lm_head_multiplier"):
        value = getattr(config, name, None)
        if value is not None:
            multiplier *= float(value)
    divisor = getattr(config, "logits_scaling", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform(multiplier, 1.0 if divisor is None else float(divisor),
                          None if not softcap else float(softcap))


def decoder_and_head(model):
    """(decoder, head, transform): the base model returning final-normed hidden states [B, S, H], the output
    projection H -> V (its `weight` gives the head's dtype, device and vocabulary size), and the `LogitTransform`
    that the model's ForCausalLM applies after it. For a critic (`value.is_value_model`) the head is its scalar
    `score`, H -> 1, with no transform."""
    decoder = base_decoder(model)
    if is_value_model(model):
        return decoder, model.score, LogitTransform()
    return decoder, model.get_output_embeddings(), logit_transform(model.config)


_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the transforms verified on it


@torch.no_grad()
def check_head(model, tokens: int = 4) -> None:
    """Compare `transform(lm_head(decoder(ids)))` with `model(ids).logits` on `tokens` fixed ids, once per model and
    transform (a weak cache: nothing is kept on the model).

    Raises:
        HeadMismatchError: they differ (beyond 1e-5 relative in float32/64, 1e-2 in half precision): the family
            transforms its logits in a way this module does not know.
    """
    if is_value_model(model):  # the critic's head is its own `score`: nothing else to reproduce
        return
    decoder, head, transform = decoder_and_head(model)
    if transform in _checked.get(model, ()):
        return
    ids = torch.arange(1, tokens + 1, device=head.weight.device)[None] % head.weight.shape[0]
    was_training = model.training
    model.eval()
    try:
        theirs = model(input_ids=ids, use_cache=False).logits.float()
        ours = transform(head(decoder(input_ids=ids, use_cache=False).last_hidden_state)).float()
    finally:
        model.train(was_training)
    rtol = 1e-2 if head.weight.dtype in (torch.float16, torch.bfloat16) else 1e-5
    err = ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()
    if not err <= rtol:
        raise HeadMismatchError(
            f"{model.config.model_type}: {type(model).__name__} computes its logits differently from the engine's LM "
            f"head ({transform}): relative difference {err:.2e} on {tokens} tokens. Its forward applies a logit "
            "transform that branchreplay.engine.head does not read; add it there (and a test) before training"
        )
    _checked.setdefault(model, set()).add(transform)


def token_logprobs(head, transform: LogitTransform, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                   chunk_tokens: int, backward_next: bool = False, float32: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H] hidden, [N] targets -> logprobs [N], entropy [N], `chunk_tokens` rows at a time; under autograd each
    chunk (but a leaf pack's last: backward_next) is checkpointed, so its [chunk, V] logits exist only while that
    chunk is computed (forward or backward).

    backward_next: the caller runs this graph's backward before it computes anything else (a pack with no
    children). Then the LAST chunk runs without checkpointing: its logits are held from the forward to the
    backward, which starts with them (autograd runs the latest nodes first) and frees them before the earlier
    chunks recompute, so the peak stays one chunk's; and that chunk's head forward is not run twice (5-10% of a leaf
    pack's time on the bench Llama and SmolLM2 when the pack's rows fit one chunk). float32: as `head_logprobs`."""
    targets = targets.to(hidden.device)
    outs = []
    starts = range(0, hidden.shape[0], chunk_tokens)
    for start in starts:
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled() and not (backward_next and start == starts[-1]):
            outs.append(checkpoint(head_logprobs, head, h, t, temperature, transform, float32, use_reentrant=False))
        else:
            outs.append(head_logprobs(head, h, t, temperature, transform, float32))
    if len(outs) == 1:
        return outs[0]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def token_values(head, hidden: torch.Tensor) -> torch.Tensor:
    """[N, H] hidden -> [N] values of a critic's scalar `head`, float32 for half-precision weights (no chunking: the
    head's output is one number per row)."""
    values = head(hidden).squeeze(-1)
    return values.float() if values.dtype in (torch.float16, torch.bfloat16) else values


def head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, transform: LogitTransform,
                  float32: bool = False):
    """log softmax(transform(head(hidden)) / temperature) at `targets`, and the entropy of that distribution.
    [N, H], [N] -> [N], [N]. `transform` runs in the model's dtype, as transformers' ForCausalLM computes it;
    half-precision logits are upcast to float32. float32: the projection runs on float32 hidden states and weights
    with autocast off (TRL 1.16's fused LM head under cast_lm_head_to_fp32, trl/trainer/utils.py
    `add_fused_lm_head`).

    The logprob is the target's logit minus the row's logsumexp, as TRL's `selective_log_softmax`
    (trl/trainer/utils.py) computes it for float32: in float32 its gradient is about ten times closer to float64
    than that of `log_softmax(...).gather(...)` (figures: docs/support.md). The
    entropy keeps the full log-softmax."""
    logits = scaled_logits(head, hidden, temperature, transform, float32)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    logp_all = torch.log_softmax(logits, dim=-1)  # [N, V]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


def scaled_logits(head, hidden: torch.Tensor, temperature: float, transform: LogitTransform, float32: bool = False
                  ) -> torch.Tensor:
    """[N, H] -> [N, V] transform(head(hidden)) / temperature, half precision upcast to float32 (`head_logprobs`). A
    float32 CPU head that is a plain linear layer (`plain_cpu_linear`) runs through `projection` outside autocast
    (its input gradient in vocabulary blocks)."""
    if float32:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if head.bias is None else head.bias.float()
            logits = transform(projection(hidden.float(), head.weight.float(), bias))
    elif hidden.dtype == torch.float32 and plain_cpu_linear(head) and not torch.is_autocast_enabled("cpu"):
        logits = transform(projection(hidden, head.weight, head.bias))
    else:
        logits = transform(head(hidden))
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return logits / temperature


VOCAB_BLOCK = 1024
"""Vocabulary rows per partial product of `projection`'s input gradient."""


def plain_cpu_linear(module) -> bool:
    """Whether `module` is an nn.Linear whose forward is nn.Linear's own (no instance forward, no forward hooks) on a
    plain float32 CPU weight: a layer whose output a caller may compute from its weight and bias itself."""
    weight = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and "forward" not in module.__dict__ and not module._forward_hooks
            and not module._forward_pre_hooks and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and weight.dtype == torch.float32 and weight.device.type == "cpu")


def projection(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(hidden, weight, bias)`: [*, H] -> [*, V] logits, whose gradient with respect to `hidden` is summed
    over the vocabulary in blocks of `VOCAB_BLOCK` rows on the CPU in float32 (`_BlockedProjection`); elsewhere the
    plain linear layer."""
    if hidden.device.type == "cpu" and hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return _BlockedProjection.apply(hidden, weight, bias)
    return torch.nn.functional.linear(hidden, weight, bias)


class _BlockedProjection(torch.autograd.Function):
    """The LM head's projection with its input gradient dL/dhidden = dL/dlogits [N, V] @ weight [V, H] computed as a
    sum of [N, VOCAB_BLOCK] @ [VOCAB_BLOCK, H] products. For a few rows (a pack of a short child: 1-4 trained
    positions) the CPU BLAS runs a kernel that sums each V-long dot product in one float32 chain, far less precise
    than its kernel for many rows; the pack's backward carried that error into every parameter
    (the float32 short-child note in docs/notes/). In blocks, every row count rounds like many rows. The forward and
    the weight's gradient (a sum over the N rows) are the plain linear layer's."""

    @staticmethod
    def forward(ctx, hidden, weight, bias):
        ctx.save_for_backward(hidden if weight.requires_grad else None, weight)
        return torch.nn.functional.linear(hidden, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            for a in range(0, weight.shape[0], VOCAB_BLOCK):
                part = grad[..., a : a + VOCAB_BLOCK] @ weight[a : a + VOCAB_BLOCK]
                grad_hidden = part if grad_hidden is None else grad_hidden.add_(part)
        rows = grad.reshape(-1, grad.shape[-1])  # [N, V]
        if ctx.needs_input_grad[1]:
            grad_weight = rows.T @ hidden.reshape(-1, hidden.shape[-1])
        if ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_hidden, grad_weight, grad_bias


def check_float32_head(head) -> None:
    """`head_logprobs(float32=True)` runs a plain linear layer's weight and bias; raises ValueError for any other
    head (e.g. a LoRA adapter on it, which the float32 projection would skip)."""
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"engine.head_float32 runs the LM head as a plain linear layer, but the head is a "
                         f"{type(head).__name__}; set engine.head_float32 false (TRL: cast_lm_head_to_fp32=False) "
                         "or keep adapters off the head")


HEAD_STATS = ("mean_logits", "is_top1", "log_sum_sq_probs")
"""Per-token statistics of the next-token distribution besides the logprob and entropy, as TRL 1.16's fused LM head
names them (trl/trainer/utils.py `FusedCausalLMOutput`): the mean over the vocabulary of the temperature-scaled
logits, whether the target is the most likely token (1.0 / 0.0), and log(sum_v p_v^2)."""


@torch.no_grad()
def head_statistics(head, transform: LogitTransform, hidden: torch.Tensor, targets: torch.Tensor,
                    temperature: float, names: tuple[str, ...], chunk_tokens: int, float32: bool = False
                    ) -> dict[str, torch.Tensor]:
    """{name: [N] float32} of `HEAD_STATS` for [N, H] hidden and [N] targets, `chunk_tokens` rows at a time (no
    graph). Raises ValueError for a name outside HEAD_STATS."""
    unknown = set(names) - set(HEAD_STATS)
    if unknown:
        raise ValueError(f"head_stats {sorted(unknown)} unknown; choose from {', '.join(HEAD_STATS)}")
    targets = targets.to(hidden.device)
    out: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for start in range(0, hidden.shape[0], chunk_tokens):
        logits = scaled_logits(head, hidden[start : start + chunk_tokens], temperature, transform, float32)
        t = targets[start : start + chunk_tokens]
        if "mean_logits" in out:
            out["mean_logits"].append(logits.mean(-1))
        if "is_top1" in out:
            out["is_top1"].append((logits.argmax(-1) == t).to(logits.dtype))
        if "log_sum_sq_probs" in out:
            out["log_sum_sq_probs"].append(torch.logsumexp(2 * torch.log_softmax(logits, dim=-1), dim=-1))
    return {name: torch.cat(values).float() for name, values in out.items()}
