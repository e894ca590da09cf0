"""The RLOO drop-in (`branchreplay.trl.TreeRLOOTrainer`) against TRL 1.16's own `RLOOTrainer`.

As for GRPO (tests/test_trl_grpo.py): TRL's padded forward and backward of the same micro-batch (left-padded
prompts of three lengths, completions cut to different lengths, old logprobs moved off-policy so that ratios clip),
float32, tiny random Llama; then both trainers run 2 steps from one seed and must log the same metrics.
"""

import pytest
import torch

from branchreplay.reference.naive import max_rel_grad_err
from helpers import grads

trl = pytest.importorskip("trl", reason="TRL is the trl extra (pip install -e '.[trl]')")

from branchreplay.trl import TreeRLOOTrainer  # noqa: E402
from test_trl_grpo import PROMPTS, C, G, _logged, cut_batch, folder, length_reward, moe_folder, two_step_logs  # noqa: E402, F401


def _trainer(cls, model_folder, tmp_path, **config):
    from datasets import Dataset
    from transformers import AutoTokenizer

    settings = dict(per_device_train_batch_size=G * len(PROMPTS), num_generations=G, max_completion_length=C,
                    report_to=[], use_cpu=True, bf16=False, max_steps=2, logging_steps=1, seed=0, save_strategy="no")
    args = trl.RLOOConfig(output_dir=str(tmp_path / cls.__name__), **{**settings, **config})
    return cls(model=str(model_folder), reward_funcs=length_reward, args=args,
               train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
               processing_class=AutoTokenizer.from_pretrained(model_folder))


def _batch(trainer, shift=0.0):
    """One micro-batch as TRL makes it, rows cut to different lengths (their old logprobs summed again), old
    logprobs moved by up to `shift` / 2 nats."""
    inputs = cut_batch(trainer)
    mask = inputs["completion_mask"]
    with torch.no_grad():  # the sampling policy's summed logprobs of the cut rows (TRL's padded forward)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], mask], dim=1)
        per_token, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, mask.shape[1])
    g = torch.Generator().manual_seed(1)
    noise = shift * (torch.rand(mask.shape[0], generator=g) - 0.5)
    inputs["old_logps"] = (per_token * mask).sum(1) + noise
    return inputs


def _trl_and_tree_grads(trainer, inputs):
    """Both gradients as transformers' training step makes them (TRL's RLOO loss is divided by the accumulation
    steps before its backward); the loss values and logged metrics must agree."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trl_loss, trl_metrics = _logged(trainer, lambda: trl.RLOOTrainer.compute_loss(trainer, model, inputs))
    (trl_loss / trainer.current_gradient_accumulation_steps).backward()
    theirs = grads(model)
    model.zero_grad(set_to_none=True)
    loss, metrics = _logged(trainer, lambda: trainer.compute_loss(model, inputs))
    assert loss.requires_grad and loss.grad_fn is None
    # on-policy the loss is about 0: O(1) terms summed in two orders in float32 (measured 2.3e-6 apart)
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-5)
    assert {key for key in metrics if not key.startswith("tree/")} == set(trl_metrics)
    for key, value in trl_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), key
    return theirs, grads(model)


CASES = {
    "defaults": ({}, 0.0),
    "off-policy-clipped": (dict(num_iterations=2, epsilon=0.1), 0.6),
    "kl-normalized-accumulation": (dict(beta=0.05, normalize_advantages=True, gradient_accumulation_steps=2,
                                        per_device_train_batch_size=G * len(PROMPTS) // 2,
                                        generation_batch_size=G * len(PROMPTS)), 0.0),
    "temperature": (dict(temperature=0.7), 0.0),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.float32
def test_tree_gradient_equals_rloo_trainer_on_the_same_batch(folder, tmp_path, case):  # noqa: F811
    config, shift = CASES[case]
    trainer = _trainer(TreeRLOOTrainer, folder, tmp_path, **config)
    inputs = _batch(trainer, shift)
    theirs, ours = _trl_and_tree_grads(trainer, inputs)
    assert sum(float(g.abs().sum()) for g in theirs) > 0
    if shift:
        assert trainer._metrics["train"]["clip_ratio/region_mean"][-1] > 0
    print(f"{case}: gradient {max_rel_grad_err(ours, theirs):.1e} from TRL's")
    assert max_rel_grad_err(ours, theirs) <= 1e-4, max_rel_grad_err(ours, theirs)


@pytest.mark.slow
def test_moe_router_aux_loss_over_the_tree_equals_rloo_trainer(moe_folder, tmp_path):  # noqa: F811
    """TRL's router load-balancing loss of an MoE model (test_trl_grpo.py's GRPO case): equal over the tree."""
    trainer = _trainer(TreeRLOOTrainer, moe_folder, tmp_path, router_aux_loss_coef=0.5)
    theirs, ours = _trl_and_tree_grads(trainer, _batch(trainer))
    assert trainer._metrics["train"]["aux_loss"][-1] > 0
    assert max_rel_grad_err(ours, theirs) <= 1e-4, max_rel_grad_err(ours, theirs)


def test_the_rloo_batch_trips_on_a_wrong_mask(folder, tmp_path):  # noqa: F811
    """The comparison can fail: one row's completion cut one token shorter on the tree's side only."""
    trainer = _trainer(TreeRLOOTrainer, folder, tmp_path)
    inputs = _batch(trainer)
    model = trainer.model
    model.zero_grad(set_to_none=True)
    (trl.RLOOTrainer.compute_loss(trainer, model, inputs)).backward()
    theirs = grads(model)
    mask = inputs["completion_mask"].clone()
    mask[0, int(mask[0].sum()) - 1] = 0
    model.zero_grad(set_to_none=True)
    trainer.compute_loss(model, {**inputs, "completion_mask": mask})
    assert max_rel_grad_err(grads(model), theirs) > 1e-3


@pytest.mark.slow
@pytest.mark.float32
def test_two_rloo_steps_log_the_same_metrics(folder, tmp_path):  # noqa: F811
    steps = two_step_logs(lambda cls: _trainer(cls, folder, tmp_path, beta=0.05), trl.RLOOTrainer, TreeRLOOTrainer)
    for step_theirs, step_ours in steps:
        for key in ("reward", "grad_norm", "entropy", "clip_ratio/region_mean", "completions/mean_length"):
            assert step_ours[key] == pytest.approx(step_theirs[key], rel=1e-4, abs=1e-6), key
        # on-policy the loss is about 0: sum_i A_i exp(logp_i - old_logp_i) over zero-mean advantages, where the
        # tree's logp and TRL's padded old_logp differ in float32's last bits
        assert step_ours["loss"] == pytest.approx(step_theirs["loss"], abs=1e-5)


def test_rloo_refusals_name_rlooconfig(folder, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match=r"TreeRLOOTrainer: fp16=True"):
        _trainer(TreeRLOOTrainer, folder, tmp_path, fp16=True)
