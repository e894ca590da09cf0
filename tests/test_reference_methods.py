"""train.method: the trainer with the naive reference or TRL's padded batch instead of the execution stack trains
the same model. Two runs of one config and seed, float64 (RMSNorms in float64 too, `keep_float64`), stay equal."""

import pytest
import torch

from branchreplay.reference.float64 import keep_float64
from branchreplay.rl.config import Config
from branchreplay.tiny_models import tiny_model
from test_rl_run_trainer import make_config, make_trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(tmp_path, method: str, steps: int = 3, **sections):
    config = make_config(tmp_path / method, model={"dtype": "float64"},
                         train={"method": method, "steps": steps, "log_completions": True}, **sections)
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    with keep_float64(model):
        trainer = make_trainer(config, dtype=torch.float64, model=model)
        completions, losses = [], []
        for step in range(1, steps + 1):
            record = trainer.train_step(step)
            completions.append(trainer.completion_rows)
            losses.append(record["loss"])
    return [p.detach().clone() for p in trainer.model.parameters()], completions, losses


@pytest.mark.parametrize("method", ["naive", "padded"])
def test_reference_methods_train_the_same_model(tmp_path, method):
    """Three GRPO steps with a KL term and two iterations (old-policy and reference passes by the method too): the
    same completions every step and parameters within 1e-10 of branch replay's; the steps do move them."""
    sections = dict(grpo={"beta": 0.05, "num_iterations": 2})
    tree, tree_completions, tree_losses = _run(tmp_path, "branchreplay", **sections)
    other, other_completions, other_losses = _run(tmp_path, method, **sections)
    start = [p.detach() for p in tiny_model("llama", dtype=torch.float64, seed=0).parameters()]
    assert max((a - b).abs().max().item() for a, b in zip(tree, start, strict=True)) > 1e-3
    assert other_completions == tree_completions
    assert other_losses == pytest.approx(tree_losses, rel=1e-9, abs=1e-12)
    assert max((a - b).abs().max().item() for a, b in zip(tree, other, strict=True)) < 1e-10


def test_a_wrong_gradient_is_seen(tmp_path):
    """Control: a run whose loss differs (another clip range) is far from branch replay's."""
    tree, _, _ = _run(tmp_path, "branchreplay", grpo={"num_iterations": 2})
    other, _, _ = _run(tmp_path, "naive", grpo={"epsilon": 0.01, "num_iterations": 2})
    assert max((a - b).abs().max().item() for a, b in zip(tree, other, strict=True)) > 1e-6


@pytest.mark.parametrize("section, values, named", [
    ("algorithm", "rloo", "algorithm=rloo"),
    ("grpo", {"importance_sampling_level": "sequence"}, "GSPO"),
    ("algorithm", "ppo", "algorithm=ppo"),
])
def test_reference_methods_refuse_what_they_do_not_run(section, values, named):
    data = {"train": {"method": "padded"}, section: values}
    with pytest.raises(ValueError, match=named):
        Config.from_dict(data)
    with pytest.raises(ValueError, match="train.method"):
        Config.from_dict({"train": {"method": "tree"}})
