"""Agreement with TRL's own loss code (GRPO here, and DPO and SimPO at the end; RLOO's is in test_rl_algorithms.py):
the same fixed batch (token ids, advantages, old and reference logprobs) goes through TRL 1.16's
`GRPOTrainer._compute_loss` (its padded forward) and through `GRPOLoss` over a rollout tree (the engine) and one
rollout at a time (the naive reference); the loss values and the gradients must agree in float64.

Covered: every loss_type we share with TRL, the k3 KL with and without `use_bias_correction_kl`, the entropy bonus
(TRL: a token mean for every loss type), two-sided clipping (`delta`), off-policy ratios that clip. TRL runs in
eval mode, where it neither scales by gradient accumulation nor splits the batch: its loss then is the step's.
"""

import pytest
import torch

from branchreplay.engine import EngineConfig, replay_backward, replay_logprobs
from branchreplay.losses import GRPOLoss, token_weights
from branchreplay.reference.float64 import keep_float64
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import Rollout, RolloutTree
from helpers import grads

trl = pytest.importorskip("trl", reason="TRL is a dev dependency (pip install -e '.[dev]')")

B, P, C = 4, 6, 8  # rollouts (one group: one shared prompt), prompt tokens, max_completion_length
BETA, ENTROPY, EPS_LOW, EPS_HIGH, DELTA = 0.05, 0.01, 0.2, 0.28, 1.2
CISPO_MAX = 1.05  # cispo's epsilon_high is its largest importance weight: some of the batch's ratios exceed it
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")


def _eps_high(loss_type: str) -> float:
    return CISPO_MAX if loss_type == "cispo" else EPS_HIGH


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


def _tiny_llama_folder(tmp_path_factory, name: str):
    """The tiny Llama saved in float64, and a word-level tokenizer of its 256 ids ("0" pads, "2" ends)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp(name)
    tiny_model("llama", dtype=torch.float64).save_pretrained(folder)
    vocab = {str(i): i for i in range(256)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="0")),
                                        pad_token="0", eos_token="2")
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


@pytest.fixture(scope="module")
def trl_trainers(tmp_path_factory):
    """One TRL GRPOTrainer per loss_type on the tiny Llama (saved once; float64), in eval mode."""
    from datasets import Dataset

    folder, tokenizer = _tiny_llama_folder(tmp_path_factory, "tiny-llama")
    trainers = {}
    for loss_type in GRPO_LOSS_TYPES:
        args = trl.GRPOConfig(output_dir=str(folder / loss_type), per_device_train_batch_size=B, num_generations=B,
                              max_completion_length=C, loss_type=loss_type, beta=BETA, entropy_coef=ENTROPY,
                              epsilon=EPS_LOW, epsilon_high=_eps_high(loss_type), delta=DELTA, report_to=[],
                              use_cpu=True,
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
            for i, ((ids, n), m, w) in enumerate(zip(rows, masks, weights, strict=True))]


@pytest.mark.slow
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_grpo_loss_and_gradient_equal_trl(trl_trainers, loss_type, bias_correction):
    batch = _batch()
    trl_loss, trl_grads = _trl_loss_and_grads(trl_trainers[loss_type], batch, bias_correction)
    rollouts = _rollouts(batch, loss_type)
    loss = GRPOLoss(EPS_LOW, _eps_high(loss_type), BETA, ENTROPY, use_bias_correction_kl=bias_correction, delta=DELTA,
                    loss_type=loss_type,
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
    # about 1e-8 into a loss that is a weighted mean of per-token terms of order |A| <= 1 (luspo sums each
    # sequence's tokens: a loss of about 3, so the bound is relative above 1)
    bound = 1e-6 * max(1.0, abs(trl_loss))
    assert abs(naive.loss - trl_loss) <= bound, (naive.loss, trl_loss)
    assert abs(ours.loss - trl_loss) <= bound, (ours.loss, trl_loss)
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


# -- DPO ------------------------------------------------------------------------------------------------------------

DPO_BETA, DPO_SMOOTHING = 0.3, 0.1


def _dpo_examples():
    """Three pairs: two share a prompt (one tree), and one pair's chosen and rejected share their first 3 tokens;
    reference sums chosen so that every loss's margin is non-trivial."""
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(3, 256, (n,), generator=g).tolist()  # noqa: E731
    prompt, shared = ids(7), ids(3)
    pairs = [(prompt, shared + ids(4), shared + ids(2)), (prompt, ids(5), ids(6)), (ids(4), ids(3), ids(8))]
    refs = [(-40.0, -36.0), (-30.0, -41.0), (-25.0, -52.0)]
    return [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r, "ref_chosen_logps": rc, "ref_rejected_logps": rr}
            for (p, c, r), (rc, rr) in zip(pairs, refs, strict=True)]


