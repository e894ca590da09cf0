"""Rollouts drawn ahead (grpo.max_staleness, rl/rollouts/ahead.py): the next step's batch is drawn in a forked
sampler process while this step trains.

Exactness: max_staleness 0 is the synchronous loop, metrics and weights bit for bit; with 1, every trained batch was
drawn by the weights of at most one step before, equals the batch a synchronous sampler draws from those weights
(token ids, rewards, logprobs exactly), and in float64 its gradient equals the naive per-rollout reference computed
with the sampler's (behaviour) logprobs as the old ones (1e-9); the reference with the trained weights' own
logprobs as the old ones (the wrong version) is more than 1e-3 away. Faults: the process killed mid-run ends the
run with one line naming it and keeps the checkpoint; Ctrl-C closes it; a run killed at random moments resumes with
every step trained once; a batch beyond the bound is dropped, counted and drawn again; bad settings get one line.
"""

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.rl.algorithms.base import completion_tokens
from branchreplay.rl.rollouts.ahead import Ahead, check_ahead
from branchreplay.rl.rollouts.sampler import Sampler
from branchreplay.rl.run.checkpoint import latest_checkpoint
from branchreplay.rl.run.step import first_update_gradient
from branchreplay.rl.run.stops import TrainingFailed, TrainingInterrupted
from branchreplay.tree import Rollout
from helpers import grads, spawn_ranks
from test_rl_run_trainer import generate, make_config, make_trainer, train_on

pytestmark = pytest.mark.usefixtures("one_thread")


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _sampler_pid(trainer) -> int:
    return trainer.source.process.process.pid


def test_staleness_0_is_the_synchronous_loop_bit_for_bit(tmp_path):
    runs = {}
    for name, grpo in (("unset", {}), ("zero", {"max_staleness": 0}), ("one", {"max_staleness": 1})):
        trainer = make_trainer(make_config(tmp_path / name, grpo=grpo))
        assert isinstance(trainer.source, Ahead) == (name == "one")
        run = trainer.fit()
        measured = ("time/", "tok", "memory/")  # seconds and bytes: not what a run computes
        runs[name] = ([{k: v for k, v in r.items() if not k.startswith(measured)} for r in _metrics(run)],
                      _weights(trainer))
    (unset_rows, unset_w), (zero_rows, zero_w), (one_rows, one_w) = runs["unset"], runs["zero"], runs["one"]
    assert zero_rows == unset_rows
    assert all(torch.equal(zero_w[k], unset_w[k]) for k in unset_w)
    # the comparison can fail: one step ahead trains steps 2 and 3 on batches of older weights
    assert [r["sample/staleness_max"] for r in one_rows] == [0, 1, 1]
    assert one_rows[1]["reward"] != unset_rows[1]["reward"]
    assert not all(torch.equal(one_w[k], unset_w[k]) for k in unset_w)


def _naive_gradient(model, batch, loss, old_logprobs) -> list[torch.Tensor]:
    """The naive per-rollout gradient of `batch` (fresh rollouts: each alone through the HF forward) with
    `old_logprobs` (per rollout) as the old ones."""
    rollouts = [Rollout(r.token_ids, r.loss_mask, advantages=r.advantages, weights=r.weights, old_logprobs=old,
                        group=r.group) for r, old in zip((r for g in batch.rollouts for r in g), old_logprobs,
                                                         strict=True)]
    model.zero_grad(set_to_none=True)
    naive_backward(model, rollouts, loss, temperature=0.7)
    return grads(model)


