"""Numerics shared by the reference and the engine in exactness checks: `keep_float64`.

Some modules of Hugging Face models compute in float32 even in a float64 model, where the naive reference and the
execution stack round at slightly different inputs (the same terms summed in another order) and 1e-16 differences
become 1e-7 ones. `keep_float64` makes them compute in float64, on both sides alike, with the same formulas, so that
a float64 check measures the engine and not those casts:
    RMSNorm (Llama, Qwen2, Qwen3, Mistral, ...): weight * x / sqrt(mean(x^2) + eps);
    Gemma's RMSNorm (Gemma, Gemma2, Gemma3; q/k norms included): x / sqrt(mean(x^2) + eps) * (1 + weight);
    Gemma2 / Gemma3's `eager_attention_forward` (softcapped eager attention; a module function, so every such model
        of the process while active, float64 inputs only): its softmax in the input's dtype;
    the mixture-of-experts routers of Mixtral and Qwen3-MoE: their softmax, top-k and renormalisation in float64;
    Gemma 4's and Llama 4's norms, routers and Llama 4's rotary rotation (`float64_formulas.py`);
    DeepSeek-V3's and GLM-4-MoE-Lite's grouped sigmoid routers (score correction bias): all of it in float64;
    the gated delta rule and gated norms of Qwen3-Next, Qwen3.5, OLMo Hybrid and Kimi Linear
        (`float64_delta_rule.py`; the delta rule a module function, so every such model of the process while active,
        float64 inputs only), and Qwen3-Next's and Qwen3.5's (1 + weight) RMSNorm.
Design notes and measurements: docs/support.md ("Notes per family").
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..models import eager_experts
from .float64_delta_rule import DELTA_RULES, GATED_DELTA_FILES, GATED_NORMS, gated_rms_norm
from .float64_formulas import FORMULAS, MODULE_FUNCTIONS


def _rms_norm_float64(module, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return module.weight * (hidden_states * torch.rsqrt(variance + module.variance_epsilon))


def _gemma_rms_norm_float64(module, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps) * (1.0 + module.weight)


GEMMA_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "Qwen3NextRMSNorm", "Qwen3_5RMSNorm",
               "Qwen3_5MoeRMSNorm")
"""RMSNorm classes computing x / sqrt(mean(x^2) + eps) * (1 + weight) (attribute `eps`)."""

EAGER_FLOAT32_SOFTMAX = ("transformers.models.gemma2.modeling_gemma2", "transformers.models.gemma3.modeling_gemma3",
                         "transformers.models.gemma4.modeling_gemma4")
"""Model files whose `eager_attention_forward(module, q, k, v, mask, dropout, scaling, softcap)` takes its softmax
in float32 (checked against transformers 5.24; Gemma 4's against 5.25)."""


FLOAT64_FUNCTIONS = {**{file: (pair,) for file, pair in MODULE_FUNCTIONS.items()},
                     **{file: DELTA_RULES for file in GATED_DELTA_FILES}}
"""Model file -> the (module function name, its float64 wrapper's maker) pairs `keep_float64` installs there."""


def _eager_attention_float64(original):
    """`original` (a Gemma2 / Gemma3 `eager_attention_forward`) with its softmax in float64 for float64 inputs."""

    def eager_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                                **kwargs):
        if query.dtype != torch.float64:
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            softcap=softcap, **kwargs)
        repeat_kv = sys.modules[original.__module__].repeat_kv
        key_states = repeat_kv(key, module.num_key_value_groups)
        value_states = repeat_kv(value, module.num_key_value_groups)
        scaling = module.head_dim**-0.5 if scaling is None else scaling
        weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if softcap is not None:
            weights = torch.tanh(weights / softcap) * softcap
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = F.dropout(torch.softmax(weights, dim=-1), p=dropout, training=module.training)
        return torch.matmul(weights, value_states).transpose(1, 2).contiguous(), weights

    eager_attention_forward.branchreplay_float64 = True
    return eager_attention_forward


def _top_k_router_float64(module, hidden_states: torch.Tensor):
    router_logits = F.linear(hidden_states.reshape(-1, module.hidden_dim), module.weight)  # [N, E]
    top_value, top_index = torch.topk(torch.softmax(router_logits, dim=-1), module.top_k, dim=-1)  # [N, k]
    if getattr(module, "norm_topk_prob", True):  # Mixtral always renormalises
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value, top_index


MOE_ROUTERS = ("MixtralTopKRouter", "Qwen3MoeTopKRouter", "Qwen3NextTopKRouter", "Qwen3_5MoeTopKRouter")
"""Router classes returning (logits, top-k softmax weights, top-k indices), softmax in float32 (Qwen3-Next and
Qwen3.5-MoE: renormalised where `norm_topk_prob`, always when the class has no such switch)."""


