"""The TRL drop-in on vision-language models: `TreeGRPOTrainer` against TRL 1.16's `GRPOTrainer` on the same
micro-batch of a tiny Gemma3ForConditionalGeneration (float32) with a local Gemma3 processor
(`tiny_models.save_tiny_vision_model`: PIL image processor, a word-level tokenizer with Gemma3's image tokens): each
prompt's images in its tree's prompt node, the vision tower run once per tree; prompts with equal text but other
images make separate trees. Qwen2-VL (whose processor needs torchvision, not installed here): a batch laid out as
TRL's (pixel rows per image_grid_thw) over the tree against the padded forward TRL runs on it."""

import numpy as np
import pytest
import torch

from branchreplay.reference.naive import max_rel_grad_err
from branchreplay.tiny_models import save_tiny_vision_model, tiny_vision_model

trl = pytest.importorskip("trl", reason="TRL is the trl extra (pip install -e '.[trl]')")

from branchreplay.trl import TreeGRPOTrainer, rows  # noqa: E402
from test_trl_grpo import _trl_and_tree_grads  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

G, C = 4, 6


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory):
    """`tiny_models.save_tiny_vision_model` (float32) with a whitespace word-level tokenizer of 256 ids ("0" pads, "2"
    ends) and Gemma3's image tokens added (256, 257, 258), padding on the left: TRL takes token_type_ids from the
    processor's padding as they come, so with right padding they would not line up with its left-padded
    prompt_ids (TRL's padded forward then shifts the bidirectional image blocks of the shorter prompts; the tree
    reads the placeholders in the ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = tmp_path_factory.mktemp("word-level")
    tokenizer = Tokenizer(models.WordLevel({str(i): i for i in range(256)}, unk_token="0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="0", eos_token="2").save_pretrained(words)
    path = tmp_path_factory.mktemp("tiny-gemma3-vlm")
    save_tiny_vision_model(path, words)
    return path


def length_reward(completions, **kwargs):
    """A reward with spread inside each group: the (conversational) completion's length in characters, mod 7."""
    return [float(len(c[0]["content"]) % 7) for c in completions]


def _trainer(folder, tmp_path, **config):
    """TreeGRPOTrainer on three image prompts, two with equal text and other images; G generations each, the image
    tokens suppressed in the completions (TRL's padded forward counts every placeholder in a row)."""
    from datasets import Dataset, Image
    from transformers import AutoProcessor

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 255, (64, 64, 3), dtype=np.uint8) for _ in range(3)]
    prompts = [[{"role": "user", "content": text}] for text in ("1 3 4 5 6", "1 3 4 5 6", "7 8 9")]
    dataset = Dataset.from_dict({"prompt": prompts, "image": images}).cast_column("image", Image())
    settings = dict(per_device_train_batch_size=G * 3, num_generations=G, max_completion_length=C, report_to=[],
                    use_cpu=True, bf16=False, max_steps=1, seed=0, save_strategy="no",
                    generation_kwargs={"suppress_tokens": [256, 257, 258]})
    args = trl.GRPOConfig(output_dir=str(tmp_path / "vlm"), **{**settings, **config})
    return TreeGRPOTrainer(model=str(folder), reward_funcs=length_reward, args=args, train_dataset=dataset,
                           processing_class=AutoProcessor.from_pretrained(folder))


def _inputs(trainer) -> dict:
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert inputs["pixel_values"].shape[0] == G * 3 and inputs["token_type_ids"].sum() > 0
    return inputs


@pytest.mark.parametrize("config", [{}, dict(importance_sampling_level="sequence", beta=0.04, num_iterations=2)],
                         ids=["dapo", "gspo-kl"])
def test_images_over_the_tree_equal_grpo_trainer_on_the_same_batch(vlm_folder, tmp_path, config):
    trainer = _trainer(vlm_folder, tmp_path, **config)
    inputs = _inputs(trainer)
    trees, _ = rows.prompt_trees(inputs, rows.batch_rollouts(inputs, inputs["completion_mask"])[0], trainer.model)
    assert len(trees) == 3 and all(t.images is not None for t in trees)  # equal text, other images: other trees
    theirs, ours = _trl_and_tree_grads(trainer, inputs)
    names = [n for n, _ in trainer.model.named_parameters()]
    vision = [g for n, g in zip(names, theirs, strict=True) if "vision_tower" in n]
    assert sum(float(g.abs().sum()) for g in vision) > 0
    # a key projection's bias has a zero gradient in exact arithmetic (the softmax cancels it): float32 noise of
    # 1e-9 on both sides, beneath max_rel_grad_err's floor for float64 but not for float32; left out
    kept = [k for k, n in enumerate(names) if not n.endswith("k_proj.bias")]
    theirs, ours = [theirs[k] for k in kept], [ours[k] for k in kept]
    print(f"{config}: gradient {max_rel_grad_err(ours, theirs):.1e} from TRL's")
    assert max_rel_grad_err(ours, theirs) <= 1e-4


