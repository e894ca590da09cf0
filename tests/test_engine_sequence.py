"""DPO over prefix trees (`losses.dpo_loss` through `engine.sequence.replay_sequence_backward`): the prompt is one
node, chosen and rejected are branches (sharing a node where their responses share a prefix). The gradient and the
loss equal the naive per-pair computation: each sequence alone through the Hugging Face forward, its completion
logprobs summed under autograd, the same DPO loss, `.backward()`."""

import pytest
import torch

from branchreplay.engine import EngineConfig
from branchreplay.engine.sequence import replay_sequence_backward
from branchreplay.losses import DPO_LOSS_TYPES, dpo_loss
from branchreplay.reference.naive import max_rel_grad_err
from branchreplay.tree import Rollout, RolloutTree
from helpers import grads
from test_rl_run_trainer import generate

EOS = 2  # the byte tokenizer's (test_rl_run_trainer.ByteTokenizer)


def _pairs(vocab: int, seed: int = 0):
    """Two pairs: (prompt, chosen, rejected); the first pair's responses share their first 4 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g)  # noqa: E731
    shared = ids(4)
    return [(ids(12), torch.cat([shared, ids(6)]), torch.cat([shared, ids(3)])), (ids(7), ids(5), ids(9))]


def _rollouts(pairs) -> list[Rollout]:
    """chosen, rejected, chosen, rejected, ...: prompt + response, the loss mask on the response."""
    out = []
    for prompt, chosen, rejected in pairs:
        for response in (chosen, rejected):
            out.append(Rollout(torch.cat([prompt, response]), loss_mask=[0.0] * len(prompt) + [1.0] * len(response)))
    return out


def _loss(loss_type, ref, lengths):
    def loss(s):  # [2B] summed logprobs, chosen at even positions
        return dpo_loss(s[0::2], s[1::2], ref[0::2], ref[1::2], beta=0.3, loss_type=loss_type, label_smoothing=0.1,
                        chosen_tokens=lengths[0::2], rejected_tokens=lengths[1::2]).mean()
    return loss


def _naive(model, rollouts, loss):
    sums = []
    for r in rollouts:
        logits = model(input_ids=r.token_ids[None]).logits[0, :-1]
        logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, r.token_ids[1:, None])[:, 0]
        sums.append((logp * r.loss_mask[1:]).sum())
    value = loss(torch.stack(sums))
    value.backward()
    return value.item()


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2-sliding", "lfm2"])
def test_dpo_over_pair_trees_equals_naive_per_pair(arch, loss_type, tiny64):
    model = tiny64(arch)
    rollouts = _rollouts(_pairs(model.config.vocab_size))
    trees = [RolloutTree(rollouts[0:2]), RolloutTree(rollouts[2:4])]
    assert trees[0].stats.physical_tokens == 12 + 4 + 6 + 3  # the prompt and the shared response prefix once
    ref = torch.tensor([-40.0, -35.0, -30.0, -45.0], dtype=torch.float64)
    lengths = torch.tensor([10.0, 7.0, 5.0, 9.0], dtype=torch.float64)
    loss = _loss(loss_type, ref, lengths)
    expected_value = _naive(model, rollouts, loss)
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    value, sums, _ = replay_sequence_backward(model, trees, loss, engine=EngineConfig(max_pack_tokens=4))
    assert abs(value - expected_value) <= 1e-6 * abs(expected_value)
    err = max_rel_grad_err(grads(model), expected)
    assert err <= 1e-10, f"{arch} {loss_type}: max relative gradient error {err:.2e}"  # measured about 3e-15


def test_dpo_float32_within_1e_4_of_naive():
    from branchreplay.tiny_models import tiny_model

    model = tiny_model("llama", dtype=torch.float32)
    rollouts = _rollouts(_pairs(model.config.vocab_size, seed=1))
    ref = torch.tensor([-40.0, -35.0, -30.0, -45.0], dtype=torch.float64)
    loss = _loss("sigmoid", ref, torch.tensor([10.0, 7.0, 5.0, 9.0], dtype=torch.float64))
    _naive(model, rollouts, loss)
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    replay_sequence_backward(model, [RolloutTree(rollouts[0:2]), RolloutTree(rollouts[2:4])], loss)
    assert max_rel_grad_err(grads(model), expected) <= 1e-4


def test_dpo_loss_refuses_bad_input_by_name():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type 'kto' is unknown"):
        dpo_loss(x, x, x, x, loss_type="kto")
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        dpo_loss(x, x, x, x, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="ipo' needs chosen_tokens"):
        dpo_loss(x, x, x, x, loss_type="ipo")


# -- preference files and the DPO trainer ---------------------------------------------------------------------------

def _write(path, rows):
    import json

    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def _conversational(question, chosen, rejected):
    return {"prompt": [{"role": "user", "content": question}], "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def test_preferences_plain_conversational_and_parquet(tmp_path):
    """Chosen and rejected continue the same prompt ids: the chat template's generation prompt for conversational
    rows (as the sampler renders prompts), the tokenizer's ids plus EOS for plain ones; Parquet reads the same."""
    from datasets import Dataset

    from branchreplay.rl.data.preferences import load_preferences, pair_trees
    from test_rl_run_trainer import ByteTokenizer

    tok = ByteTokenizer()
    pairs, skipped = load_preferences(_write(tmp_path / "c.jsonl", [_conversational("1+1=?", "2", "3")]), tok)
    (p,) = pairs
    assert skipped == 0 and p.prompt_ids == tok("U:1+1=?|A:").input_ids
    assert p.chosen_ids == tok("2").input_ids and p.rejected_ids == tok("3").input_ids
    class TextEos(ByteTokenizer):  # an EOS string, as Hugging Face tokenizers have: "$" is id 2
        eos_token = "$"

        def __call__(self, text, add_special_tokens=False):
            return type("Encoding", (), {"input_ids": [EOS if b == ord("$") else max(b, 3) for b in text.encode()]})

    plain = [{"prompt": "q", "chosen": "yes", "rejected": "no$"}]  # EOS appended unless the text ends with it
    (q,), _ = load_preferences(_write(tmp_path / "p.jsonl", plain), TextEos())
    assert q.prompt_ids == tok("q").input_ids
    assert (q.chosen_ids, q.rejected_ids) == (tok("yes").input_ids + [EOS], tok("no").input_ids + [EOS])
    Dataset.from_list(plain).to_parquet(str(tmp_path / "p.parquet"))
    (r,), _ = load_preferences(tmp_path / "p.parquet", TextEos())
    assert (r.prompt_ids, r.chosen_ids, r.rejected_ids) == (q.prompt_ids, q.chosen_ids, q.rejected_ids)
    trees, ordered = pair_trees([p, q, p])
    assert len(trees) == 2 and [len(t.rollouts) for t in trees] == [4, 2] and ordered == [p, p, q]


