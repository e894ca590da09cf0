"""The TRL drop-in (`branchreplay.trl.TreeGRPOTrainer`) against TRL 1.16's own `GRPOTrainer`.

The reference is TRL's padded forward and backward of the same micro-batch (`GRPOTrainer.compute_loss` on the
inputs TRL's `_prepare_inputs` made: left-padded prompts of three lengths, completions cut to different lengths, a
tool-masked span, off-policy old logprobs that clip), float32, on a tiny random Llama with a word-level tokenizer.
Then both trainers run 2 steps from one seed and must log the same metrics.
"""

import contextlib
import importlib
import sys

import pytest
import torch

from branchreplay.reference.naive import max_rel_grad_err
from branchreplay.tiny_models import tiny_model
from helpers import FLOAT32_REL, float32_close, grads

trl = pytest.importorskip("trl", reason="TRL is the trl extra (pip install -e '.[trl]')")

from branchreplay.trl import TreeGRPOTrainer  # noqa: E402

PROMPTS = ["1 3 4 5 6", "5 6", "7 8 9"]  # three prompt lengths: TRL left-pads two of them
G, C = 4, 8  # generations per prompt, max_completion_length


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama (float32) and a whitespace word-level tokenizer of its 256 ids ("0" pads, "2" ends)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama-trl")
    torch.manual_seed(0)
    tiny_model("llama", dtype=torch.float32).save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel({str(i): i for i in range(256)}, unk_token="0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="0", eos_token="2").save_pretrained(path)
    return path


def length_reward(completions, **kwargs):
    """A reward with spread inside each group: the completion's length in characters, mod 7."""
    return [float(len(c) % 7) for c in completions]


def _trainer(cls, folder, tmp_path, unknown_family=None, **config):
    """`cls` (TRL's trainer or the tree's) on `folder`'s model with GRPOConfig(**config) over this test's settings;
    `unknown_family` goes to the tree's constructor."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    settings = dict(per_device_train_batch_size=G * len(PROMPTS), num_generations=G, max_completion_length=C,
                    report_to=[], use_cpu=True, bf16=False, max_steps=2, logging_steps=1, seed=0, save_strategy="no")
    args = trl.GRPOConfig(output_dir=str(tmp_path / cls.__name__), **{**settings, **config})
    extra = {} if unknown_family is None else {"unknown_family": unknown_family}
    return cls(model=str(folder), reward_funcs=length_reward, args=args,
               train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
               processing_class=AutoTokenizer.from_pretrained(folder), **extra)


def cut_batch(trainer) -> dict:
    """One micro-batch as TRL's GRPO or RLOO trainer makes it (left-padded prompts), its rows 1, 4 and 5 cut to 3,
    5 and 1 completion tokens."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert not bool(inputs["prompt_mask"].all()), "the batch should have left-padded prompts"
    mask = inputs["completion_mask"].clone()
    for row, n in ((1, 3), (4, 5), (5, 1)):
        mask[row, n:] = 0
    inputs["completion_mask"] = mask
    return inputs


def _batch(trainer):
    """`cut_batch`, then made harder: a tool-masked span, old logprobs moved off-policy so that ratios clip (if the
    config has them)."""
    inputs = cut_batch(trainer)
    mask = inputs["completion_mask"]
    tool = torch.ones_like(mask)
    tool[2, 2:5] = 0
    inputs["tool_mask"] = tool
    old = inputs.get("old_per_token_logps")
    if old is not None:
        inputs["old_per_token_logps"] = old + 0.8 * (torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))
                                                     - 0.5)
    return inputs


def _controller(trainer):
    """The adaptive entropy controller's state, which each loss call steps."""
    return trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats


def _logged(trainer, call):
    """Run `call`; the metrics it logged, {name: value}."""
    metrics = trainer._metrics["train"]
    lengths = {key: len(values) for key, values in metrics.items()}
    result = call()
    return result, {key: values[-1] for key, values in metrics.items() if len(values) > lengths.get(key, 0)}