def test_prompts_grouped_by_text_alone_would_fail(vlm_folder, tmp_path, monkeypatch):
    """The control: every row given the first row's pixels (trees by text alone) differs from TRL."""
    trainer = _trainer(vlm_folder, tmp_path)
    inputs = _inputs(trainer)
    theirs, _ = _trl_and_tree_grads(trainer, inputs)
    real = rows.row_images
    monkeypatch.setattr(rows, "row_images", lambda batch: [real(batch)[0]] * batch["prompt_ids"].shape[0])
    trainer.model.zero_grad(set_to_none=True)
    trainer.compute_loss(trainer.model, inputs)
    from helpers import grads
    assert max_rel_grad_err(grads(trainer.model), theirs) > 1e-3


def test_a_vision_language_model_the_tree_does_not_run_is_refused_when_built(tmp_path):
    from branchreplay.engine import UnsupportedModelError
    from branchreplay.trl.base import check_family

    model = tiny_vision_model()
    model.config.model_type = "llava"  # a model whose image inputs have not been checked
    with pytest.raises(UnsupportedModelError, match="TreeGRPOTrainer: vision-language model 'llava'"):
        check_family(model, "refuse", "TreeGRPOTrainer")


def _qwen2_vl_batch(g: torch.Generator) -> dict:
    """A Qwen2-VL micro-batch laid out as TRL's GRPO batch (`_get_per_token_logps_and_entropies`): two prompts of
    other lengths (left-padded), images of other grids, and, for the first, two images; 2 completions each
    (right-padded); pixel_values rows t * h * w per image, image_grid_thw and num_images per row, mm_token_type_ids
    over prompt and completion. (Qwen2-VL's processor needs torchvision for its video processor: not here.)"""
    image, start = 250, 251
    text = lambda n: torch.randint(3, 200, (n,), generator=g).tolist()  # noqa: E731
    grids = [[[1, 4, 4], [1, 2, 6]], [[1, 6, 2]]]  # per prompt: 4 + 3 placeholders; 3
    prompts = [text(2) + [start] + [image] * 4 + text(1) + [start] + [image] * 3 + text(3),
               text(4) + [start] + [image] * 3 + text(2)]
    P, C = max(map(len, prompts)), 5
    rows = [(k, text(n)) for k in (0, 1) for n in (C, 3)]
    prompt_ids = torch.tensor([[0] * (P - len(prompts[k])) + prompts[k] for k, _ in rows])
    completion = torch.tensor([c + [0] * (C - len(c)) for _, c in rows])
    thw = torch.tensor([grid for k, _ in rows for grid in grids[k]])
    pixels = [torch.randn(int(torch.tensor(grids[k]).prod(-1).sum()), 24, generator=g, dtype=torch.float64)
              for k in (0, 1)]  # each prompt's images, repeated on its rows as TRL's batch does
    ids = torch.cat([prompt_ids, completion], 1)
    return {"prompt_ids": prompt_ids, "prompt_mask": (prompt_ids != 0).long(), "completion_ids": completion,
            "completion_mask": (completion != 0).long(), "advantages": torch.randn(len(rows), generator=g),
            "pixel_values": torch.cat([pixels[k] for k, _ in rows]),
            "image_grid_thw": thw, "num_images": [len(grids[k]) for k, _ in rows],
            "mm_token_type_ids": (ids == image).int()}


def test_qwen2_vl_rows_over_the_tree_equal_the_padded_batch_forward():
    """Qwen2-VL's TRL batch over the tree (`rows.prompt_trees`: each row's pixel rows and grids, one tree per
    prompt and images, rotary positions on the image grid) against the padded forward TRL runs on that batch
    (the model with attention_mask, pixel_values, image_grid_thw, mm_token_type_ids), float64 logprobs."""
    from branchreplay.engine import replay_logprobs
    from branchreplay.reference.float64 import keep_float64
    from helpers import tiny_qwen2_vl_model

    g = torch.Generator().manual_seed(0)
    batch = _qwen2_vl_batch(g)
    model = tiny_qwen2_vl_model(torch.float64)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    with keep_float64(model), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
                       pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                       mm_token_type_ids=batch["mm_token_type_ids"]).logits
        P = batch["prompt_ids"].shape[1]
        theirs = logits[:, P - 1:-1].log_softmax(-1).gather(-1, batch["completion_ids"][..., None])[..., 0]
        rollouts, lengths = rows.batch_rollouts(batch, batch["completion_mask"])
        trees, order = rows.prompt_trees(batch, rollouts, model)
        assert len(trees) == 2 and all(t.images.rope_positions is not None for t in trees)
        result = replay_logprobs(model, trees)
    errors = [float((lp[-lengths[row]:] - theirs[row, :lengths[row]]).abs().max()) for row, lp in
              zip(order, result.logprobs, strict=True)]
    print(f"Qwen2-VL batch: logprobs {max(errors):.1e} from the padded forward")
    assert max(errors) <= 1e-10
    wrong = dict(batch, mm_token_type_ids=torch.zeros_like(batch["mm_token_type_ids"]))
    with pytest.raises(ValueError, match="mm_token_type_ids marks other prompt positions"):
        rows.prompt_trees(wrong, rollouts, model)
    with pytest.raises(ValueError, match="pixel_values has 77 rows for 6 images"):
        rows.prompt_trees(dict(batch, pixel_values=batch["pixel_values"][:-3]), rollouts, model)
    tool_image = batch["completion_ids"].clone()
    tool_image[0, 1] = model.config.image_token_id  # an image inside a completion (a tool's): refused by name
    with pytest.raises(ValueError, match="a completion holds image placeholders"):
        rows.prompt_trees(dict(batch, completion_ids=tool_image), rollouts, model)