def test_staleness_1_trains_the_synchronous_draw_of_one_version_before_with_the_naive_gradient(tmp_path, keep64):
    config = make_config(tmp_path / "ahead", grpo={"max_staleness": 1, "loss_type": "grpo", "epsilon": 0.05},
                         model={"dtype": "float64"})
    trainer = make_trainer(config, dtype=torch.float64)
    keep64(trainer.model)
    versions = [_weights(trainer)]
    first = generate(trainer, 1)
    assert first.versions == [0, 0] and first.metrics["sample/staleness_max"] == 0
    train_on(trainer, first)
    versions.append(_weights(trainer))
    batch = generate(trainer, 2)  # drawn by version 0 while step 1 trained
    assert batch.versions == [0, 0] and batch.metrics["sample/staleness_max"] == 1  # one update behind

    # the batch a synchronous sampler draws from version 0's weights
    sync = make_trainer(make_config(tmp_path / "sync", model={"dtype": "float64"}), dtype=torch.float64)
    keep64(sync.model).load_state_dict(versions[0])
    drawn = generate(sync, 2)
    assert [[s.completion_ids for s in g] for g in batch.samples] == [[s.completion_ids for s in g]
                                                                       for g in drawn.samples]
    assert torch.equal(batch.rewards, drawn.rewards)
    flat = [s for g in drawn.samples for s in g]
    assert all(lp[len(lp) - len(s.logprobs):].tolist() == s.logprobs for lp, s in zip(batch.sampler_logprobs, flat,
                                                                                      strict=True))

    # its gradient on version 1's weights: the naive reference with the behaviour logprobs as the old ones
    loss = lambda: trainer.algorithm.make_loss(completion_tokens(batch.trees))  # noqa: E731
    ours = first_update_gradient(trainer.algorithm, batch, None)
    reference = make_trainer(make_config(tmp_path / "ref", model={"dtype": "float64"}), dtype=torch.float64).model
    keep64(reference).load_state_dict(versions[1])
    right = _naive_gradient(reference, batch, loss(), batch.sampler_logprobs)
    assert max_rel_grad_err(ours, right) < 1e-9
    # the control: the old logprobs of the wrong version (the weights that train, as if drawn by them)
    with torch.no_grad():
        own = [naive_backward(reference, [Rollout(r.token_ids, r.loss_mask)], None, temperature=0.7).logprobs[0]
               for g in batch.rollouts for r in g]
    wrong = _naive_gradient(reference, batch, loss(), own)
    assert max_rel_grad_err(ours, wrong) > 1e-3
    trainer.source.close()


def _kind(tmp_path, kind: str):
    """A trainer drawing ahead, and one drawing synchronously, for a rollout kind."""
    import test_rl_agent

    if kind == "branching":
        make = lambda tmp, grpo: make_trainer(make_config(  # noqa: E731
            tmp, grpo=grpo, sampling={"branching": [[0, 2], [3, 2]]}))
    else:
        algorithm = kind.removeprefix("multi-turn ")
        make = lambda tmp, grpo: test_rl_agent.make_trainer(  # noqa: E731
            test_rl_agent.make_config(tmp, algorithm, grpo=grpo))
    return make(tmp_path / "ahead", {"max_staleness": 1}), make(tmp_path / "sync", {})


@pytest.mark.parametrize("kind", ["branching", "multi-turn grpo", "multi-turn ppo", "multi-turn rloo"])
def test_every_rollout_kind_draws_ahead_what_the_synchronous_loop_draws(tmp_path, kind):
    trainer, sync = _kind(tmp_path, kind)
    sync.model.load_state_dict(_weights(trainer))
    train_on(trainer, generate(trainer, 1))
    batch = generate(trainer, 2)  # drawn by version 0 while step 1 trained: the synchronous draw of those weights
    drawn = generate(sync, 2)
    assert batch.versions == [0] * len(batch.rollouts) and batch.metrics["sample/staleness_max"] == 1
    assert [[r.token_ids.tolist() for r in g] for g in batch.rollouts] == [[r.token_ids.tolist() for r in g]
                                                                           for g in drawn.rollouts]
    assert torch.equal(batch.rewards, drawn.rewards)
    metrics = train_on(trainer, batch)
    assert metrics["grad_norm"] > 0 and "sampling/importance_sampling_ratio/mean" in metrics
    trainer.source.close()


