"""LoRA through peft (`model.lora_r`): the engine through a `PeftModel` against the naive reference, the adapters the
only trained parameters, adapter-only checkpoints that resume, `eval` and `export` of a LoRA run."""

import re

import pytest
import torch

from branchreplay.engine import replay_backward
from branchreplay.losses import GRPOLoss
from branchreplay.models import apply_lora
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import Rollout, RolloutTree
from helpers import grads

pytest.importorskip("peft", reason="LoRA needs the peft extra (pip install -e '.[peft]')")


def _lora(model, targets="q_proj,v_proj,gate_proj"):
    """`model` with rank-4 adapters whose B matrices are random (peft starts them at 0, where A gets no gradient)."""
    lora = apply_lora(model, 4, 8.0, targets.split(","))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return lora


def _rollouts():
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 256, (9,), generator=g).tolist()
    shared = torch.randint(3, 256, (3,), generator=g).tolist()
    completions = [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (4, 2, 5)]
    completions.append(torch.randint(3, 256, (6,), generator=g).tolist())
    return [Rollout(prompt + c, loss_mask=[0] * len(prompt) + [1] * len(c), advantages=a,
                    old_logprobs=None, ref_logprobs=[-5.0] * (len(prompt) + len(c)))
            for c, a in zip(completions, (1.0, -0.5, 0.3, -0.8), strict=True)]