def test_preferences_bad_rows_named(tmp_path):
    """chosen == rejected, or a prompt that leaves no room under max_length: skipped with a warning and counted; an
    empty response, a missing column, a template that renders the prompt differently inside the conversation:
    errors naming the row or the column."""
    from branchreplay.rl.data.preferences import load_preferences
    from test_rl_run_trainer import ByteTokenizer

    tok = ByteTokenizer()
    rows = [_conversational("a", "x", "y"), _conversational("b", "same", "same")]
    with pytest.warns(RuntimeWarning, match="skipped 1 row"):
        pairs, skipped = load_preferences(_write(tmp_path / "s.jsonl", rows), tok)
    assert (len(pairs), skipped) == (1, 1)
    with pytest.raises(ValueError, match="line 2, column .rejected. is empty; remove the row or fill it"):
        load_preferences(_write(tmp_path / "e.jsonl", [rows[0], {**rows[0], "rejected": []}]), tok)
    with pytest.raises(ValueError, match="lacks the column"):
        load_preferences(_write(tmp_path / "m.jsonl", [{"prompt": "q", "chosen": "a"}]), tok)
    plain = {"prompt": "q", "chosen": "a", "rejected": "b"}
    for column, value, found in [("chosen", 42, "holds 42 \\(a int\\): it must be text"),
                                 ("chosen", [1, 2], "message 0 is a int, not a {role, content} dict"),
                                 ("prompt", None, "holds None \\(a NoneType\\): it must be text")]:
        path = _write(tmp_path / "t.jsonl", [plain, {**plain, column: value}])
        with pytest.raises(ValueError, match=f"dpo.dataset {path} line 2, column '{column}'.*{found}"):
            load_preferences(path, tok)

    class Unstable(ByteTokenizer):  # writes a marker before a finished conversation: not prefix-stable
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            text = super().apply_chat_template(messages, tokenize, add_generation_prompt)
            return text if add_generation_prompt else "#" + text

    with pytest.raises(ValueError, match="line 1: the chat template renders the prompt differently"):
        load_preferences(_write(tmp_path / "u.jsonl", rows[:1]), Unstable())
    with pytest.warns(RuntimeWarning, match="skipped 1 row.*dpo.max_length=12"):  # a prompt of 12 tokens or more
        pairs, skipped = load_preferences(_write(tmp_path / "l.jsonl", [rows[0], _conversational("long " * 9, "x",
                                                                                                   "y")]), tok,
                                          max_length=12)
    assert (len(pairs), skipped) == (1, 1) and len(pairs[0].prompt_ids + pairs[0].chosen_ids) <= 12
    with pytest.raises(ValueError, match="unknown format"):
        load_preferences(_write(tmp_path / "x.csv", rows[:1]), tok)


