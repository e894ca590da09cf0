"""Every registered family trains, not just verifies: 2 GRPO steps of `branchreplay train` from the command line
(sampling in-process, a reward from the user's own module) then `branchreplay eval` of the model, and 2 steps of the
TRL drop-in `TreeGRPOTrainer`, each on the family's tiny model saved as a user's folder with a word-level tokenizer
of its 256 ids: a run must finish, log both steps and move the weights. And in float64 the trainer's first step (its
own sampled groups, their trees) has the gradient of the naive per-rollout reference: each rollout alone, unpadded,
the unmodified HF forward."""

import json

import pytest
import torch

from branchreplay.cli import main
from branchreplay.engine.families import FAMILIES
from branchreplay.losses import GRPOLoss
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.rl.policy import Policy
from branchreplay.tiny_models import ALL_TINY_ARCHS, tiny_model
from branchreplay.tree import RolloutTree
from helpers import grads, held_float64
from test_engine_families_recurrent import F32_TOL
from test_rl_run_trainer import generate, make_config, make_trainer, with_advantages

pytestmark = pytest.mark.slow  # every family, trained: `make test` runs it, `make test-fast` does not

ARCHS = ALL_TINY_ARCHS
FLOAT32_IN_FLOAT64 = {"minimax_m2", "ernie4_5_moe", "hunyuan_v1_moe"}
"""Families whose transformers forward computes a part in float32 whatever the model's dtype, which `keep_float64`
leaves (test_engine_families_more.py: their routers): the engine and the reference agree to float32 rounding; the
`Family.float32_kernels` ones (SSM scans, delta rules) to the bounds of test_engine_families_recurrent.py."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory, model_folder):
    """arch -> a folder with the family's tiny float32 model and `model_folder`'s tokenizer and chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    out = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(arch)
        tiny_model(arch, dtype=torch.float32, pad_token_id=0, eos_token_id=2).save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[arch] = path
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_train_and_eval_from_the_command_line(arch, folders, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a} {b} 9"}) + "\n" for a in range(3, 9)
                                                  for b in range(3, 5)))
    (tmp_path / "family_train_rewards.py").write_text("def lengths(completions, **kwargs):\n"
                                            "    return [float(len(c) % 5) for c in completions]\n")
    assert main(["train", "--model.spec", str(folders[arch]), "--task.dataset", "train.jsonl", "--task.eval_size",
                 "2", "--task.reward", "family_train_rewards:lengths", "--grpo.num_generations", "3",
                 "--grpo.prompts_per_step", "2", "--sampling.max_new_tokens", "4", "--train.steps", "2",
                 "--train.eval_steps", "-1", "--train.save_steps", "0", "--train.output_dir", "run"]) == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "loss" in s or "loss/policy" in s]
    assert [s["step"] for s in trained] == [1, 2], steps
    assert main(["eval", "--model.spec", str(folders[arch]), "--task.dataset", "train.jsonl", "--task.eval_size",
                 "2", "--task.reward", "family_train_rewards:lengths", "--sampling.max_new_tokens", "4"]) == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_grpo_trainer(arch, folders, tmp_path):
    trl = pytest.importorskip("trl", reason="TRL is the trl extra (pip install -e '.[trl]')")
    from datasets import Dataset
    from transformers import AutoTokenizer

    from branchreplay.trl import TreeGRPOTrainer

    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3,
                          max_completion_length=4, report_to=[], use_cpu=True, bf16=False, max_steps=2,
                          logging_steps=1, seed=0, save_strategy="no", learning_rate=1e-2)
    trainer = TreeGRPOTrainer(model=str(folders[arch]), args=args,
                              reward_funcs=lambda completions, **kw: [float(len(c) % 5) for c in completions],
                              train_dataset=Dataset.from_dict({"prompt": ["3 4 5", "6 7", "8"] * 4}),
                              processing_class=AutoTokenizer.from_pretrained(folders[arch]))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters(), strict=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_first_step_gradient_equals_naive_in_float64(arch, tmp_path, keep64):
    model = tiny_model(arch, dtype=torch.float64)
    held_float64(model)
    trainer = make_trainer(make_config(tmp_path, grpo={"prompts_per_step": 2, "loss_type": "grpo"}), model=model)
    keep64(trainer.model)
    batch = with_advantages(trainer, generate(trainer, 1))
    trees = [RolloutTree(group) for group in batch.rollouts]
    assert sum(float(r.advantages.abs().sum()) for r in batch.flat) > 0, "no advantage: the gradient would be zero"
    trainer.model.zero_grad(set_to_none=True)
    Policy(trainer.model, temperature=0.7).accumulate(trees, GRPOLoss())
    tree_grads = grads(trainer.model)
    trainer.model.zero_grad(set_to_none=True)
    naive_backward(trainer.model, [r for g in batch.rollouts for r in g], GRPOLoss(), temperature=0.7)
    reference = grads(trainer.model)
    assert sum(float(g.abs().sum()) for g in reference) > 0
    error = max_rel_grad_err(tree_grads, reference)
    family = FAMILIES[trainer.model.config.model_type]
    bound = F32_TOL.get(arch, 1e-4) if family.float32_kernels else 1e-6 if arch in FLOAT32_IN_FLOAT64 else 1e-10
    assert error <= bound, f"{arch}: first step's trees vs naive: max relative gradient error {error:.2e}"