def test_engine_through_a_peft_model_equals_the_naive_reference(tiny64):
    model = _lora(tiny64("llama"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    loss = GRPOLoss(beta=0.05, entropy_coef=0.01)
    naive = naive_backward(model, _rollouts(), loss)
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    ours = replay_backward(model, RolloutTree(_rollouts()), loss)
    assert ours.stats.physical_tokens < ours.stats.logical_tokens
    assert abs(ours.loss - naive.loss) <= 1e-12 * abs(naive.loss)
    assert max_rel_grad_err(grads(model), expected) <= 1e-10
    for name, p in model.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == (name in trainable), name


def test_a_target_that_matches_no_module_names_the_field():
    with pytest.raises(ValueError, match=r"model.lora_target_modules.*q_proj"):
        apply_lora(tiny_model("llama"), 4, 8.0, ["query_key_value"])


def test_lora_fields_are_checked():
    from branchreplay.rl.config import Config

    with pytest.raises(ValueError, match="model.lora_r"):
        Config.from_dict({"model": {"lora_r": -1}})
    with pytest.raises(ValueError, match="model.lora_r is 0"):
        Config.from_dict({"model": {"lora_target_modules": "q_proj"}})
    assert Config.from_dict({"model": {"lora_r": 8, "lora_target_modules": "q_proj, v_proj"}}
                            ).model.lora_targets() == ["q_proj", "v_proj"]


def length_reward(completions, **kwargs):
    """A reward with spread inside every group (the tiny model cannot answer the task)."""
    return [float(len(c) % 5) for c in completions]


def _train_args(folder, run, steps=2):
    return ["train", "--model.spec", str(folder), "--task.reward", "test_models_lora:length_reward",
            "--model.lora_r", "4", "--model.lora_target_modules", "q_proj,v_proj",
            "--grpo.num_generations", "4", "--grpo.prompts_per_step", "2", "--grpo.beta", "0.1",
            "--grpo.learning_rate", "0.05", "--sampling.max_new_tokens", "4", "--task.eval_size", "2",
            "--train.steps", str(steps), "--train.eval_steps", "0", "--train.output_dir", str(run)]


@pytest.mark.slow
def test_a_lora_run_saves_the_adapter_only_resumes_evaluates_and_exports(model_folder, tmp_path, capsys):
    """The CLI path of a user: train with LoRA (beta > 0: the reference is the model with its adapter off), stop
    after 1 step and resume to 2 (equal to a straight run), eval --checkpoint the run, export it, and load the
    export with transformers: its logits are the trained adapter's."""
    import json

    from transformers import AutoModelForCausalLM

    from branchreplay.cli import main
    from branchreplay.rl.run.checkpoint import latest_checkpoint, load_weights

    straight, stopped = tmp_path / "straight", tmp_path / "resumed"
    assert main(_train_args(model_folder, straight)) == 0
    assert main(_train_args(model_folder, stopped, steps=1)) == 0
    assert main(["train", "--resume", str(stopped), "--train.steps", "2"]) == 0
    rows = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for run in (straight, stopped)]
    for a, b in zip(*rows, strict=True):
        assert (a["step"], a.get("loss"), a.get("kl"), a.get("grad_norm")) == \
            (b["step"], b.get("loss"), b.get("kl"), b.get("grad_norm"))
    assert rows[0][-1]["kl"] > 0  # the adapter moved the policy away from its reference
    checkpoint = latest_checkpoint(straight)
    files = {f.name for f in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "model.safetensors" not in files
    assert (checkpoint / "adapter_model.safetensors").stat().st_size < 200_000  # the adapter, not the model

    assert main(["eval", "--checkpoint", str(straight)]) == 0
    assert "held-out" in capsys.readouterr().out

    out = tmp_path / "exported"
    assert main(["export", str(straight), str(out)]) == 0
    assert main(["export", str(straight), str(out)]) == 2  # never overwritten
    assert "exists" in capsys.readouterr().err
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    trained = apply_lora(AutoModelForCausalLM.from_pretrained(model_folder), 4, 32.0, ["q_proj", "v_proj"]).eval()
    load_weights(trained, checkpoint)
    base = AutoModelForCausalLM.from_pretrained(model_folder).eval()
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        assert (exported(ids).logits - trained(ids).logits).abs().max() < 1e-4
        assert (exported(ids).logits - base(ids).logits).abs().max() > 1e-3  # training changed it


def test_a_full_checkpoint_into_a_lora_model_is_refused(model_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    from branchreplay.rl.run.checkpoint import load_weights

    lora = apply_lora(AutoModelForCausalLM.from_pretrained(model_folder), 4, 8.0, ["q_proj"])
    (tmp_path / "full").mkdir()
    AutoModelForCausalLM.from_pretrained(model_folder).save_pretrained(tmp_path / "full")
    with pytest.raises(ValueError, match="lora_r to 0"):
        load_weights(lora, tmp_path / "full")


def test_export_of_a_full_run_loads_with_transformers_and_respects_the_umask(model_folder, tmp_path):
    import os

    from transformers import AutoModelForCausalLM

    from branchreplay.cli import main
    from branchreplay.rl.run.checkpoint import latest_checkpoint

    run, out = tmp_path / "run", tmp_path / "exported"
    args = _train_args(model_folder, run, steps=1)
    i = args.index("--model.lora_r")
    del args[i:i + 4]  # no LoRA
    assert main(args) == 0
    assert main(["export", str(latest_checkpoint(run)), str(out)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    assert all(f.stat().st_mode & 0o777 == 0o666 & ~umask for f in out.iterdir())
    exported = AutoModelForCausalLM.from_pretrained(out)
    saved = AutoModelForCausalLM.from_pretrained(latest_checkpoint(run))
    for (name, a), b in zip(exported.named_parameters(), saved.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert (out / "tokenizer.json").is_file()


@pytest.mark.slow
def test_export_refuses_a_merge_that_changes_the_model_and_eval_refuses_another_alpha(model_folder, tmp_path, capsys):
    """Adapters on the LM head of a model with tied embeddings cannot be merged (the merge moves the embedding
    too): export compares the reloaded folder with the adapter model itself, refuses, and writes nothing. An
    adapter loaded into LoRA layers of another lora_alpha is refused by name."""
    from transformers import AutoModelForCausalLM

    from branchreplay.cli import main
    from branchreplay.rl.run.checkpoint import latest_checkpoint, load_weights

    tied = tmp_path / "tied"
    tiny_model("llama", tie_word_embeddings=True).save_pretrained(tied)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_folder / name).is_file():
            (tied / name).write_bytes((model_folder / name).read_bytes())
    run, out = tmp_path / "run", tmp_path / "exported"
    args = _train_args(tied, run, steps=1)
    args[args.index("q_proj,v_proj")] = "lm_head,q_proj"
    assert main(args) == 0
    assert main(["export", str(run), str(out)]) == 2
    assert not out.exists() and not list(tmp_path.glob(".tmp-exported-*"))
    said = capsys.readouterr().err  # far above the bound, which is a fraction of the logits' scale
    diff, bound = (float(x) for x in re.search(r"are ([\d.e+-]+) away .* the bound is ([\d.e+-]+)", said).groups())
    assert diff > 30 * bound, said
    other = apply_lora(AutoModelForCausalLM.from_pretrained(tied), 4, 8.0, ["lm_head", "q_proj"])
    with pytest.raises(ValueError, match="lora_alpha=32.0, the model's LoRA layers 8.0"):
        load_weights(other, latest_checkpoint(run))


def test_the_reload_bound_follows_the_logits_scale():
    """export refused every SmolLM2 LoRA run: a plain merge moved logits of about 33 by 3.1e-4 (a fraction 9.4e-6,
    float32 rounding), over a flat 1e-4. The bound is a fraction of the logits' scale: that merge passes, a
    difference of 0.1% of the scale does not, and small logits keep a floor of 1e-5."""
    from branchreplay.rl.run.export import reload_tolerance

    logits = torch.full((1, 8, 16), 33.0)
    assert reload_tolerance(logits) > 3.1e-4 and reload_tolerance(logits) < 1e-3 * 33
    assert reload_tolerance(torch.full((1, 8, 16), 0.01)) == 1e-5


def test_a_peft_model_samples_through_its_own_forward():
    """The plain Llama decoding step (`llama_rows`, cache_implementation auto on the CPU) would skip the LoRA
    adapters: a peft model, and its base model with LoRA layers injected, decode through their own forward."""
    import branchreplay.decode.rows as rows
    from branchreplay.decode.config import SamplingConfig

    base = tiny_model("llama", seed=0)
    assert rows.uses_plain(base, SamplingConfig())
    lora = _lora(base)
    assert not rows.uses_plain(lora, SamplingConfig())
    assert not rows.uses_plain(lora.base_model.model, SamplingConfig())