def test_a_batch_beyond_the_bound_is_dropped_counted_and_drawn_again_by_the_current_weights(tmp_path, monkeypatch):
    trainer = make_trainer(make_config(tmp_path, grpo={"max_staleness": 1}))
    train_on(trainer, generate(trainer, 1))
    take = trainer.source.take

    def too_old(step):  # as if drawn two versions before the weights that train it
        answer = take(step)
        answer[2][1].versions = [step - 3] * len(answer[2][1].versions)
        return answer

    monkeypatch.setattr(trainer.source, "take", too_old)
    batch = generate(trainer, 2)
    assert batch.metrics["sample/dropped_stale_total"] == 2 and batch.metrics["sample/staleness_max"] == 0
    sync = Sampler(trainer.config, trainer.policy, trainer.tokenizer, trainer.train_data, trainer.rewards)
    drawn = sync.batch(2)  # the trainer's weights now (version 1)
    assert [[s.completion_ids for s in g] for g in batch.samples] == [[s.completion_ids for s in g]
                                                                       for g in drawn.samples]
    trainer.source.close()


def test_the_sampler_process_killed_ends_the_run_with_one_line_and_keeps_the_checkpoint(tmp_path):
    trainer = make_trainer(make_config(tmp_path, grpo={"max_staleness": 1}, train={"steps": 4}))
    backward = trainer.algorithm.backward

    def then_kill(k, prepared):
        out = backward(k, prepared)
        if trainer.step == 1:  # step 2 trains: the sampler draws step 3
            os.kill(_sampler_pid(trainer), signal.SIGKILL)
        return out

    trainer.algorithm.backward = then_kill
    with pytest.raises(TrainingFailed, match=r"step (3|4): the sampler process \(pid \d+\) was killed by signal 9.*"
                                             r"--resume") as failed:
        trainer.fit()
    assert "\n" not in str(failed.value)
    # step 3, or step 4 where the sampler had drawn step 3 before the kill reached it (a race it may win): the run
    # ends at the first step whose batch never comes, and keeps the step before it
    step = int(str(failed.value).split(":")[0].split()[1])
    assert latest_checkpoint(tmp_path / "run").name == f"step-{step - 1:06d}"