@pytest.mark.parametrize("arch", ["qwen3_5_text", "deepseek_v3"])
def test_multi_turn_agent_config_on_a_hybrid_and_an_mla_family(arch, tmp_path, keep64):
    """configs/agent.yaml (trajectories forking 2 then 4 ways at turn boundaries, DAPO) on Qwen3.5 (gated delta-net
    state handed across turns) and DeepSeek-V3 (latent attention): in float64 the first step's gradient over the
    shared-turn trees equals each trajectory alone, then 2 steps train. The environment is test_rl_agent's Counter (a
    user answering "go on" until the third reply); the model's LM head leans toward the end of a turn (id 2), so
    that replies end and turns follow."""
    from branchreplay.rl.config import Config
    from branchreplay.rl.run.trainer import Trainer
    from test_rl_agent import ITEMS, Counter
    from test_rl_agent_environments import TurnTokenizerWithDecode, ending_turns

    config = Config.from_yaml("configs/agent.yaml", [
        "--agent.environment", "tests.unused:Counter", "--sampling.max_new_tokens", "6", "--grpo.prompts_per_step",
        "2", "--grpo.learning_rate", "1e-2", "--train.steps", "2", "--train.eval_steps", "-1", "--train.output_dir",
        str(tmp_path / "run")])
    model = ending_turns(tiny_model(arch, dtype=torch.float64))
    held_float64(model)
    trainer = Trainer(config, model=model, tokenizer=TurnTokenizerWithDecode(), train_data=ITEMS,
                      eval_data=ITEMS[:3], env=Counter())
    keep64(trainer.model)
    batch = with_advantages(trainer, generate(trainer, 1))
    assert max(len(t.conversation.turn_starts) for g in batch.trajectories for t in g) >= 2, "no second turn"
    trees = [RolloutTree(group) for group in batch.rollouts]
    stats = sum((t.stats for t in trees[1:]), trees[0].stats)
    prompt_only = sum(g[0].conversation.turn_starts[0] + sum(len(t.conversation.ids) - t.conversation.turn_starts[0]
                                                             for t in g) for g in batch.trajectories)
    assert stats.physical_tokens < prompt_only, "whole first turns shared, not only the prompt"
    trainer.model.zero_grad(set_to_none=True)
    Policy(trainer.model, temperature=1.0).accumulate(trees, GRPOLoss(loss_type="dapo"))
    tree_grads = grads(trainer.model)
    trainer.model.zero_grad(set_to_none=True)
    naive_backward(trainer.model, [r for g in batch.rollouts for r in g], GRPOLoss(loss_type="dapo"),
                   temperature=1.0)
    error = max_rel_grad_err(tree_grads, grads(trainer.model))
    bound = F32_TOL.get(arch, 1e-4) if FAMILIES[model.config.model_type].float32_kernels else 1e-10
    assert error <= bound, f"{arch}: multi-turn trees vs naive: max relative gradient error {error:.2e}"
    before = [p.detach().clone() for p in trainer.model.parameters()]
    run = trainer.fit()
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "turns/mean" in s] == [1, 2] and steps[-1]["tree/token_ratio"] > 1.0
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters(), strict=True))
