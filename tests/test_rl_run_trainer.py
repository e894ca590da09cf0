"""The GRPO trainer on tiny stand-ins: a random tiny Llama (vocab 256), a byte-level tokenizer with a one-line chat
template, a toy arithmetic task and a reward with spread inside every group. Nothing is downloaded; each test takes
seconds. Checks: advantages as TRL, gradient independent of micro-batching, first-iteration ratio 1, truncation
masking, each loss_type trains, stop/resume equals a straight run, atomic checkpoints, failing rewards skip a step.
Resumes that change a run, and failures of the disk: tests/test_rl_run_trainer_faults.py; what a run prints and logs:
tests/test_rl_run_log.py.
"""

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from branchreplay.engine import UnsupportedModelError, replay_logprobs
from branchreplay.losses import LOSS_TYPES, GRPOLoss
from branchreplay.reference.naive import max_rel_grad_err
from branchreplay.rl.algorithms.advantages import group_advantages
from branchreplay.rl.config import Config
from branchreplay.rl.data.order import prompt_indices
from branchreplay.rl.policy import Policy
from branchreplay.rl.run import step as phases
from branchreplay.rl.run.checkpoint import latest_checkpoint, save_checkpoint
from branchreplay.rl.run.stops import TrainingFailed, TrainingInterrupted
from branchreplay.rl.run.trainer import Trainer
from branchreplay.rl.shards import Shards
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import RolloutTree
from helpers import grads, held_float64

EOS = 2


class ByteTokenizer:
    """Bytes 3..255 are text; id 2 is EOS; no BOS. Template: 'S:<system>|U:<user>|A:'."""

    eos_token_id = EOS
    bos_token_id = None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "|".join(f"{m['role'][0].upper()}:{m['content'][:24]}" for m in messages)
        return text + ("|A:" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": [max(b, 3) for b in text.encode()]})

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i >= 3).decode("latin-1")


DATA = [{"question": f"{a}+{b}=?", "answer": str(a + b), "metadata": {}} for a in range(4) for b in range(4)]


def byte_reward(completions, **kwargs):
    """Fraction of lower-case ASCII letters: random completions spread over [0, 1] inside every group."""
    return [sum(c.islower() for c in text) / max(len(text), 1) for text in completions]


def make_config(tmp_path, **sections) -> Config:
    data = {
        "model": {"spec": "tiny:llama"},
        "sampling": {"temperature": 0.7, "max_new_tokens": 6},
        "grpo": {"num_generations": 4, "prompts_per_step": 2, "learning_rate": 1e-2, "lr_scheduler": "constant"},
        "train": {"steps": 3, "output_dir": str(tmp_path / "run"), "save_steps": 0, "eval_steps": -1},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return Config.from_dict(data)


def make_trainer(config, dtype=torch.float32, reward_fn=byte_reward, model=None):
    model = tiny_model("llama", dtype=dtype, seed=0) if model is None else model
    if model.dtype == torch.float64:
        held_float64(model)
    return Trainer(config, model=model, tokenizer=ByteTokenizer(), train_data=DATA, eval_data=DATA[:4],
                   reward_fn=reward_fn)


def generate(trainer, step: int):
    """The batch of `step`, sampled and scored as `train_step` does."""
    return trainer.source.score(trainer.source.sample(step))


def with_advantages(trainer, batch):
    """`batch` with its rollouts' advantages (and old and reference logprobs) written as `train_step` writes them
    (the run's passes and its part's estimate, in one process)."""
    part = trainer.algorithm
    shards = Shards.of(batch.trees, None, trainer.model.config)
    phases.advantages(part, batch, shards, phases.passes(part, batch, shards))
    return batch


def train_on(trainer, batch, step: int = 1) -> dict:
    """`train_step` on `batch`: the step's phases after sampling, the trainer's source answering with it; its
    record."""
    source = trainer.source
    trainer.source = SimpleNamespace(sample=lambda step: batch, score=lambda drawn: drawn)
    try:
        return trainer.train_step(step)
    finally:
        trainer.source = source


pytestmark = pytest.mark.usefixtures("one_thread")



# -- advantages ---------------------------------------------------------------------------------------------------

def test_advantages_grouped_by_id_in_any_order():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0, 2.0, 5.0])
    ids = ["a", "b", "a", "b", "a", "b"]
    adv = group_advantages(rewards, ids, "group")
    for g in ("a", "b"):
        idx = [i for i, x in enumerate(ids) if x == g]
        r = rewards[idx]
        torch.testing.assert_close(adv[idx], (r - r.mean()) / (r.std() + 1e-4))
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(0))
    shuffled = group_advantages(rewards[perm], [ids[i] for i in perm], "group")
    torch.testing.assert_close(shuffled, adv[perm])


