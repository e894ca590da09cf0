"""bfloat16 mixed precision (`models.autocast`: float32 parameters, forwards under torch.autocast): the engine's
gradient is no farther from a float64 copy of the model than the naive per-rollout computation under the same
autocast is, times 1.5 (docs/support.md's bound), on full attention, sliding windows, eager attention and a
recurrent family; and the trainer trains float32 master weights with float32 AdamW state."""

import pytest
import torch

from branchreplay.check.verify import float64_copy
from branchreplay.engine import replay_backward
from branchreplay.engine.attention import PrefixSplit
from branchreplay.engine.families import layer_windows
from branchreplay.engine.recurrent import layer_kinds
from branchreplay.losses import GRPOLoss
from branchreplay.models import autocast
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.reference.shapes import SHAPES, make_rollouts
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import RolloutTree
from helpers import grads
from test_rl_run_trainer import generate, train_on

LOSS = GRPOLoss(epsilon_low=0.2, epsilon_high=0.28, beta=0.05, entropy_coef=0.01)


def _grads_of(run, model) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    run()
    out = grads(model)
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2-sliding", "gemma2", "lfm2"])
def test_autocast_gradient_within_naive_bfloat16_error(arch):
    torch.manual_seed(0)
    model = tiny_model(arch, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    rollouts = make_rollouts(SHAPES["branches-of-branches"](model.config.vocab_size, g), g)
    with float64_copy(model) as model64:
        current = naive_backward(model64, rollouts, None).logprobs
        for r, lp in zip(rollouts, current,
                         strict=True):  # off-policy, from float64: the same loss inputs for every run
            noise = 0.3 * (torch.rand(len(r), generator=g, dtype=torch.float64) - 0.5)
            r.old_logprobs, r.ref_logprobs = (lp + noise) * r.loss_mask, (lp - noise) * r.loss_mask
        g64 = _grads_of(lambda: naive_backward(model64, rollouts, LOSS), model64)
    with autocast("bfloat16", "cpu"):
        g_naive = _grads_of(lambda: naive_backward(model, rollouts, LOSS), model)
        g_tree = _grads_of(lambda: replay_backward(model, RolloutTree(rollouts), LOSS), model)
    assert all(x.dtype == torch.float32 for x in g_tree)  # float32 master gradients
    naive_err, tree_err = max_rel_grad_err(g_naive, g64), max_rel_grad_err(g_tree, g64)
    assert naive_err > 1e-3  # autocast was active: float32 alone is ~1e-5 from float64
    assert tree_err <= 1.5 * naive_err, (tree_err, naive_err)
    assert max_rel_grad_err(g_tree, g_naive) < naive_err  # the same kernels: closer to naive than to float64


def test_autocast_takes_the_masked_attention_path():
    model = tiny_model("llama")
    windows, kinds = layer_windows(model.config), layer_kinds(model.config)
    assert PrefixSplit(model, windows, kinds).applies
    with autocast("bfloat16", "cpu"):
        assert not PrefixSplit(model, windows, kinds).applies
    with autocast("float32", "cpu"):  # a no-op
        assert PrefixSplit(model, windows, kinds).applies


def test_trainer_bfloat16_keeps_float32_master_weights_and_optimizer_state(tmp_path):
    import copy

    from test_rl_run_trainer import make_config, make_trainer

    mixed = make_trainer(make_config(tmp_path, model={"dtype": "bfloat16"}, train={"steps": 2}))
    plain = make_trainer(make_config(tmp_path, train={"output_dir": str(tmp_path / "plain")}))
    batch = generate(mixed, 1)
    ours, theirs = train_on(mixed, copy.deepcopy(batch)), train_on(plain, batch)  # one update on the same rollouts
    assert ours["grad_norm"] != theirs["grad_norm"]  # computed in bfloat16, not float32
    assert abs(ours["grad_norm"] - theirs["grad_norm"]) <= 0.1 * theirs["grad_norm"]
    mixed.fit(resume=None)  # the whole loop, checkpoints included
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    state = mixed.policy.optimizer.state[mixed.policy.params[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_trainer_refuses_float16_and_a_half_precision_model(tmp_path):
    from test_rl_run_trainer import make_config, make_trainer

    with pytest.raises(ValueError, match="model.dtype=float16 cannot train.*use bfloat16"):
        make_trainer(make_config(tmp_path, model={"dtype": "float16"}))
    with pytest.raises(ValueError, match="float32 master weights.*pass it in float32"):
        make_trainer(make_config(tmp_path, model={"dtype": "bfloat16"}), dtype=torch.bfloat16)
