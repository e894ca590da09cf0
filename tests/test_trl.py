"""Agreement with TRL's own loss code: the same fixed batch (token ids, advantages, old and reference logprobs) goes
through TRL 1.16's `GRPOTrainer._compute_loss` (its padded forward) and through `GRPOLoss` over a rollout tree (the
engine) and one rollout at a time (the naive reference); the loss values and the gradients must agree in float64.

Covered: every loss_type we share with TRL, the k3 KL with and without `use_bias_correction_kl`, the entropy bonus
(TRL: a token mean for every loss type), two-sided clipping (`delta`), off-policy ratios that clip. TRL runs in
eval mode, where it neither scales by gradient accumulation nor splits the batch: its loss then is the step's.
"""

import pytest
import torch

from branchreplay.check.numerics import keep_float64
from branchreplay.check.reference import max_rel_grad_err, naive_backward
from branchreplay.engine import EngineConfig, replay_backward
from branchreplay.losses import GRPOLoss, token_weights
from branchreplay.models import tiny_model
from branchreplay.tree import Rollout, RolloutTree
from conftest import grads

trl = pytest.importorskip("trl", reason="TRL is a dev dependency (pip install -e '.[dev]')")

B, P, C = 4, 6, 8  # rollouts (one group: one shared prompt), prompt tokens, max_completion_length
BETA, ENTROPY, EPS_LOW, EPS_HIGH, DELTA = 0.05, 0.01, 0.2, 0.28, 1.2


def _batch():
    """The prompt, the completions (rows 1 and 2 share their first 3 tokens with row 0: a tree with shared
    response prefixes), the completion mask (rows end at 8, 5, 8, 3 tokens), advantages, old and ref logprobs."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 256, (P,), generator=g)
    completions = torch.randint(3, 256, (B, C), generator=g)
    completions[1, :3] = completions[2, :3] = completions[0, :3]
    lengths = [8, 5, 8, 3]
    mask = torch.tensor([[1] * n + [0] * (C - n) for n in lengths])
    advantages = torch.tensor([1.0, -0.5, 0.3, -0.8], dtype=torch.float64)
    old = -5.5 + 0.4 * (torch.rand(B, C, generator=g, dtype=torch.float64) - 0.5)  # off-policy: ratios clip
    ref = -5.5 + 0.3 * (torch.rand(B, C, generator=g, dtype=torch.float64) - 0.5)
    return prompt, completions, mask, advantages, old, ref


@pytest.fixture(scope="module")
def trl_trainers(tmp_path_factory):
    """One TRL GRPOTrainer per loss_type on the tiny Llama (saved once; float64), in eval mode."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", dtype=torch.float64).save_pretrained(folder)
    vocab = {str(i): i for i in range(256)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="0")),
                                        pad_token="0", eos_token="2")
    tokenizer.save_pretrained(folder)
    trainers = {}
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        args = trl.GRPOConfig(output_dir=str(folder / loss_type), per_device_train_batch_size=B, num_generations=B,
                              max_completion_length=C, loss_type=loss_type, beta=BETA, entropy_coef=ENTROPY,
                              epsilon=EPS_LOW, epsilon_high=EPS_HIGH, delta=DELTA, report_to=[], use_cpu=True,
                              bf16=False,  # TRL defaults to bf16 autocast: the comparison is in float64
                              model_init_kwargs={"dtype": torch.float64})
        trainer = trl.GRPOTrainer(model=str(folder), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                  args=args, train_dataset=Dataset.from_dict({"prompt": ["1 2 3"] * B}),
                                  processing_class=tokenizer)
        trainer.model.eval()
        trainers[loss_type] = trainer
    return trainers


