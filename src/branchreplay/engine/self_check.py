"""First use of a model family outside the registry: the engine against the naive reference on the user's own model.

`train.unknown_family="self-check"` (the default) runs, before the first step, the naive reference and the engine (the
family as `families.generic_family` guesses it) on a small random tree (branches of branches; clipping and KL
exercised), in the model's dtype (float64 under `reference.float64.keep_float64`; bfloat16 / float16 on a float32
copy). The model is refused, with its error, when the max relative gradient error exceeds `BOUNDS` (above the rounding
of two orders of summation, below a structural mistake), else the error is logged. Verdicts are kept per model class,
config and dtype (`verdict_key`; a run keeps them in `self_check.json`). `check_once` is the check of the package's
`replay_backward(force=True)`, which then runs the engine trusted. Recurrent or hybrid layers are always refused.
Design notes and measurements: docs/notes/execution-stack.md.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging

import torch

from ..losses import GRPOLoss
from ..reference.float64 import keep_float64
from ..reference.naive import max_rel_grad_err, naive_backward
from ..reference.shapes import branches_of_branches, make_rollouts, shared_prompt
from ..tree import RolloutTree
from ..value import is_value_model
from .config import EVERY_SHARED_NODE, EngineConfig
from .families import FAMILIES, UnsupportedModelError, family_of
from .replay import replay_backward, replay_logprobs

BOUNDS = {torch.float64: 1e-6, torch.float32: 1e-3}
"""Max relative gradient error of the engine against the naive reference, by the dtype the check runs in."""
CHECKED_IN = {torch.bfloat16: torch.float32, torch.float16: torch.float32}
"""Half-precision models are checked on a float32 copy (module docstring)."""
PROCESS_VERDICTS: dict[str, dict] = {}
"""The verdicts of `check_once` (the package's calls with `force=True`), by `verdict_key`, for the process's life."""


def check_once(model) -> None:
    """The self-check of an unregistered family for a call of the package's `replay_backward` / `replay_logprobs`
    with `force=True`: `ensure_supported(model, "self-check", PROCESS_VERDICTS)`, so each model class, config and
    dtype is checked once per process; the passed verdict goes to the "branchreplay" logger (INFO).

    Raises:
        UnsupportedModelError: as `ensure_supported` (recurrent layers, or an error above the bound).
        ValueError: `model` is a critic (`value.ValueModel`): check its policy, then call the engine trusted; or the
            process is one rank of several (torchrun): the check needs the whole model, run it before sharding
            (`ensure_supported`, as the trainer does), then call the engine trusted.
    """
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise ValueError("force=True under data parallelism: the self-check of an unregistered family needs the whole "
                         "model; run engine.self_check.ensure_supported(model, 'self-check', {}) before sharding it, "
                         "then call branchreplay.engine.replay_backward with trusted=True")
    if is_value_model(model):
        raise ValueError("force=True checks a causal LM against the naive reference; for a critic, check its "
                         "policy (engine.self_check.check_once(policy)), then call branchreplay.engine's functions "
                         "with trusted=True")
    ensure_supported(model, "self-check", PROCESS_VERDICTS, log=logging.getLogger("branchreplay").info)


def ensure_supported(model, unknown_family: str, verdicts: dict, log=print) -> bool:
    """Whether the engine must run `model` as an unregistered family (`trusted=True` in its calls, the check being
    done here).

    A registered family: False. An unregistered one, per `unknown_family` (the run's train.unknown_family):
    "refuse" raises; "self-check" takes the verdict of `verdicts` ({`verdict_key`: {model_class, dtype,
    max_rel_grad_err, bound, passed}}, the run folder's cache) or runs `self_check` and adds its verdict there,
    logs it, and returns True when it passed.

    Raises:
        UnsupportedModelError: "refuse"; recurrent or hybrid layers the registry does not know; attention the
            engine cannot carry (`families.generic_family`: ALiBi); or a self-check whose error exceeds the bound (the
            message gives the error and the bound).
    """
    if model.config.model_type in FAMILIES:
        return False
    if unknown_family == "refuse":
        family_of(model)  # raises the refusal that names the family and `branchreplay verify --force`
    family_of(model, trusted=True)  # `generic_family` refuses recurrent layers (`refuse_recurrent`) and ALiBi by name
    dtype = next(model.parameters()).dtype
    key = verdict_key(model)
    if key not in verdicts:
        verdicts[key] = _verdict(model, dtype)
    verdict = verdicts[key]
    name = f"{model.config.model_type} ({verdict['model_class']}, {verdict['dtype']})"
    if verdict.get("crashed"):
        raise UnsupportedModelError(
            f"{name} is not in the engine's registry and does not run under it ({verdict['crashed']}): the engine "
            "cannot hand this model's layers their prefix, so it is refused. Registering the family "
            "(engine/families.py) is what would make it run")
    if not verdict["passed"]:
        raise UnsupportedModelError(
            f"{name} is not in the engine's registry and failed its self-check: max relative gradient error "
            f"{verdict['max_rel_grad_err']:.2e} against the naive per-rollout computation, above the bound "
            f"{verdict['bound']:.0e}. Do not train it with branchreplay; `branchreplay verify --model PATH --force` "
            "shows which tree shapes fail")
    log(f"{name}: not in the engine's registry; self-check passed (max relative gradient error "
        f"{verdict['max_rel_grad_err']:.2e} against the naive reference, bound {verdict['bound']:.0e})")
    return True


def _verdict(model, dtype) -> dict:
    """The self-check's verdict on `model` (the keys of `ensure_supported`'s `verdicts`); a model whose forward or
    backward raises under the engine gets `crashed`: the exception's type and first line, and passed False."""
    bound = BOUNDS[CHECKED_IN.get(dtype, dtype)]
    verdict = {"model_class": type(model).__name__, "dtype": str(dtype).replace("torch.", ""),
               "checked_in": str(CHECKED_IN.get(dtype, dtype)).replace("torch.", ""), "bound": bound}
    try:
        error = self_check(model)
    except (MemoryError, torch.OutOfMemoryError):
        raise  # the machine's, not the family's: no verdict
    except Exception as e:  # an unknown family's layers the engine cannot run: refused by name, not a traceback
        said = (str(e).splitlines() or [""])[0][:200]
        return {**verdict, "max_rel_grad_err": None, "passed": False, "crashed": f"{type(e).__name__}: {said}"}
    return {**verdict, "max_rel_grad_err": error, "passed": error <= bound}


def self_check(model, seed: int = 0, temperature: float = 1.0) -> float:
    """Max relative gradient error (over parameters) of the engine against the naive reference on a small random
    tree (~220 tokens: a 64-token prompt with 4 completions, and branches of branches), GRPO loss with KL and
    entropy, off-policy old logprobs; both in the model's dtype (half precision: on a float32 copy), float64
    under `keep_float64`. Every parameter is compared (a frozen one too: `requires_grad` is set for the check),
    with autocast off and autograd on whatever the caller's context (`replay_logprobs` runs under no_grad, a user's
    call may run under autocast or inference_mode); each parameter's `grad` and `requires_grad` are left as they
    were found."""
    dtype = next(model.parameters()).dtype
    if dtype in CHECKED_IN:
        return self_check(copy.deepcopy(model).to(CHECKED_IN[dtype]), seed, temperature)
    params = list(model.parameters())
    kept = [(p.grad, p.requires_grad) for p in params]
    device = params[0].device.type
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device, enabled=False):
            for p in params:
                p.grad = None
                p.requires_grad_(True)
            return _measure(model, dtype, seed, temperature)
    finally:
        for p, (grad, requires_grad) in zip(params, kept, strict=True):
            p.grad = grad
            p.requires_grad_(requires_grad)


def _measure(model, dtype, seed: int, temperature: float) -> float:
    """`self_check`'s comparison, in the context it set up."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    rollouts = make_rollouts(shared_prompt(64, 4, 24, vocab, g) + branches_of_branches(vocab, g), g)
    loss = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, beta=0.05, entropy_coef=0.01)
    engine = EngineConfig(max_pack_tokens=64, chunk_tokens=24, replay="keep", **EVERY_SHARED_NODE)  # crosses
    # packs and chunks, every shared node kept (a small tree would otherwise run packed: engine/schedule.py)
    numerics = keep_float64(model) if dtype == torch.float64 else contextlib.nullcontext()
    with numerics:
        tree = RolloutTree(rollouts)
        current = replay_logprobs(model, tree, temperature=temperature, engine=engine, trusted=True).logprobs
        for r, lp in zip(rollouts, current, strict=True):  # off-policy: some ratios are clipped, and KL is non-zero
            noise = 0.3 * (torch.rand(len(r), generator=g, dtype=torch.float64) - 0.5)
            r.old_logprobs = (lp.double() + noise) * r.loss_mask
            r.ref_logprobs = (lp.double() - noise) * r.loss_mask
        naive = _grads(model, lambda: naive_backward(model, rollouts, loss, temperature=temperature))
        ours = _grads(model, lambda: replay_backward(model, tree, loss, temperature=temperature, engine=engine,
                                                     trusted=True))
    return max_rel_grad_err(ours, naive)


def verdict_key(model) -> str:
    """sha256 of the model class, its config (every field, as JSON) and its parameter dtype."""
    text = f"{type(model).__module__}.{type(model).__qualname__}|{model.config.to_json_string(use_diff=False)}|" \
           f"{next(model.parameters()).dtype}"
    return hashlib.sha256(text.encode()).hexdigest()


def _grads(model, run) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    run()
    out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out