@pytest.fixture(scope="module")
def trl_dpo(tmp_path_factory):
    """TRL 1.16's DPOTrainer on the tiny Llama in float64, one per loss type it shares with us, in eval mode."""
    from datasets import Dataset

    folder, tokenizer = _tiny_llama_folder(tmp_path_factory, "tiny-llama-dpo")
    trainers = {}
    for loss_type in ("sigmoid", "hinge", "ipo", "robust"):
        args = trl.DPOConfig(output_dir=str(folder / loss_type), loss_type=[loss_type], beta=DPO_BETA,
                             label_smoothing=DPO_SMOOTHING if loss_type == "robust" else 0.0, report_to=[],
                             use_cpu=True, bf16=False, model_init_kwargs={"dtype": torch.float64})
        data = Dataset.from_dict({"prompt": ["1"], "chosen": ["2"], "rejected": ["3"]})
        trainer = trl.DPOTrainer(model=str(folder), args=args, train_dataset=data, processing_class=tokenizer)
        trainer.model.eval()
        trainer.precompute_ref_logps = True  # the batch carries the reference sums
        trainers[loss_type] = trainer
    return trainers


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "robust"])
def test_dpo_loss_and_gradient_equal_trl(trl_dpo, loss_type):
    """TRL's `DPOTrainer._compute_loss` on its own padded batch (its collator, chosen rows then rejected rows) and
    ours over the pair trees (`preferences.pair_trees`, `engine.sequence`): the loss within 1e-6 and the gradient
    within 1e-5 (TRL's fused LM head computes in float32, as for GRPO above)."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from branchreplay.engine.sequence import replay_sequence_backward
    from branchreplay.losses import dpo_loss
    from branchreplay.rl.data.preferences import PreferencePair, pair_trees

    trainer, examples = trl_dpo[loss_type], _dpo_examples()
    batch = DataCollatorForPreference(pad_token_id=0)(examples)
    model = trainer.model
    model.zero_grad(set_to_none=True)
    with keep_float64(model):
        trl_loss = trainer._compute_loss(model, batch, return_outputs=False)
        trl_loss.backward()
    trl_grads = grads(model)

    pairs = [PreferencePair(e["prompt_ids"], e["chosen_ids"], e["rejected_ids"], i) for i, e in enumerate(examples)]
    trees, ordered = pair_trees(pairs)
    assert len(trees) == 2 and trees[0].stats.physical_tokens == 7 + 3 + 4 + 2 + 5 + 6  # prompt, shared prefix once
    ref = torch.tensor([v for p in ordered for v in (examples[p.row]["ref_chosen_logps"],
                                                     examples[p.row]["ref_rejected_logps"])], dtype=torch.float64)
    lengths = torch.tensor([float(r.loss_mask.sum()) for t in trees for r in t.rollouts], dtype=torch.float64)

    def loss(s):
        return dpo_loss(s[0::2], s[1::2], ref[0::2], ref[1::2], beta=DPO_BETA, loss_type=loss_type,
                        label_smoothing=DPO_SMOOTHING if loss_type == "robust" else 0.0,
                        chosen_tokens=lengths[0::2], rejected_tokens=lengths[1::2]).mean()

    ours_model = tiny_model("llama", dtype=torch.float64)
    with keep_float64(ours_model):
        value, _, _ = replay_sequence_backward(ours_model, trees, loss, engine=EngineConfig(max_pack_tokens=4))
    assert abs(value - trl_loss.item()) <= 1e-6 * max(abs(trl_loss.item()), 1.0), (value, trl_loss.item())
    err = max_rel_grad_err(grads(ours_model), trl_grads)
    print(f"dpo {loss_type}: loss {value:.10f} vs TRL {trl_loss.item():.10f}, gradient {err:.1e}")
    assert err <= 1e-5


def test_simpo_equals_trl_cpo_loss():
    """SimPO as TRL's CPOTrainer computes it (`cpo_loss` with loss_type="simpo", its own code through a stub of the
    trainer's attributes), from per-token mean logprobs; we take the summed ones and the lengths."""
    from types import SimpleNamespace

    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    from branchreplay.losses import dpo_loss

    sums = torch.tensor([-12.0, -20.0, -9.0, -7.5], dtype=torch.float64)
    lengths = torch.tensor([6.0, 8.0, 3.0, 5.0], dtype=torch.float64)
    stub = SimpleNamespace(loss_type="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.1, alpha=0.0,
                           accelerator=SimpleNamespace(device="cpu"))
    theirs, _, _ = CPOTrainer.cpo_loss(stub, sums[0::2] / lengths[0::2], sums[1::2] / lengths[1::2])
    ours = dpo_loss(sums[0::2], sums[1::2], None, None, beta=2.0, loss_type="simpo", label_smoothing=0.1,
                    chosen_tokens=lengths[0::2], rejected_tokens=lengths[1::2], simpo_gamma=0.5)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)


