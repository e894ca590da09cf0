"""The decoding rows of `loop.sample_groups` for Llama-architecture models on the CPU, the step written out in
plain torch as gpt-fast writes its Transformer (sampling.cache_implementation=auto there).

A step is one function: per layer its seven matmuls from MKL-packed weights (`packed_linears`), the layer's own
RMSNorm, rotary embedding, activation and LM head modules for the rest (so each elementwise result is
transformers'), and attention as `engine.attention.grouped_prefix_attention` (each group's prompt held once, each
row's generated keys in a preallocated store, the two merged by their log-sum-exp). Every row is a live stream: a
drop or fork gathers the rows kept, so no step decodes a finished stream. It applies where `llama_rows_apply` says
(llama, qwen2, qwen3, mistral; CPU, float32 or float64). The samples equal the dynamic cache's up to the matmuls'
floating-point order (float64 test: the same ids).
Design notes and measurements: docs/notes/sampler.md.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ...engine.attention import grouped_prefix_attention
from ...engine.families import layer_windows
from .. import packed_linears

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
"""model_type values whose decoder layer is Llama's (pre-norm attention then gated MLP, RoPE, grouped-query)."""

FIRST_SLOTS = 64
"""Generated-key slots a store starts with (doubled when full, at most max_new_tokens)."""