def test_advantages_scale_modes_and_equal_groups():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 1.0])
    ids = [0, 0, 0, 1, 1, 1]
    for mode in ("group", "batch", "none"):
        adv = group_advantages(rewards, ids, mode)
        assert torch.equal(adv[:3], torch.zeros(3)), mode  # exactly zero, never a rounding residue / 1e-4
        assert torch.isfinite(adv).all()
    centred = rewards[3:] - rewards[3:].mean()
    torch.testing.assert_close(group_advantages(rewards, ids, "none")[3:], centred)
    torch.testing.assert_close(group_advantages(rewards, ids, "batch")[3:], centred / (rewards.std() + 1e-4))
    assert torch.equal(group_advantages(torch.tensor([0.5]), [0], "group"), torch.zeros(1))  # one sample: no NaN


def test_prompt_order_is_a_pure_function_covering_each_epoch():
    first_epoch = [i for s in range(1, 9) for i in prompt_indices(16, 2, 7, s)]
    assert sorted(first_epoch) == list(range(16))
    assert prompt_indices(16, 2, 7, 3) == prompt_indices(16, 2, 7, 3) != prompt_indices(16, 2, 8, 3)


# -- one step -------------------------------------------------------------------------------------------------------

def test_gradient_does_not_depend_on_micro_batching(tmp_path, keep64):
    config = make_config(tmp_path, grpo={"prompts_per_step": 3, "loss_type": "grpo"})
    trainer = make_trainer(config, dtype=torch.float64)
    keep64(trainer.model)
    batch = with_advantages(trainer, generate(trainer, 1))
    trees = [RolloutTree(group) for group in batch.rollouts]
    assert sum(float(r.advantages.abs().sum()) for r in batch.flat) > 0
    total = sum(float(r.weights.sum()) for group in batch.rollouts for r in group)
    assert abs(total - 1.0) < 1e-12, "grpo weights must be normalised over the whole step"
    runs = []
    for micro in (1, 0):
        trainer.model.zero_grad(set_to_none=True)
        Policy(trainer.model, temperature=0.7, micro_batch=micro).accumulate(trees, GRPOLoss())
        runs.append(grads(trainer.model))
    err = max_rel_grad_err(runs[0], runs[1])
    assert err <= 1e-6, f"micro_batch_prompts 1 vs all: max relative grad error {err:.3e}"


def test_first_iteration_ratio_is_one(tmp_path):
    trainer = make_trainer(make_config(tmp_path))
    batch = generate(trainer, 1)
    trees = [RolloutTree(group) for group in batch.rollouts]
    replayed = replay_logprobs(trainer.model, trees, temperature=0.7).logprobs
    samples = [s for group in batch.samples for s in group]
    for lp, s in zip(replayed, samples, strict=True):
        sampled = torch.tensor(s.logprobs)
        ratio = torch.exp(lp[-len(s.completion_ids):].double() - sampled.double())
        assert (ratio - 1).abs().max() < 1e-4, f"ratio {ratio}"


def test_truncated_completions_masked_in_numerator_and_denominator(tmp_path):
    config = make_config(tmp_path, grpo={"mask_truncated_completions": True, "loss_type": "dapo"},
                         sampling={"max_new_tokens": 3})
    trainer = make_trainer(config)
    batch = generate(trainer, 1)
    flat = [(s, r) for sg, rg in zip(batch.samples, batch.rollouts, strict=True) for s, r in zip(sg, rg, strict=True)]
    assert any(s.truncated for s, _ in flat)
    kept = sum(len(s.completion_ids) for s, _ in flat if not s.truncated)
    for s, r in flat:
        if s.truncated:
            assert r.loss_mask.sum() == 0 and r.weights.sum() == 0
        else:
            torch.testing.assert_close(r.weights[r.loss_mask > 0], torch.full_like(r.weights[r.loss_mask > 0],
                                                                                    1 / kept))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_moves_the_parameters(tmp_path, loss_type):
    config = make_config(tmp_path, grpo={"loss_type": loss_type, "beta": 0.04, "num_iterations": 2})
    trainer = make_trainer(config)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step(1)
    moved = [not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters(), strict=True)]
    assert all(moved), f"{loss_type}: {moved.count(False)} parameters did not move"
    for key in ("reward", "reward_std", "kl", "entropy", "clip_ratio/region_mean", "loss", "grad_norm",
                "tree/token_ratio", "memory/peak_bytes"):
        assert key in metrics and metrics[key] == metrics[key], key
    assert metrics["tree/token_ratio"] > 1