def _trl_and_tree_grads(trainer, inputs, rel=1e-5):
    """Both trainers' gradients of one micro-batch; their logged metrics and (adaptive entropy) controller steps must
    agree within `rel` (bf16 autocast rounds differently in the tree and the padded batch), and their loss values by
    `float32_close` (or `rel` where larger), relative to the value or to its terms' scale, the mean |advantage|: its
    terms cancel, and it is 0 in exact arithmetic where the batch is on-policy."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    before = _controller(trainer)
    trl_loss, trl_metrics = _logged(trainer, lambda: trl.GRPOTrainer.compute_loss(trainer, model, inputs))
    trl_loss.backward()
    theirs, after = grads(model), _controller(trainer)
    trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = before
    model.zero_grad(set_to_none=True)
    loss, metrics = _logged(trainer, lambda: trainer.compute_loss(model, inputs))
    assert loss.requires_grad and loss.grad_fn is None  # the trainer's backward on it adds nothing
    scale = inputs["advantages"].abs().mean().item()
    assert float32_close(loss.item(), trl_loss.item(), scale, max(rel, FLOAT32_REL)), (loss.item(), trl_loss.item())
    assert _controller(trainer)[:2] == pytest.approx(after[:2], rel=rel)
    assert {key for key in metrics if not key.startswith("tree/")} == set(trl_metrics)
    for key, value in trl_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=rel, abs=rel / 100, nan_ok=True), key
    return theirs, grads(model)


CASES = {
    "dapo": {},  # TRL's default loss
    "grpo-kl-off-policy": dict(loss_type="grpo", beta=0.04, num_iterations=2),
    "bnpo-accumulation": dict(loss_type="bnpo", per_device_train_batch_size=G * len(PROMPTS) // 2,
                              gradient_accumulation_steps=2, generation_batch_size=G * len(PROMPTS)),
    "dr_grpo-entropy": dict(loss_type="dr_grpo", entropy_coef=0.01),
    "cispo-kl": dict(loss_type="cispo", epsilon_high=1.05, beta=0.1, num_iterations=2),
    "sapo-temperature": dict(loss_type="sapo", temperature=0.7),
    "luspo-delta": dict(loss_type="luspo", delta=1.2, num_iterations=2),
    # the two-pass path: TRL's own loss on the tree's rows
    "gspo-kl": dict(importance_sampling_level="sequence", loss_type="grpo", beta=0.04, num_iterations=2),
    "gspo-dapo-entropy": dict(importance_sampling_level="sequence", entropy_coef=0.01, num_iterations=2),
    "vespo": dict(loss_type="vespo", num_iterations=2),
    "top_entropy_quantile": dict(top_entropy_quantile=0.5, entropy_coef=0.02),
    "off_policy_mask": dict(off_policy_mask_threshold=0.02, num_iterations=2),
    "adaptive_entropy": dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0,
                             entropy_coef_delta=0.005, loss_type="bnpo"),
}


SETTING_OFF = {  # the two-pass cases' setting, turned off: the gradient must change
    "gspo-kl": ("importance_sampling_level", "token"), "gspo-dapo-entropy": ("importance_sampling_level", "token"),
    "vespo": ("loss_type", "dapo"), "top_entropy_quantile": ("top_entropy_quantile", 1.0),
    "off_policy_mask": ("off_policy_mask_threshold", None), "adaptive_entropy": ("use_adaptive_entropy", False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.float32
def test_tree_gradient_equals_grpo_trainer_on_the_same_batch(folder, tmp_path, case):
    trainer = _trainer(TreeGRPOTrainer, folder, tmp_path, **CASES[case])
    inputs = _batch(trainer)
    theirs, ours = _trl_and_tree_grads(trainer, inputs)
    assert sum(float(g.abs().sum()) for g in theirs) > 0
    if "num_iterations" in CASES[case] and case != "vespo":  # off-policy: some ratios clip, in both trainers' metrics
        clipped = "cispo_clip_ratio" if case.startswith("cispo") else "clip_ratio/region_mean"
        assert trainer._metrics["train"][clipped][-1] > 0
    print(f"{case}: gradient {max_rel_grad_err(ours, theirs):.1e} from TRL's")
    assert max_rel_grad_err(ours, theirs) <= 1e-4, max_rel_grad_err(ours, theirs)
    if case in SETTING_OFF:
        name, off = SETTING_OFF[case]
        setattr(trainer, name, off)
        trainer.model.zero_grad(set_to_none=True)
        trainer.compute_loss(trainer.model, inputs)
        assert max_rel_grad_err(grads(trainer.model), theirs) > 1e-3, f"{name} changed nothing on the test batch"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dapo", "grpo-kl-off-policy"])
def test_the_test_batch_trips_on_a_wrong_mask(folder, tmp_path, case):
    """The comparison can fail: the same batch without its tool mask on the tree's side differs from TRL's, in the
    gradient and in the loss by the float32 bound."""
    trainer = _trainer(TreeGRPOTrainer, folder, tmp_path, **CASES[case])
    inputs = _batch(trainer)
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trl_loss = trl.GRPOTrainer.compute_loss(trainer, model, inputs)
    trl_loss.backward()
    theirs = grads(model)
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, {k: v for k, v in inputs.items() if k != "tool_mask"})
    assert max_rel_grad_err(grads(model), theirs) > 1e-2
    assert not float32_close(loss.item(), trl_loss.item(), inputs["advantages"].abs().mean().item())


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["token", "sequence"])
def test_vllm_importance_sampling_correction_equals_trl(folder, tmp_path, shape):
    """TRL's importance-sampling weights of vLLM rollouts, given on the batch as TRL's modes make them: per token
    ([B, C]) or per sequence ([B, 1]), with zeros (the *_mask modes drop rows), under a KL term and an entropy
    bonus, which TRL does not scale: the gradient, the loss and the policy_loss metric equal TRL's."""
    trainer = _trainer(TreeGRPOTrainer, folder, tmp_path, loss_type="grpo", beta=0.04, entropy_coef=0.05)
    inputs = _batch(trainer)
    B, C = inputs["completion_mask"].shape
    ratio = 0.5 + torch.rand((B, C) if shape == "token" else (B, 1), generator=torch.Generator().manual_seed(2))
    ratio[0] = ratio[3] = 0.0
    inputs["importance_sampling_ratio"] = ratio
    trainer.use_vllm = True  # only the loss reads it here; nothing is generated
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trl_loss = trl.GRPOTrainer.compute_loss(trainer, model, inputs)
    trl_loss.backward()
    theirs = grads(model)
    model.zero_grad(set_to_none=True)
    ours = trainer.compute_loss(model, inputs)
    assert max_rel_grad_err(grads(model), theirs) <= 1e-4
    assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-5)
    policy = trainer._metrics["train"]["policy_loss"]
    assert policy[-1] == pytest.approx(policy[-2], rel=1e-5)  # TRL's value, then ours
    trainer.vllm_importance_sampling_correction = False
    model.zero_grad(set_to_none=True)
    trainer.compute_loss(model, inputs)
    assert max_rel_grad_err(grads(model), theirs) > 1e-3  # the correction did something


