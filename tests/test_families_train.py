"""The families registered from the census train, not just verify: 2 GRPO steps of `branchreplay train` from the
command line (sampling in-process, a reward from the user's own module) and 2 steps of the TRL drop-in
`TreeGRPOTrainer`, each on the family's tiny model saved as a user's folder with a word-level tokenizer of its 256
ids. Their gradients' exactness is the engine tests' (test_engine_families_*.py); here a run must finish, log both
steps and move the weights."""

import json

import pytest
import torch

from branchreplay.cli import main
from branchreplay.tiny_models import tiny_model

ARCHS = ["qwen3_5_text", "qwen3_5_moe_text", "gpt_oss", "deepseek_v3", "glm4_moe_lite", "gemma4", "llama4",
         "granitemoehybrid", "lfm2_moe", "kimi_linear", "olmo3", "smollm3", "glm4_moe"]


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
def test_train_from_the_command_line(arch, folders, tmp_path, monkeypatch):
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