def _trl_loss_and_grads(trainer, batch, bias_correction: bool):
    prompt, completions, mask, advantages, old, ref = batch
    trainer.args.use_bias_correction_kl = bias_correction
    inputs = {"prompt_ids": prompt.expand(B, P), "prompt_mask": torch.ones(B, P, dtype=torch.long),
              "completion_ids": completions, "completion_mask": mask, "advantages": advantages,
              "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    model = trainer.model
    model.zero_grad(set_to_none=True)
    with keep_float64(model):
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
    return loss.item(), grads(model)


def _rollouts(batch, loss_type: str) -> list[Rollout]:
    prompt, completions, mask, advantages, old, ref = batch
    masks, rows = [], []
    for i in range(B):
        n = int(mask[i].sum())
        masks.append(torch.tensor([0.0] * P + [1.0] * n))
        rows.append((torch.cat([prompt, completions[i, :n]]), n))
    weights = token_weights(masks, loss_type, max_completion_length=C, num_items_in_batch=int(mask.sum()))
    pad = torch.zeros(P, dtype=torch.float64)
    return [Rollout(ids, loss_mask=m, advantages=float(advantages[i]), weights=w,
                    old_logprobs=torch.cat([pad, old[i, :n]]), ref_logprobs=torch.cat([pad, ref[i, :n]]))
            for i, ((ids, n), m, w) in enumerate(zip(rows, masks, weights))]


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_loss_and_gradient_equal_trl(trl_trainers, loss_type, bias_correction):
    batch = _batch()
    trl_loss, trl_grads = _trl_loss_and_grads(trl_trainers[loss_type], batch, bias_correction)
    rollouts = _rollouts(batch, loss_type)
    loss = GRPOLoss(EPS_LOW, EPS_HIGH, BETA, ENTROPY, use_bias_correction_kl=bias_correction, delta=DELTA,
                    entropy_tokens=sum(float(r.loss_mask.sum()) for r in rollouts))
    model = tiny_model("llama", dtype=torch.float64)
    with keep_float64(model):
        naive = naive_backward(model, rollouts, loss)
        naive_grads = grads(model)
        model.zero_grad(set_to_none=True)
        tree = RolloutTree(rollouts)
        assert tree.stats.physical_tokens < tree.stats.logical_tokens - (B - 1) * P  # responses share a prefix too
        ours = replay_backward(model, tree, loss, engine=EngineConfig(max_pack_tokens=4))
        tree_grads = grads(model)
    assert loss.stats.sums[1] + loss.stats.sums[2] > 0  # some ratios clipped
    # TRL's fused LM head (transformers' fused_lm_head) computes in float32 even for a float64 model, which puts
    # about 1e-8 into a loss that is a weighted mean of per-token terms of order |A| <= 1: an absolute bound
    assert abs(naive.loss - trl_loss) <= 1e-6, (naive.loss, trl_loss)
    assert abs(ours.loss - trl_loss) <= 1e-6, (ours.loss, trl_loss)
    assert abs(ours.loss - naive.loss) <= 1e-12 * abs(naive.loss)
    assert max_rel_grad_err(naive_grads, trl_grads) <= 1e-5, max_rel_grad_err(naive_grads, trl_grads)
    assert max_rel_grad_err(tree_grads, trl_grads) <= 1e-5
    assert max_rel_grad_err(tree_grads, naive_grads) <= 1e-10


def test_on_policy_bias_correction_equals_trl_and_changes_the_gradient(trl_trainers):
    """On-policy (no old logprobs: every ratio is 1 in value), ours equals TRL with the KL corrected and plain, and
    the two differ in their gradient (TRL's docs): a test of the option that could not tell them apart would pass
    for the wrong reason."""
    prompt, completions, mask, advantages, old, ref = _batch()
    batch = (prompt, completions, mask, advantages, None, ref)
    trainer, grads_of = trl_trainers["dapo"], {}
    for correction in (True, False):
        trl_loss, grads_of[correction] = _trl_loss_and_grads(trainer, batch, correction)
        rollouts = _rollouts(_batch(), "dapo")
        for r in rollouts:
            r.old_logprobs = None
        loss = GRPOLoss(EPS_LOW, EPS_HIGH, BETA, ENTROPY, use_bias_correction_kl=correction, delta=DELTA,
                        entropy_tokens=sum(float(r.loss_mask.sum()) for r in rollouts))
        model = tiny_model("llama", dtype=torch.float64)
        with keep_float64(model):
            ours = replay_backward(model, RolloutTree(rollouts), loss)
        assert abs(ours.loss - trl_loss) <= 1e-6
        assert max_rel_grad_err(grads(model), grads_of[correction]) <= 1e-5
    assert max_rel_grad_err(grads_of[True], grads_of[False]) > 1e-3