# -- the run ------------------------------------------------------------------------------------------------------

def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_stop_and_resume_equals_a_straight_run(tmp_path):
    straight = make_trainer(make_config(tmp_path / "a", train={"steps": 4, "eval_steps": 2})).fit()
    calls = []

    def interrupting_reward(**kwargs):
        calls.append(len(kwargs["completions"]) == 8)  # training calls (2 prompts x 4), not evaluation calls
        if sum(calls) == 2 and calls[-1]:  # during step 2: the step finishes, a checkpoint is written, training stops
            os.kill(os.getpid(), signal.SIGINT)
        return byte_reward(**kwargs)

    config = make_config(tmp_path / "b", train={"steps": 4, "eval_steps": 2})
    with pytest.raises(TrainingInterrupted, match="--resume"):
        make_trainer(config, reward_fn=interrupting_reward).fit()
    run_b = tmp_path / "b" / "run"
    assert latest_checkpoint(run_b).name == "step-000002"
    make_trainer(make_config(tmp_path / "b", train={"steps": 4, "eval_steps": 2})).fit(resume=run_b)
    a, b = _metrics(straight), _metrics(run_b)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        for key in ("reward", "loss", "grad_norm", "num_tokens", "eval/accuracy"):
            assert ra.get(key) == rb.get(key), (ra["step"], key, ra.get(key), rb.get(key))
    assert (run_b / "training.png").is_file() and (run_b / "config.yaml").is_file()


def test_training_raises_the_reward(tmp_path):
    """End to end on the toy task: the tiny model learns to emit lower-case letters (about 0.35 -> 0.95)."""
    run = make_trainer(make_config(tmp_path, train={"steps": 12, "eval_steps": 6})).fit()
    records = _metrics(run)
    rewards = [r["reward"] for r in records if "reward" in r]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards
    assert records[-1]["eval/accuracy"] > records[0]["eval/accuracy"]
    assert (run / "training.png").stat().st_size > 0


def test_leftover_temp_checkpoint_is_ignored(tmp_path):
    config = make_config(tmp_path, train={"steps": 2})
    run = make_trainer(config).fit()
    leftover = run / "checkpoints" / ".tmp-step-000003-crashed"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half written")
    assert latest_checkpoint(run).name == "step-000002"
    trainer = make_trainer(make_config(tmp_path, train={"steps": 3}))
    trainer.fit(resume=run)
    assert trainer.step == 3 and not leftover.exists()


def test_existing_run_needs_resume(tmp_path):
    run = make_trainer(make_config(tmp_path, train={"steps": 1})).fit()
    with pytest.raises(ValueError, match="--resume"):
        make_trainer(make_config(tmp_path, train={"steps": 1})).fit()
    assert run.is_dir()