def test_ctrl_c_stops_the_trainer_after_the_step_and_closes_the_sampler_process(tmp_path):
    trainer = make_trainer(make_config(tmp_path, grpo={"max_staleness": 1}, train={"steps": 4}))
    backward = trainer.algorithm.backward

    def then_interrupt(k, prepared):
        out = backward(k, prepared)
        os.kill(_sampler_pid(trainer), signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
        os.kill(os.getpid(), signal.SIGINT)
        return out

    trainer.algorithm.backward = then_interrupt
    with pytest.raises(TrainingInterrupted):
        trainer.fit()
    assert latest_checkpoint(tmp_path / "run").name == "step-000001"
    assert not trainer.source.process.process.is_alive()
    assert trainer.source.process.process.exitcode == 0  # it ignored SIGINT and was told to stop


STEPS = 6


def _attempt(tmp: str) -> None:
    """One process of a run with rollouts ahead, resumed when it has a checkpoint; writes its sampler's pid."""
    torch.set_num_threads(1)
    tmp = Path(tmp)
    trainer = make_trainer(make_config(tmp, grpo={"max_staleness": 1},
                                       train={"steps": STEPS, "save_steps": 1, "keep_checkpoints": 2}))
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "sampler-pid").write_text(str(_sampler_pid(trainer)))
    run = tmp / "run"
    trainer.fit(resume=run if latest_checkpoint(run) is not None else None)


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process `pid` has exited (or is a zombie no one reaped) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_a_run_killed_at_random_moments_resumes_with_every_step_trained_once(tmp_path):
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["branchreplay.rl.run.trainer", "branchreplay.models", "rich.console"])
    for straight in (tmp_path / "warm-up", tmp_path / "straight"):  # the first starts the fork server
        process = context.Process(target=_attempt, args=(str(straight),))
        began = time.monotonic()
        process.start()
        process.join(180)
        assert process.exitcode == 0
        whole_run_s = time.monotonic() - began
    rng, scale = random.Random(0), 1.0
    for fresh in range(3):  # a fresh run, with kills twice as early, where a resumed run outpaced `whole_run_s`
        killed, kills = tmp_path / f"killed-{fresh}", 0
        while kills < 5:
            (killed / "sampler-pid").unlink(missing_ok=True)
            process = context.Process(target=_attempt, args=(str(killed),))
            process.start()
            process.join(rng.uniform(0.2, 0.7) * scale * whole_run_s)
            if not process.is_alive():
                break
            os.kill(process.pid, signal.SIGKILL)
            process.join(30)
            kills += 1
            if (killed / "sampler-pid").exists():  # its sampler process exits once the trainer is gone
                assert _gone(int((killed / "sampler-pid").read_text()))
        if process.exitcode != 0:
            process = context.Process(target=_attempt, args=(str(killed),))
            process.start()
            process.join(180)
        if kills >= 2:
            break
        scale /= 2
    assert process.exitcode == 0 and kills >= 2
    rows = _metrics(killed / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once: none lost, none twice
    assert all(r["sample/staleness_max"] <= 1 and r["sample/dropped_stale_total"] == 0 for r in rows)
    assert latest_checkpoint(killed / "run").name == f"step-{STEPS:06d}"
    assert [r["step"] for r in _metrics(straight / "run")] == list(range(1, STEPS + 1))


def test_bad_settings_get_one_line_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"grpo.max_staleness.*>= 0"):
        make_config(tmp_path, grpo={"max_staleness": -1})
    dpo = make_config(tmp_path, grpo={"max_staleness": 1})
    dpo.algorithm = "dpo"
    with pytest.raises(ValueError, match=r"grpo.max_staleness=1 .*algorithm dpo.*set grpo.max_staleness 0"):
        check_ahead(dpo, samples=False, device=torch.device("cpu"))
    config = make_config(tmp_path, grpo={"max_staleness": 2})
    with pytest.raises(ValueError, match=r"forked process, which cannot use cuda: set sampling.backend vllm"):
        check_ahead(config, samples=True, device=torch.device("cuda"))
    check_ahead(config, samples=True, device=torch.device("cpu"))


def _two_rank_worker(rank: int, world: int, tmp: str, strategy: str) -> None:
    config = make_config(Path(tmp), grpo={"prompts_per_step": 3, "max_staleness": 1},
                         parallel={"strategy": strategy, "timeout_s": 120}, train={"output_dir": f"{tmp}/{strategy}"})
    trainer = make_trainer(config, dtype=torch.float64)
    assert (trainer.source.process is not None) == (rank == 0)  # rank 0 feeds the sampler process
    trainer.fit()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_two_ranks_receive_rank_0s_batches_and_train_as_one_process(tmp_path, strategy):
    single = make_trainer(make_config(tmp_path, grpo={"prompts_per_step": 3, "max_staleness": 1},
                                      train={"output_dir": str(tmp_path / "single")}), dtype=torch.float64).fit()
    spawn_ranks(_two_rank_worker, 2, str(tmp_path), strategy, group=False)
    ours, theirs = _metrics(tmp_path / strategy), _metrics(single)
    assert [r["sample/staleness_max"] for r in ours] == [0, 1, 1] and ours[-1]["dist/world_size"] == 2
    for a, b in zip(ours, theirs, strict=True):
        assert a["reward"] == b["reward"]  # the same batches, drawn by the same weights
        for key in ("loss", "grad_norm", "sampling/importance_sampling_ratio/mean"):
            assert abs(a[key] - b[key]) <= 1e-9 * max(1.0, abs(b[key])), (key, a, b)
