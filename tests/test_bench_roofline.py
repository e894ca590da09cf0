"""The decoding roofline's cost model (`bench/roofline.py`) against torch's own FLOP counter on a real decoding step,
and the roofline's bound (the measured peaks are printed by scripts/sampling_time.py --roofline, never timed here)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import DynamicCache

from branchreplay.bench.roofline import DecodeShape, Roofline
from branchreplay.tiny_models import tiny_model


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen3", True)])
def test_one_decoding_step_costs_the_flops_torch_counts(arch, tied):
    """B = 3 streams, a 9-token prompt prefilled, then one token each: 10 keys attended per layer (eager attention,
    whose matmuls the counter sees; grouped-query attention; an LM head of its own, or tied to the embedding as
    SmolLM2's)."""
    model = tiny_model(arch, attn_implementation="eager", tie_word_embeddings=tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (3, 9)), cache=cache, use_cache=True)
        with FlopCounterMode(display=False) as counter:
            model(input_ids=torch.randint(0, 256, (3, 1)), cache=cache, use_cache=True)
    shape = DecodeShape.of(model)
    assert shape.kv_heads < shape.heads
    assert counter.get_total_flops() == pytest.approx(shape.flops(3, 10), rel=1e-9)


def test_the_roofline_is_the_slower_of_compute_and_memory():
    shape = DecodeShape(matmul_params=10**8, layers=2, heads=4, kv_heads=2, head_dim=16, weight_bytes=4, cache_bytes=4)
    slow_memory = Roofline.of(shape, 32, 100, 10, flops_per_s=1e15, bytes_per_s=1e9)
    assert slow_memory.bound == "memory"
    assert slow_memory.seconds == pytest.approx(sum(shape.bytes(32, 100 + t) for t in range(10)) / 1e9)
    slow_compute = Roofline.of(shape, 32, 100, 10, flops_per_s=1e9, bytes_per_s=1e15)
    assert slow_compute.bound == "compute"
    assert slow_compute.tokens_per_s == pytest.approx(320 / (sum(shape.flops(32, 100 + t) for t in range(10)) / 1e9))