def _dpo_trainer(folder, tmp_path, **config):
    """TreeDPOTrainer on three image prompts' pairs (conversational), two prompts with equal text and other images;
    chosen and rejected of a pair share their first word."""
    from datasets import Dataset, Image
    from transformers import AutoProcessor

    from branchreplay.trl import TreeDPOTrainer

    rng = np.random.default_rng(1)
    images = [rng.integers(0, 255, (64, 64, 3), dtype=np.uint8) for _ in range(3)]
    say = lambda role, text: [{"role": role, "content": text}]  # noqa: E731
    data = {"prompt": [say("user", t) for t in ("1 3 4 5 6", "1 3 4 5 6", "7 8 9")],
            "chosen": [say("assistant", t) for t in ("10 11 12 2", "20 21 2", "30 31 32 33 2")],
            "rejected": [say("assistant", t) for t in ("10 14 2", "22 2", "30 2")], "image": images}
    dataset = Dataset.from_dict(data).cast_column("image", Image())
    settings = dict(per_device_train_batch_size=3, report_to=[], use_cpu=True, bf16=False, max_steps=1, seed=0,
                    save_strategy="no", learning_rate=1e-3)
    args = trl.DPOConfig(output_dir=str(tmp_path / "dpo-vlm"), **{**settings, **config})
    return TreeDPOTrainer(model=str(folder), args=args, train_dataset=dataset,
                          processing_class=AutoProcessor.from_pretrained(folder))


@pytest.mark.parametrize("config", [{}, dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])],
                         ids=["sigmoid", "sigmoid-sft"])
def test_dpo_pairs_with_images_over_the_tree_equal_dpo_trainer(vlm_folder, tmp_path, config):
    """TRL's DPO batch of a vision-language model (each pair's images repeated for its chosen and rejected rows, no
    num_images): one tree per prompt and images, for the policy and for the reference model (its own vision
    tower); gradient, loss and metrics as TRL's padded forward."""
    from test_trl_dpo import _batch, _perturb
    from test_trl_dpo import _trl_and_tree_grads as dpo_grads

    trainer = _dpo_trainer(vlm_folder, tmp_path, **config)
    inputs = _batch(trainer)
    assert inputs["pixel_values"].shape[0] == 6 and "num_images" not in inputs
    _perturb(trainer)
    theirs, ours = dpo_grads(trainer, inputs)
    names = [n for n, _ in trainer.model.named_parameters()]
    assert sum(float(g.abs().sum()) for n, g in zip(names, theirs, strict=True) if "vision_tower" in n) > 0
    kept = [k for k, n in enumerate(names) if not n.endswith("k_proj.bias")]  # as in the GRPO test above
    err = max_rel_grad_err([ours[k] for k in kept], [theirs[k] for k in kept])
    print(f"DPO {config}: gradient {err:.1e} from TRL's")
    assert err <= 1e-4


def test_dpo_pairs_grouped_by_text_alone_would_fail(vlm_folder, tmp_path, monkeypatch):
    """The control: pairs of equal prompt text and other images in one tree (the first row's images) change the
    loss."""
    import branchreplay.trl.dpo as dpo
    from test_trl_dpo import _batch, _perturb

    trainer = _dpo_trainer(vlm_folder, tmp_path)
    inputs = _batch(trainer)
    _perturb(trainer)
    theirs = trl.DPOTrainer.compute_loss(trainer, trainer.model, inputs).item()
    monkeypatch.setattr(dpo, "image_key", lambda images: None)
    ours = trainer.compute_loss(trainer.model, inputs).item()
    assert abs(ours - theirs) > 1e-4 * abs(theirs)


def test_a_tree_run_with_another_model_than_its_images_is_refused(vlm_folder):
    """The reference model must not read the policy's image features (ImagePrompt.model)."""
    from transformers import AutoModelForImageTextToText

    from branchreplay.engine import replay_logprobs
    from branchreplay.engine.vision import ImagePrompt
    from branchreplay.tree import Rollout, RolloutTree

    policy, reference = (AutoModelForImageTextToText.from_pretrained(vlm_folder) for _ in range(2))
    image = policy.config.image_token_id
    prompt = torch.tensor([5, 6, policy.config.boi_token_id] + [image] * 4 + [policy.config.eoi_token_id, 7])
    images = ImagePrompt.of(policy, prompt, pixel_values=torch.randn(1, 3, 56, 56))
    tree = RolloutTree([Rollout(torch.cat([prompt, torch.tensor([8, 9])]), [0] * 9 + [1, 1])], images=images)
    replay_logprobs(policy, tree)
    with pytest.raises(ValueError, match="images were made for another model"):
        replay_logprobs(reference, tree)