def _grouped_sigmoid_router_float64(module, hidden_states: torch.Tensor):
    """DeepSeek-V3's router (transformers' `DeepseekV3TopkRouter.forward`) without its float32 casts: sigmoid scores,
    the score correction bias added for the choice only, the best `topk_group` of `n_group` groups (each scored by
    its two best experts), top-k within them, weights the chosen scores (renormalised with `norm_topk_prob`) times
    `routed_scaling_factor`."""
    router_logits = F.linear(hidden_states.reshape(-1, module.hidden_dim), module.weight)  # [N, E]
    scores = router_logits.sigmoid()
    choice = scores + module.e_score_correction_bias
    grouped = choice.view(-1, module.num_group, module.num_experts // module.num_group)
    group_idx = torch.topk(grouped.topk(2, dim=-1)[0].sum(dim=-1), k=module.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=choice.device).scatter_(1, group_idx, True)
    choice = choice.masked_fill(~group_mask.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    top_index = torch.topk(choice, k=module.top_k, dim=-1, sorted=False)[1]
    top_value = scores.gather(1, top_index)
    if module.norm_topk_prob:
        top_value = top_value / (top_value.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, top_value * module.routed_scaling_factor, top_index


GROUPED_SIGMOID_ROUTERS = ("DeepseekV3TopkRouter", "Glm4MoeLiteTopkRouter", "Glm4MoeTopkRouter")
"""Router classes computing `_grouped_sigmoid_router_float64`'s formula in float32 (checked against transformers
5.25)."""


def _float64_formula(module):
    """The float64 formula for `module`, or None when it has no float32 cast that `keep_float64` lifts."""
    name = type(module).__name__
    if name in FORMULAS:  # Gemma 4, Llama 4 (float64_formulas.py)
        return FORMULAS[name]
    if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and hasattr(module, "weight") \
            and not name.startswith("Gemma"):
        return _rms_norm_float64
    if name in GEMMA_NORMS and hasattr(module, "eps"):
        return _gemma_rms_norm_float64
    if name in GATED_NORMS:
        return gated_rms_norm
    if name in MOE_ROUTERS:
        return _top_k_router_float64
    if name in GROUPED_SIGMOID_ROUTERS:
        return _grouped_sigmoid_router_float64
    return None


def _in_float64(self, x, *args, **kwargs):
    """The instance `forward` of a module under `keep_float64`: its float64 formula for float64 input, its own
    previous forward otherwise. Bound with types.MethodType, and the pair kept on the module, so that a deepcopy of
    the model computes with the copy's weights."""
    formula, original = self._branchreplay_float64
    if x.dtype != torch.float64:
        return original(x, *args, **kwargs)
    return formula(self, x, *args, **kwargs)


_in_float64.branchreplay_float64 = True


@contextlib.contextmanager
def keep_float64(model) -> Iterator[int]:
    """While inside, the model's RMSNorm modules compute in float64 when their input is float64: Llama-style ones
    (class name ending in "RMSNorm", attribute `variance_epsilon`, output `weight * normed`) and Gemma's
    (`GEMMA_NORMS`, output `normed * (1 + weight)`); likewise the MoE routers (`MOE_ROUTERS`) and, for a Gemma2 /
    Gemma3 model, the eager attention softmax (see the module docstring); a mixture-of-experts model whose experts
    kernel refuses float64 runs transformers' eager experts (`models.eager_experts`). Yields how many modules
    compute in float64.

    A model whose Hub kernels are on (transformers' `use_kernels`, its default for `from_pretrained` when the
    `kernels` package is installed) has them reset while inside: each train / eval switch would otherwise replace
    the norms' forwards again (`kernelize`), silently ending the float64 formulas.

    On exit every module and module function it touched is restored (nested use on the same model leaves what the
    outer one set), and the kernels are set again; other models of the process are never affected,
    except that a Gemma2 / Gemma3 / Gemma 4 model file's eager attention, Llama 4's rotary function and the gated
    delta rules of Qwen3-Next, Qwen3.5, OLMo Hybrid and Kimi Linear run in float64 for float64 inputs while inside.
    A deepcopy of the model made inside computes with its own weights and keeps the float64 forwards (it is not
    restored)."""
    with eager_experts(model), _float64_formulas(model) as count:
        yield count


@contextlib.contextmanager
def _float64_formulas(model) -> Iterator[int]:
    """`keep_float64` without the experts switch: the float64 formulas, module functions and kernels."""
    touched_modules, touched_files, touched_functions, count = [], [], [], 0
    kernelized = [m for m in model.modules() if getattr(m, "use_kernels", False) is True]
    try:
        for m in kernelized:
            m.reset_kernels()
        for module in model.modules():
            formula = _float64_formula(module)
            if formula is None:
                continue
            count += 1
            if not getattr(module.forward, "branchreplay_float64", False):
                touched_modules.append((module, vars(module).get("forward")))
                module._branchreplay_float64 = (formula, module.forward)
                module.forward = types.MethodType(_in_float64, module)
        for file in sorted({type(m).__module__ for m in model.modules()} & set(EAGER_FLOAT32_SOFTMAX)):
            hf = sys.modules[file]
            if not getattr(hf.eager_attention_forward, "branchreplay_float64", False):
                touched_files.append((hf, hf.eager_attention_forward))
                hf.eager_attention_forward = _eager_attention_float64(hf.eager_attention_forward)
        for file in sorted({type(m).__module__ for m in model.modules()} & set(FLOAT64_FUNCTIONS)):
            hf = sys.modules[file]
            for name, wrap in FLOAT64_FUNCTIONS[file]:
                if hasattr(hf, name) and not getattr(getattr(hf, name), "branchreplay_float64", False):
                    touched_functions.append((hf, name, getattr(hf, name)))
                    setattr(hf, name, wrap(getattr(hf, name)))
        yield count
    finally:
        for module, previous in reversed(touched_modules):
            del module._branchreplay_float64
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        for hf, name, previous in reversed(touched_functions):
            setattr(hf, name, previous)
        for hf, previous in reversed(touched_files):
            hf.eager_attention_forward = previous
        for m in kernelized:
            m.set_use_kernels(True)  # in the mode of its train / eval state, as its next switch would