def _dpo_config(tmp_path, dataset, **dpo):
    from branchreplay.rl.config import Config
    from test_rl_run_trainer import make_config

    data = make_config(tmp_path, train={"steps": 2}).to_dict()
    data["algorithm"], data["dpo"] = "dpo", {"dataset": str(dataset), "pairs_per_step": 4, **dpo}
    return Config.from_dict(data)


def _preference_file(tmp_path):
    from test_rl_run_trainer import DATA

    return _write(tmp_path / "prefs.jsonl",
                  [_conversational(d["question"], d["answer"], str(int(d["answer"]) + 1)) for d in DATA])


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_trainer_trains_and_logs_trl_names(tmp_path, loss_type):
    from test_rl_run_trainer import _metrics, make_trainer

    trainer = make_trainer(_dpo_config(tmp_path, _preference_file(tmp_path), loss_type=loss_type))
    assert (trainer.reference is None) == (loss_type == "simpo")  # simpo is reference-free
    before = [p.detach().clone() for p in trainer.model.parameters()]
    run = trainer.fit()
    records = [r for r in _metrics(run) if r["step"] > 0]
    for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                 "logps/chosen", "logps/rejected", "tree/token_ratio"):
        assert all(torch.isfinite(torch.tensor(r[name])) for r in records), name
    assert records[0]["tree/token_ratio"] > 1  # the prompt is shared by chosen and rejected
    if loss_type != "simpo":  # before the first update the policy is the reference: zero margins
        assert records[0]["rewards/margins"] == 0.0
    assert any((p - b).abs().max() > 0 for p, b in zip(trainer.model.parameters(), before, strict=True))


def test_dpo_precomputed_reference_equals_per_step_and_resumes(tmp_path):
    """dpo.precompute_ref_log_probs gives the same run as the per-step reference pass; a run stopped after step 1
    and resumed equals the straight one."""
    from test_rl_run_trainer import _metrics, make_trainer

    data = _preference_file(tmp_path)
    runs = {}
    for name, extra in (("per_step", {}), ("precomputed", {"precompute_ref_log_probs": True})):
        runs[name] = _metrics(make_trainer(_dpo_config(tmp_path / name, data, **extra)).fit())
    first = make_trainer(_dpo_config(tmp_path / "resumed", data, precompute_ref_log_probs=True))
    first.config.train.steps = 1
    run = first.fit()
    resumed = make_trainer(_dpo_config(tmp_path / "resumed", data, precompute_ref_log_probs=True)).fit(resume=run)
    runs["resumed"] = _metrics(resumed)
    for key in ("loss", "rewards/margins", "grad_norm"):
        a, b, c = ([r[key] for r in runs[k] if r["step"] > 0] for k in ("per_step", "precomputed", "resumed"))
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9) and b == c, key


def test_dpo_step_does_not_depend_on_micro_batching(tmp_path):
    from test_rl_run_trainer import make_trainer

    data, records = _preference_file(tmp_path), []
    for size in (0, 1):
        config = _dpo_config(tmp_path / str(size), data)
        config.grpo.micro_batch_prompts = size
        records.append(make_trainer(config).train_step(1))
    for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen"):
        assert records[0][key] == pytest.approx(records[1][key], rel=1e-5, abs=1e-7), key


def test_fewer_pairs_than_a_step_takes_are_said_and_a_step_takes_them_all(tmp_path):
    """dpo.pairs_per_step 40 on a file of 16 pairs: a warning says a step trains on all 16 (as TRL's data loader
    makes a batch of the data), and every step has 16 pairs, none twice (they used to repeat without a word)."""
    from test_rl_run_trainer import make_trainer

    with pytest.warns(RuntimeWarning, match="has 16 pairs, fewer than dpo.pairs_per_step=40: a step trains on all 16"):
        trainer = make_trainer(_dpo_config(tmp_path, _preference_file(tmp_path), pairs_per_step=40))
    batch = generate(trainer, 1)
    assert sorted(p.row for p in batch.pairs) == list(range(16))