def test_keep_checkpoints(tmp_path):
    trainer = make_trainer(make_config(tmp_path, train={"steps": 1}))
    run = tmp_path / "ckpts"
    for step in (1, 2, 3):
        trainer.step = step
        save_checkpoint(run, step, trainer.model, trainer.policy.optimizer, trainer.policy.scheduler, keep=2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-000002", "step-000003"]


def test_checkpoint_is_a_hugging_face_model_and_old_checkpoints_still_resume(tmp_path):
    """The step folder loads with from_pretrained (the consolidated export, tied weights restored); a checkpoint of
    the earlier format (the full optimizer state inside trainer_state.pt) resumes to the same optimizer state."""
    from transformers import AutoModelForCausalLM

    from branchreplay.rl.run.checkpoint import STATE, load_checkpoint

    trainer = make_trainer(make_config(tmp_path, train={"steps": 2}))
    run = trainer.fit()
    folder = latest_checkpoint(run)
    umask = os.umask(0)
    os.umask(umask)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700: others may read it
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    exported = AutoModelForCausalLM.from_pretrained(folder)
    for (name, ours), theirs in zip(trainer.model.named_parameters(), exported.parameters(), strict=True):
        assert torch.equal(ours, theirs), name
    import shutil

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    shutil.rmtree(folder / "optimizer")  # the earlier format: no optimizer/, and no checksums.json
    (folder / "checksums.json").unlink()
    state = torch.load(folder / STATE, weights_only=False)
    by_name = get_optimizer_state_dict(trainer.model, trainer.policy.optimizer,
                                       options=StateDictOptions(full_state_dict=True))
    # keyed by position (before data parallelism), by name
    for earlier in (trainer.policy.optimizer.state_dict(), by_name):
        state["optimizer"] = earlier
        torch.save(state, folder / STATE)
        assert latest_checkpoint(run) == folder
        fresh = make_trainer(make_config(tmp_path, train={"output_dir": str(tmp_path / "fresh")}))
        assert load_checkpoint(folder, fresh.model, fresh.policy.optimizer, fresh.policy.scheduler)[0] == 2
        for p, q in zip(trainer.policy.params, fresh.policy.params, strict=True):
            ours, theirs = trainer.policy.optimizer.state[p], fresh.policy.optimizer.state[q]
            assert torch.equal(ours["exp_avg"], theirs["exp_avg"])


def test_a_checkpoint_copied_without_its_dcp_metadata_is_not_complete(tmp_path):
    trainer = make_trainer(make_config(tmp_path, train={"steps": 1}))
    run = trainer.fit()
    (latest_checkpoint(run) / "optimizer" / ".metadata").unlink()
    assert latest_checkpoint(run) is None


def test_failing_reward_skips_the_step(tmp_path):
    calls = []

    def flaky_reward(**kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("grader crashed")
        return byte_reward(**kwargs)

    trainer = make_trainer(make_config(tmp_path, train={"steps": 3}), reward_fn=flaky_reward)
    with pytest.warns(RuntimeWarning, match="step 2 skipped.*grader crashed.*traceback in .*errors.log"):
        run = trainer.fit()
    records = _metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "reward" in records[0] and "reward" not in records[1] and "reward" in records[2]
    assert latest_checkpoint(run).name == "step-000003"
    # the reward's own traceback is kept (none was anywhere), its line of flaky_reward included
    logged = (run / "errors.log").read_text()
    assert records[1]["traceback"] == str(run / "errors.log") and logged.startswith("step 2: ")
    assert 'raise RuntimeError("grader crashed")' in logged and "in flaky_reward" in logged


def test_a_run_whose_every_step_was_skipped_fails(tmp_path):
    """`--train.steps 1` with a raising reward exited 0 with an empty summary: a run that trained nothing fails,
    naming the cause and the traceback's file."""
    def broken(**kwargs):
        raise KeyError("answer")

    trainer = make_trainer(make_config(tmp_path, train={"steps": 1}), reward_fn=broken)
    with pytest.warns(RuntimeWarning), pytest.raises(TrainingFailed, match=r"every step of this run was skipped "
                                                     r"\(reward function 'broken' raised KeyError: 'answer'; "
                                                     r"traceback in .*errors.log\)"):
        trainer.fit()


def test_consecutive_failed_steps_stop_the_run_with_a_checkpoint_of_the_last_good_step(tmp_path):
    """train.max_failed_steps (3) consecutive skipped steps end the run with TrainingFailed; the checkpoint is the
    last good step's, so a resume re-runs the failed ones; fewer in a row only skip."""
    calls = []

    def broken_after_one_step(**kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise KeyError("answer")
        return byte_reward(**kwargs)

    config = make_config(tmp_path, train={"steps": 6})
    trainer = make_trainer(config, reward_fn=broken_after_one_step)
    with pytest.warns(RuntimeWarning, match="skipped"), pytest.raises(TrainingFailed, match=r"steps 2-4 failed.*"
                                                                      r"KeyError.*max_failed_steps=3.*--resume"):
        trainer.fit()
    run = tmp_path / "run"
    assert latest_checkpoint(run).name == "step-000001" and len(calls) == 4
    resumed = make_trainer(make_config(tmp_path, train={"steps": 2}))
    resumed.fit(resume=run)
    assert [r["step"] for r in _metrics(run)] == [1, 2]  # the failed steps' records are gone, step 2 re-run
    never = make_trainer(make_config(tmp_path / "b", train={"steps": 4, "max_failed_steps": 0}),
                         reward_fn=lambda **kw: (_ for _ in ()).throw(KeyError("answer")))
    with pytest.warns(RuntimeWarning, match="skipped"):
        never.fit()


def test_every_engine_call_takes_the_engine_section(tmp_path, monkeypatch):
    """--engine.* reaches every engine call, backward and without a graph (old logprobs with num_iterations 2,
    reference with beta > 0), in the one options object the policy passes down."""
    import branchreplay.rl.policy as methods_module

    seen = []
    original = methods_module.replay_with

    def spy(model, trees, loss, options):
        seen.append(("replay_backward" if loss is not None else "replay_logprobs", options.engine))
        return original(model, trees, loss, options)

    monkeypatch.setattr(methods_module, "replay_with", spy)
    config = make_config(tmp_path, grpo={"num_iterations": 2, "beta": 0.01},
                         engine={"replay": "replay", "max_pack_tokens": 8})
    make_trainer(config).train_step(1)
    assert {name for name, _ in seen} == {"replay_backward", "replay_logprobs"}
    assert all(engine is config.engine and engine.max_pack_tokens == 8 for _, engine in seen)


def test_unregistered_family_is_self_checked_once_per_run_folder(tmp_path, monkeypatch):
    """GPT-NeoX is not in the registry: `train` checks it against the naive reference before the first step, logs
    the error, trains, and keeps the verdict in the run folder, so the resumed run does not check again."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    import branchreplay.engine.self_check as self_check

    cfg = GPTNeoXConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(cfg)
    model.generation_config.eos_token_id = EOS
    config = make_config(tmp_path, train={"steps": 1})
    run = make_trainer(config, model=model).fit()
    (verdict,) = json.loads((run / "self_check.json").read_text()).values()
    assert verdict["passed"] and verdict["max_rel_grad_err"] <= 1e-3 and verdict["model_class"] == "GPTNeoXForCausalLM"
    monkeypatch.setattr(self_check, "self_check", lambda m: pytest.fail("checked again despite the cached verdict"))
    resumed = make_trainer(make_config(tmp_path, train={"steps": 2}), model=model).fit(resume=run)
    assert resumed == run
    refused = make_config(tmp_path / "other", train={"steps": 1, "unknown_family": "refuse"})
    with pytest.raises(UnsupportedModelError, match="gpt_neox"):
        make_trainer(refused, model=model).fit()


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_one_step(tmp_path):
    """The real default model and task, one tiny step: chat template, EOS handling, rewards, a checkpoint."""
    config = Config.from_dict({
        "sampling": {"max_new_tokens": 8},
        "task": {"size": 4, "eval_size": 2},
        "grpo": {"num_generations": 2, "prompts_per_step": 1, "beta": 0.04},
        "train": {"steps": 1, "output_dir": str(tmp_path / "run"), "eval_steps": 0},
    })
    trainer = Trainer(config)
    before = trainer.model.model.norm.weight.detach().clone()
    run = trainer.fit()
    records = _metrics(run)
    assert [r["step"] for r in records] == [0, 1] and "eval/accuracy" in records[1]
    assert records[1]["tree/token_ratio"] > 1.5  # two completions share the ~50-token prompt
    assert latest_checkpoint(run).name == "step-000001"
    if records[1]["reward_std"] > 0:
        assert not torch.equal(before, trainer.model.model.norm.weight)


def test_groups_sampled_in_waves_equal_the_whole_step(tmp_path, keep64):
    """sampling.max_num_seqs: a step's groups sample in waves of max_num_seqs // num_generations (here 1, 2 and 1
    group: 4 // 4, 9 // 4, 1 // 4 -> at least 1), each wave on its own; every group draws from its own generator,
    so in float64 the samples equal the whole step's at once (ids; logprobs to 1e-12). A bad value is refused by
    name."""
    batches, waves = {}, {}
    for limit in (None, 4, 9, 1):
        trainer = make_trainer(make_config(tmp_path / str(limit), grpo={"prompts_per_step": 3},
                                           sampling={"max_num_seqs": limit}), dtype=torch.float64)
        keep64(trainer.model)
        batches[limit], waves[limit] = generate(trainer, 1), trainer.source.backend.waves([0, 1, 2])
    assert waves == {None: [[0, 1, 2]], 4: [[0], [1], [2]], 9: [[0, 1], [2]], 1: [[0], [1], [2]]}
    whole = batches[None]
    for batch in batches.values():
        assert [[s.completion_ids for s in g] for g in batch.samples] == [[s.completion_ids for s in g]
                                                                         for g in whole.samples]
        for a, b in zip(sum(batch.samples, []), sum(whole.samples, []), strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-12, rel=0)
    with pytest.raises(ValueError, match="sampling.max_num_seqs"):
        make_config(tmp_path, sampling={"max_num_seqs": 0})