def test_clip_metrics_equal_trl_with_two_sided_clipping(folder, tmp_path):
    """With delta below 1 + epsilon_high TRL counts clipping on the ratio after delta; so does the tree."""
    trainer = _trainer(TreeGRPOTrainer, folder, tmp_path, loss_type="grpo", delta=1.1, num_iterations=2)
    _trl_and_tree_grads(trainer, _batch(trainer))
    metrics = trainer._metrics["train"]
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max"):
        assert metrics[key][-1] == pytest.approx(metrics[key][-2], abs=1e-9), key
    assert metrics["clip_ratio/region_mean"][-1] > 0


def test_active_dropout_is_refused_when_the_trainer_is_built(folder, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    model.model.layers[0].self_attn.q_proj = torch.nn.Sequential(model.model.layers[0].self_attn.q_proj,
                                                                 torch.nn.Dropout(0.1))
    from datasets import Dataset
    from transformers import AutoTokenizer

    args = trl.GRPOConfig(output_dir=str(tmp_path / "dropout"), per_device_train_batch_size=G, num_generations=G,
                          max_completion_length=C, report_to=[], use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="disable_dropout=True"):
        TreeGRPOTrainer(model=model, reward_funcs=length_reward, args=args,
                        processing_class=AutoTokenizer.from_pretrained(folder),
                        train_dataset=Dataset.from_dict({"prompt": PROMPTS}))


def test_bf16_autocast_is_as_close_to_float32_as_trl(folder, tmp_path):
    """TRL's default bf16=True autocasts both paths: against the float32 gradient, the tree's error is no larger
    than 1.5x TRL's own."""
    trainer = _trainer(TreeGRPOTrainer, folder, tmp_path, bf16=True, beta=0.04)
    inputs = _batch(trainer)
    theirs, ours = _trl_and_tree_grads(trainer, inputs, rel=1e-2)
    trainer.accelerator.autocast = contextlib.nullcontext
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trl.GRPOTrainer.compute_loss(trainer, model, inputs).backward()
    exact = grads(model)
    print(f"bf16 against float32: tree {max_rel_grad_err(ours, exact):.3g}, TRL {max_rel_grad_err(theirs, exact):.3g}")
    assert max_rel_grad_err(ours, exact) <= 1.5 * max_rel_grad_err(theirs, exact)
    assert max_rel_grad_err(ours, exact) < 0.3


def test_cast_lm_head_to_fp32_runs_the_trees_head_in_float32(folder, tmp_path):
    """cast_lm_head_to_fp32 under bf16 autocast: the engine's head runs in float32 as TRL's fused head (its exactness:
    tests/test_engine_head.py), and the gradient is as close to the float32 one as TRL's."""
    from branchreplay.engine import head

    trainer = _trainer(TreeGRPOTrainer, folder, tmp_path, bf16=True, beta=0.04, cast_lm_head_to_fp32=True)
    assert trainer.engine.head_float32 and trainer.model.lm_head.weight.dtype == torch.float32
    inputs = _batch(trainer)
    calls = []
    real = head.scaled_logits
    with pytest.MonkeyPatch.context() as patch:  # the trainer's step reaches the engine's head with float32 on
        patch.setattr(head, "scaled_logits", lambda *a, **k: calls.append(a[4] if len(a) > 4 else k) or real(*a, **k))
        theirs, ours = _trl_and_tree_grads(trainer, inputs, rel=1e-2)
    assert calls and all(c is True for c in calls)
    trainer.accelerator.autocast = contextlib.nullcontext
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trl.GRPOTrainer.compute_loss(trainer, model, inputs).backward()
    exact = grads(model)
    assert max_rel_grad_err(ours, exact) <= 1.5 * max_rel_grad_err(theirs, exact)


def two_step_logs(make, trl_cls, tree_cls, key: str = "reward") -> list[tuple[dict, dict]]:
    """Both trainers (`make(cls)` builds one) trained 2 steps from one seed: per step (TRL's log, the tree's), after
    checking that there are 2, that the tree logs every key TRL logs and that it shared prefixes."""
    logs = {}
    for cls in (trl_cls, tree_cls):
        trainer = make(cls)
        trainer.train()
        logs[cls] = [h for h in trainer.state.log_history if key in h]
    assert len(logs[trl_cls]) == len(logs[tree_cls]) == 2
    for theirs, ours in zip(logs[trl_cls], logs[tree_cls], strict=True):
        assert ours["tree/token_ratio"] > 1.0
        assert set(theirs) <= set(ours)
    return list(zip(logs[trl_cls], logs[tree_cls], strict=True))


@pytest.mark.slow
@pytest.mark.float32
def test_two_steps_log_the_same_metrics(folder, tmp_path):
    """Same seed, same config (TRL's defaults: dapo, gradient checkpointing on): after 2 steps the logged loss,
    reward, entropy, KL, clip ratios and gradient norms agree, and the tree adds tree/* metrics."""
    steps = two_step_logs(lambda cls: _trainer(cls, folder, tmp_path, beta=0.04), trl.GRPOTrainer, TreeGRPOTrainer)
    for step_theirs, step_ours in steps:
        for key in ("reward", "rewards/length_reward/mean", "grad_norm", "entropy", "kl", "loss",
                    "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max", "completions/mean_length"):
            assert step_ours[key] == pytest.approx(step_theirs[key], rel=1e-4, abs=1e-6), key
        assert step_ours["num_tokens"] == step_theirs["num_tokens"]


@pytest.fixture(scope="module")
def moe_folder(folder, tmp_path_factory):
    """A tiny random float32 Qwen3-MoE (4 experts, top 2) with the test tokenizer; TRL turns its router aux loss on
    (the config has output_router_logits, and router_aux_loss_coef 0.001)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    torch.manual_seed(0)
    tiny_model("qwen3_moe", dtype=torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(folder).save_pretrained(path)
    return path


@pytest.mark.parametrize("config", [dict(router_aux_loss_coef=0.5), dict(router_aux_loss_coef=0.5, beta=0.04,
                                                                         importance_sampling_level="sequence")])
def test_moe_router_aux_loss_over_the_tree_equals_trl(moe_folder, tmp_path, config):
    """The router load-balancing loss TRL adds (transformers' load_balancing_loss_func over the padded batch, every
    real token counted) runs over the tree, each shared position counted once per row: the gradient, the loss and
    the aux_loss metric equal TRL's; with the coefficient at 0 the gradient changes."""
    trainer = _trainer(TreeGRPOTrainer, moe_folder, tmp_path, **config)
    assert trainer.aux_loss_enabled
    inputs = _batch(trainer)
    theirs, ours = _trl_and_tree_grads(trainer, inputs)
    assert trainer._metrics["train"]["aux_loss"][-1] > 0
    print(f"router aux loss: gradient {max_rel_grad_err(ours, theirs):.1e} from TRL's")
    assert max_rel_grad_err(ours, theirs) <= 1e-4, max_rel_grad_err(ours, theirs)
    trainer.aux_loss_enabled = False
    trainer.model.zero_grad(set_to_none=True)
    trainer.compute_loss(trainer.model, inputs)
    assert max_rel_grad_err(grads(trainer.model), theirs) > 1e-3


def _family_folder(folder, tmp_path, model_type, **config):
    """A tiny random float32 model of `model_type` (transformers' config of it) with the test tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = tmp_path / f"tiny-{model_type}"
    torch.manual_seed(0)
    base = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, head_dim=16, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **base, **config)).save_pretrained(path)
    AutoTokenizer.from_pretrained(folder).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("model_type, config", [
    ("cohere2", dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32)),
])
def test_unregistered_families_are_self_checked_when_built_and_then_exact(folder, tmp_path, model_type, config):
    """Families outside the engine's registry that TRL's tests use: the self-check runs in the constructor, and
    the gradient then equals TRL's on its batch."""
    trainer = _trainer(TreeGRPOTrainer, _family_folder(folder, tmp_path, model_type, **config), tmp_path)
    assert trainer._trusted is True
    theirs, ours = _trl_and_tree_grads(trainer, _batch(trainer))
    assert max_rel_grad_err(ours, theirs) <= 1e-4, max_rel_grad_err(ours, theirs)
    with pytest.raises(ValueError, match=f"TreeGRPOTrainer: model family '{model_type}' is not supported"):
        _trainer(TreeGRPOTrainer, trainer.model.name_or_path, tmp_path, unknown_family="refuse")


def test_nemotron_h_runs_and_equals_trl(folder, tmp_path):
    """NemotronH (Mamba-2, attention and MLP layers, as TRL's tests build it): registered, so no self-check and no
    refusal; the gradient equals TRL's on its batch to float32 rounding (its scan computes in float32)."""
    path = _family_folder(folder, tmp_path, "nemotron_h", hybrid_override_pattern="M*-", mamba_num_heads=4,
                          mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=8)
    trainer = _trainer(TreeGRPOTrainer, path, tmp_path)
    assert trainer._trusted is False
    theirs, ours = _trl_and_tree_grads(trainer, _batch(trainer))
    assert max_rel_grad_err(ours, theirs) <= 1e-4, max_rel_grad_err(ours, theirs)


def test_a_family_the_engine_cannot_run_is_refused_when_built(folder, tmp_path, monkeypatch):
    """zamba (Zamba v1: Mamba and shared attention layers, not in the registry): refused in the constructor with the
    reason, before anything is generated."""
    path = _family_folder(folder, tmp_path, "zamba", layer_types=["hybrid", "hybrid"], n_mamba_heads=2,
                          mamba_d_state=8)
    monkeypatch.setattr(trl.GRPOTrainer, "_generate", lambda *a, **k: pytest.fail("generated before refusing"))
    with pytest.raises(ValueError, match="TreeGRPOTrainer: zamba: .*recurrent or hybrid layers"):
        _trainer(TreeGRPOTrainer, path, tmp_path)


def test_a_trl_version_outside_the_range_is_refused_at_import(monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    monkeypatch.delitem(sys.modules, "branchreplay.trl")
    with pytest.raises(ImportError, match=r"TRL >= 1.16, < 1.17.*1\.17\.0"):
        importlib.import_module("branchreplay.trl")