def llama_rows_apply(model) -> bool:
    """Whether `LlamaRows` can decode `model` exactly: the families whose decoder layer is exactly Llama's
    (`FAMILIES`), with the one variation read from the layer itself (Qwen3's q / k RMSNorm over the head dim),
    without sliding-window layers, on the CPU in float32 or float64, outside autocast, with every projection a plain
    nn.Linear holding a plain tensor (a LoRA wrapper, an FSDP2 DTensor, or a forward hook or an instance forward on
    any module: the model's own forward, which those rely on, decodes instead)."""
    config = model.config
    if config.model_type not in FAMILIES or model.device.type != "cpu" or model.dtype not in (torch.float32,
                                                                                              torch.float64):
        return False
    if torch.is_autocast_enabled("cpu") or any(w is not None for w in layer_windows(config)):
        return False
    if any(m._forward_hooks or m._forward_pre_hooks or not _class_forward(m) for m in model.modules()):
        return False
    decoder = model.model if isinstance(model, PreTrainedModel) and "model" in model._modules else None
    if decoder is None or not hasattr(decoder, "layers") or not isinstance(model._modules.get("lm_head"), nn.Linear):
        return False  # a peft PeftModel (LoRA) is not a PreTrainedModel: its own forward decodes
    linears = [model.lm_head] + [m for layer in decoder.layers for m in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    return all(type(m) is nn.Linear and type(m.weight) in (torch.Tensor, nn.Parameter) for m in linears)


def _class_forward(module: nn.Module) -> bool:
    """Whether `module` runs its class's forward, or packed_linears' (an instance forward set by anything else, as
    accelerate's hooks set one, is what the plain step would skip)."""
    forward = module.__dict__.get("forward")
    return forward is None or hasattr(forward, "packed_rows")


class _Linear:
    """x [n, in] -> [n, out] by an nn.Linear's weight and bias, from MKL's copy packed for `rows` rows in float32
    where this build has MKL and `pack` (`packed_linears.linear`: used for more than rows / 2 rows): the copy the
    open `packed_linears` block made where it made one for those rows of the weight as it is now, else one made
    here."""

    def __init__(self, module: nn.Linear, rows: int, pack: bool):
        self.weight = module.weight.detach()
        self.bias = None if module.bias is None else module.bias.detach()
        self.rows, self.packed = rows, None
        if pack and self.weight.dtype == torch.float32 and packed_linears.available():
            packed = packed_linears.packed_copy(module, rows)
            self.packed = packed_linears.pack(self.weight, rows) if packed is None else packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return packed_linears.linear(x, self.packed, self.weight, self.bias, self.rows)


class _Layer:
    """One decoder layer's modules and weights."""

    def __init__(self, layer: nn.Module, rows: int, pack: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.norm_in, self.norm_post, self.act = layer.input_layernorm, layer.post_attention_layernorm, mlp.act_fn
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q, self.k, self.v, self.o, self.gate, self.up, self.down = (_Linear(m, rows, pack) for m in (
            attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        self.scale, self.head_dim = attn.scaling, attn.head_dim
        self.rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb


def _weights(model, rows: int, pack: bool) -> tuple[list[_Layer], _Linear]:
    """The layers' weights and the LM head's, packed for `rows` rows, or for the rows of the `packed_linears` block
    open on the model, built once per block (its memo) while every parameter is the same tensor at the same version
    (an optimizer step or a new Parameter builds them again)."""
    opened = packed_linears.block(model) if pack else None
    rows = rows if opened is None else opened.rows
    versions = tuple((id(p), p._version) for p in model.parameters())
    hit = opened.memo.get(("llama_rows", rows)) if opened is not None else None
    if hit is not None and hit[0] == versions:
        return hit[1]
    built = [_Layer(layer, rows, pack) for layer in model.model.layers], _Linear(model.lm_head, rows, pack)
    if opened is not None:
        opened.memo[("llama_rows", rows)] = versions, built
    return built


class LlamaRows:
    """The live streams of `loop._decode_groups`, row r = live stream r, decoded by the plain step.

    model: a model `llama_rows_apply` accepts, in eval mode. start: [prompts] long, each prompt's first generated
    position (live stream k starts as prompt k). prompts: one batch-1 DynamicCache per prompt (its keys / values
    [1, kv_heads, P_k, head_dim] are read, never written). max_new_tokens: the most tokens a row generates. rows:
    the most live streams a step will have (prompts x G), what the weights are packed for, unless a
    `packed_linears` block is open on the model: then its rows, and the packed weights are built once for
    the block (every decoding loop of a sampling step, every turn of a multi-turn one). pack: use MKL-packed
    weights (sampling.pack_weights). Build it inside `torch.no_grad()`."""

    def __init__(self, model, start: torch.Tensor, prompts: list[DynamicCache], max_new_tokens: int, rows: int,
                 pack: bool = True):
        decoder = model.model
        self.embed, self.rotary, self.norm = decoder.embed_tokens, decoder.rotary_emb, decoder.norm
        self.layers, self.head = _weights(model, rows, pack)
        self.prompt_keys = [[c.layers[i].keys for c in prompts] for i in range(len(self.layers))]
        self.prompt_values = [[c.layers[i].values for c in prompts] for i in range(len(self.layers))]
        self.max_new_tokens, self.start, self.group = max_new_tokens, start.clone(), list(range(len(prompts)))
        shape = prompts[0].layers[0].keys.shape  # [1, kv_heads, P, head_dim]
        empty = prompts[0].layers[0].keys.new_empty((len(prompts), shape[1], min(FIRST_SLOTS, max_new_tokens),
                                                     shape[3]))
        self.keys = [torch.empty_like(empty) for _ in self.layers]
        self.values = [torch.empty_like(empty) for _ in self.layers]
        self.used = 0  # generated slots written per row
        self._spans()

    def _spans(self) -> None:
        """spans[g] = (first, end) rows of group g (the sampler keeps each group's streams consecutive)."""
        self.spans = [(0, 0)] * len(self.prompt_keys[0])
        for g in dict.fromkeys(self.group):
            self.spans[g] = (self.group.index(g), len(self.group) - self.group[::-1].index(g))

    def select(self, index: torch.Tensor) -> None:
        """Live stream j becomes old live stream index[j]: the used slots of rows `index` gathered (a fork
        repeats a row, a drop leaves it out)."""
        rows = index.tolist()
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_empty((len(rows), *old.shape[1:]))
                new[:, :, : self.used] = old[:, :, : self.used].index_select(0, index)
                store[i] = new
        self.start, self.group = self.start[index], [self.group[r] for r in rows]
        self._spans()

    def _grow(self) -> None:
        """Double the slots of every store (at most max_new_tokens), keeping the used ones."""
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_empty((*old.shape[:2], min(2 * old.shape[2], self.max_new_tokens), old.shape[3]))
                new[:, :, : self.used] = old[:, :, : self.used]
                store[i] = new

    def decode(self, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """Each live stream's token ([rows, 1] long) at generated depth `depth` (= the slots written so far): the
        [rows, V] float32 next logits."""
        if depth >= self.keys[0].shape[2]:
            self._grow()
        rows = len(tokens)
        h = self.embed(tokens[:, 0])  # [rows, hidden]
        cos, sin = self.rotary(h, (self.start + depth)[:, None])  # [rows, 1, head_dim]
        for layer, keys, values, prompt_keys, prompt_values in zip(self.layers, self.keys, self.values,
                                                                   self.prompt_keys, self.prompt_values, strict=True):
            x = layer.norm_in(h)
            q, k, v = (f(x).view(rows, 1, -1, layer.head_dim) for f in (layer.q, layer.k, layer.v))
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = layer.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [rows, heads, 1, head_dim]
            keys[:, :, depth] = k[:, :, 0]
            values[:, :, depth] = v[:, 0]
            out = grouped_prefix_attention(q, keys[:, :, : depth + 1], values[:, :, : depth + 1], None, layer.scale,
                                           self.spans, prompt_keys, prompt_values)
            h = h + layer.o(out.transpose(1, 2).reshape(rows, -1))
            x = layer.norm_post(h)
            h = h + layer.down(layer.act(layer.gate(x)) * layer.up(x))
        self.used = depth + 1
        return self.head(self.norm(h)).float()