def test_top_entropy_quantile_equals_trl(trl_trainers):
    """top_entropy_quantile=0.5: TRL masks the per-token policy loss below the batch's entropy median; ours zeroes
    those tokens' advantages (`algorithms.grpo.keep_high_entropy`) from the policy's entropies over the tree. The KL
    term and the normaliser keep every token on both sides. The entropy bonus is off here: TRL's averages over the kept
    tokens, ours over all of them (a documented departure)."""
    from branchreplay.rl.algorithms.grpo import keep_high_entropy

    trainer = trl_trainers["dapo"]
    trainer.top_entropy_quantile, trainer._entropy_bonus_enabled = 0.5, False  # the attributes TRL reads
    try:
        trl_loss, trl_grads = _trl_loss_and_grads(trainer, _batch(), True)
    finally:
        trainer.top_entropy_quantile, trainer._entropy_bonus_enabled = 1.0, True
    rollouts = _rollouts(_batch(), "dapo")
    model = tiny_model("llama", dtype=torch.float64)
    with keep_float64(model):
        tree = RolloutTree(rollouts)
        entropy = replay_logprobs(model, tree).entropy
        masked, kept = keep_high_entropy(rollouts, entropy, [r.advantages.clone() for r in rollouts], 0.5)
        assert 0.4 <= kept <= 0.6
        for r, advantages in zip(rollouts, masked, strict=True):
            r.advantages = advantages
        loss = GRPOLoss(EPS_LOW, EPS_HIGH, BETA, 0.0, delta=DELTA, loss_type="dapo")
        ours = replay_backward(model, tree, loss, engine=EngineConfig(max_pack_tokens=4))
    assert abs(ours.loss - trl_loss) <= 1e-6, (ours.loss, trl_loss)
    assert max_rel_grad_err(grads(model), trl_grads) <= 1e-5


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_gspo_sequence_level_equals_trl(trl_trainers, loss_type):
    """importance_sampling_level="sequence" (GSPO): TRL's `_compute_loss` with that level against `gspo_loss`
    through `engine.sequence.replay_function_backward` over the tree; off-policy, KL corrected, entropy bonus on."""
    from branchreplay.engine.sequence import replay_function_backward
    from branchreplay.losses import gspo_loss

    trainer = trl_trainers[loss_type]
    trainer.importance_sampling_level = "sequence"  # the attribute TRL reads
    try:
        trl_loss, trl_grads = _trl_loss_and_grads(trainer, _batch(), True)
    finally:
        trainer.importance_sampling_level = "token"
    rollouts = _rollouts(_batch(), loss_type)
    loss_fn = GRPOLoss(EPS_LOW, EPS_HIGH, BETA, ENTROPY, delta=DELTA, loss_type=loss_type,
                       entropy_tokens=sum(float(r.loss_mask.sum()) for r in rollouts))
    model = tiny_model("llama", dtype=torch.float64)
    with keep_float64(model):
        value, _, _ = replay_function_backward(model, RolloutTree(rollouts),
                                               lambda lps, ents: gspo_loss(lps, ents, rollouts, loss_fn),
                                               engine=EngineConfig(max_pack_tokens=4))
    assert loss_fn.stats.sums[1] + loss_fn.stats.sums[2] > 0  # some sequence ratios clipped
    assert abs(value - trl_loss) <= 1e-6 * max(1.0, abs(trl_loss)), (value, trl_loss)
    assert max_rel_grad_err(grads(model), trl_grads) <= 1e-5
