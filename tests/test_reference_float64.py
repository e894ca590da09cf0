"""`reference.float64.keep_float64`: Hugging Face's float32 casts replaced by float64 formulas while inside, and only
then."""

import pytest
import torch

from branchreplay.reference.float64 import keep_float64
from branchreplay.tiny_models import tiny_model


def test_float64_norms_hold_through_train_and_eval_of_a_model_with_hub_kernels(tmp_path):
    """transformers kernelizes a `from_pretrained` model when the kernels package is installed, and each train /
    eval switch replaces the norms' forwards again: inside `keep_float64` the float64 formula must still run after
    both switches, and on exit HF's own forward (its float32 cast) and the kernels come back."""
    pytest.importorskip("kernels", reason="transformers' Hub kernels need the kernels package")
    from transformers import AutoModelForCausalLM

    tiny_model("llama", dtype=torch.float64).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert model.use_kernels  # transformers' default
    norm = model.model.norm
    x = torch.randn(3, norm.weight.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    exact = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    assert not torch.equal(norm(x), exact)  # HF's RMSNorm rounds to float32
    with keep_float64(model):
        model.train()
        model.eval()
        assert torch.equal(norm(x), exact)
    assert not torch.equal(norm(x), exact)
    assert model.use_kernels
