"""The GRPO training loop, with the loss and its gradients computed over prefix trees (one tree per prompt group).

One step (TRL GRPOTrainer, `_generate_and_score_completions` and `_compute_loss`):
  1. take `prompts_per_step` prompts of the train split: epochs of a permutation seeded by (train.seed, epoch), so
     step s always gets the same prompts, resumed or not;
  2. chat-template each prompt and sample G completions with the prompt prefilled once (`sampling.sample_group`),
     each group k with its own torch.Generator seeded by (train.seed, s, k), so that its samples do not depend on
     the other groups or on the world size (since issue 11; earlier versions drew every group of a step from one
     generator seeded by (train.seed, s));
  3. decode the completions, score them (`rewards.compute_rewards`), and turn the rewards into group-relative
     advantages (`advantages.group_advantages`);
  4. rollouts = prompt ids + sampled ids (never re-tokenized), loss mask 1 on the completion; per-token weights by
     `losses.token_weights(loss_type)` over the WHOLE step, so micro-batching does not change the gradient;
  5. num_iterations > 1: old logprobs of the sampling policy by `replay_logprobs` before the first update (with 1,
     the ratio is against the detached current logprobs, as TRL); beta > 0: reference logprobs of the frozen
     initial model;
  6. per update: `replay_backward` over micro-batches of trees, clip the gradient norm, AdamW, LR schedule.
Departures from TRL: a group whose advantages are all zero (all rewards equal) is skipped in step 6 when beta and
entropy_coef are 0, since its gradient is exactly zero; so `entropy` and `clip_ratio/*` are over the groups that
trained. One step = one sampling round (TRL's steps_per_generation = 1) followed by num_iterations updates. The model
stays in eval mode: dropout would break the equality with the per-rollout computation. Evaluation decodes greedily
with HF `generate`, left-padded in batches.
"""

from __future__ import annotations

import contextlib
import copy
import json
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

from ..check.self_check import ensure_supported
from ..engine import EngineConfig, UnsupportedModelError, replay_backward, replay_logprobs
from ..engine.distributed import DataParallel, shutdown
from ..engine.sharding import shard
from ..losses import GRPOLoss, LossStats, token_weights
from ..models import autocast, chat_prompt_ids, load_policy
from ..tree import ReplayResult, Rollout, RolloutTree
from .advantages import group_advantages, group_std
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, write_atomic
from .config import Config
from .evaluation import evaluate
from .log import MetricsLog, peak_memory_bytes, progress_info, step_line, summarize
from .parallel import Ranks, launch
from .rewards import RewardFunctionError, make_reward, score
from .sampling import Sample, eos_token_ids, sample_group
from .tasks import build_messages, load_task

SELF_CHECK = "self_check.json"  # the run folder's verdicts on unregistered families (check/self_check.py)


class TrainingInterrupted(RuntimeError):
    """SIGINT/SIGTERM stopped training after a checkpoint was written; `run_dir` is the folder to resume."""

    def __init__(self, run_dir: Path, step: int):
        super().__init__(f"training stopped after step {step}; checkpoint saved. Resume with: "
                         f"branchreplay train --resume {run_dir}")
        self.run_dir, self.step = run_dir, step


@dataclass
class Batch:
    """One step's samples. Groups in prompt order; flat [B] tensors are group-major (B = groups x G).

    prompt_ids: per group, the chat-templated prompt ids. samples: per group, G `Sample`s.
    rollouts: per group, G `Rollout`s with advantages and weights. rewards, advantages: [B] float32.
    reward_std: [B] std of each sample's group (of the batch with scale_rewards="batch"), as TRL logs it.
    """

    prompt_ids: list[list[int]]
    samples: list[list[Sample]]
    rollouts: list[list[Rollout]]
    rewards: torch.Tensor
    advantages: torch.Tensor
    reward_std: torch.Tensor


class Trainer:
    """GRPO over prefix trees. Everything is built from `config` unless injected (tests inject a tiny model, a
    character tokenizer, a list of {question, answer, ...} items and a reward function with TRL's signature)."""

    def __init__(self, config: Config, model=None, tokenizer=None, train_data=None, eval_data=None, reward_fn=None,
                 console: Console | None = None):
        self.ranks: Ranks | None = launch(config.parallel.strategy, config.to_dict(),  # None: one process
                                          config.parallel.timeout_s)
        self.rank = self.ranks.rank if self.ranks else 0
        self.config, self.console = config, console or Console(quiet=self.rank != 0)
        if train_data is None:  # the task and its reward first: a typo there should not cost a model load
            train_data, eval_data = load_task(config.task)
        reward_fn = reward_fn or make_reward(config.task.reward, train_data)
        m = config.model
        if m.dtype == "float16":
            raise ValueError("model.dtype=float16 cannot train: float16 mixed precision needs loss scaling, which "
                             "branchreplay does not do; use bfloat16 (same speed, float32's exponent range)")
        if model is None:
            model, tokenizer = load_policy(m.spec, m.dtype, m.device)
        if m.dtype == "bfloat16" and next(model.parameters()).dtype != torch.float32:
            raise ValueError(f"model.dtype=bfloat16 trains float32 master weights under autocast; the given model's "
                             f"parameters are {next(model.parameters()).dtype}: pass it in float32")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.autocast = lambda: autocast(m.dtype, model.device.type)  # bfloat16: mixed precision (models.autocast)
        self.train_data, self.eval_data = train_data, eval_data
        self.reward_fn = reward_fn
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.force = False  # an unregistered family that passed its self-check runs forced (check/self_check.py)
        if self.ranks is not None:
            rollouts = config.grpo.prompts_per_step * config.grpo.num_generations
            if rollouts < self.ranks.world_size:
                raise ValueError(f"a step has {rollouts} rollouts (grpo.prompts_per_step x grpo.num_generations) for "
                                 f"{self.ranks.world_size} ranks: raise them or start fewer processes")
            for p in model.parameters():  # every rank starts from rank 0's weights, the reference copy too
                torch.distributed.broadcast(p.data, src=0)
            # rank 0 runs the self-check before sharding and tells the others (its verdict in the run folder)
            self.force = self.check_family(Path(config.train.output_dir))
        self.ref_model = None
        if config.grpo.beta > 0:  # frozen initial weights; copied before any checkpoint is loaded, and sharding
            self.ref_model = copy.deepcopy(model).requires_grad_(False)
        self.dp = None
        if self.ranks is not None:  # after the reference copy: fully_shard changes the model in place
            strategy = "fsdp2" if config.parallel.strategy == "auto" else config.parallel.strategy
            self.dp = DataParallel(model, strategy, device=model.device.type, broadcast=False)  # broadcast above
        g = config.grpo
        self.params = [p for p in model.parameters() if p.requires_grad]
        # foreach=False: the FSDP2 layers' DTensors and the replicated plain tensors cannot share one foreach kernel
        self.optimizer = torch.optim.AdamW(self.params, lr=g.learning_rate, weight_decay=g.weight_decay,
                                           **({"foreach": False} if self.dp is not None else {}))
        schedule = {"cosine": get_cosine_schedule_with_warmup, "constant": get_constant_schedule_with_warmup}
        extra = {"num_training_steps": config.train.steps * g.num_iterations} if g.lr_scheduler == "cosine" else {}
        self.scheduler = schedule[g.lr_scheduler](self.optimizer, num_warmup_steps=g.warmup_steps, **extra)
        self.step, self.num_tokens = 0, 0
        self.status = lambda text: None  # the progress bar's current phase; set by the run loop

    # -- one step ---------------------------------------------------------------------------------------------------

    def generate(self, step: int) -> Batch:
        """Sample, score and build the rollouts of `step` (>= 1). Raises RewardFunctionError from the reward."""
        cfg, G = self.config, self.config.grpo.num_generations
        items = [self.train_data[i] for i in prompt_indices(len(self.train_data), cfg.grpo.prompts_per_step,
                                                            cfg.train.seed, step)]
        prompt_ids = [chat_prompt_ids(self.tokenizer, build_messages(item["question"])) for item in items]
        mine = self.ranks.mine(len(items)) if self.ranks else list(range(len(items)))
        samples, rewards, error, failure = {}, {}, None, None
        with self.gathered(), self.autocast():
            try:
                for k in mine:  # each group its own stream: its samples do not depend on the world size
                    self.status(f"step {step}: sampling group {k + 1}/{len(prompt_ids)}")
                    generator = torch.Generator(self.model.device).manual_seed(_mix(_mix(cfg.train.seed, step), k))
                    samples[k] = sample_group(self.model, prompt_ids[k], G, cfg.sampling, self.eos_ids, generator)
            except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
                if self.ranks is None:
                    raise
                failure = f"rank {self.rank}: {type(e).__name__}: {e}"
        try:
            if mine:
                scores = score(self.reward_fn, self.tokenizer, [items[k] for k in mine], [samples[k] for k in mine])
                rewards = dict(zip(mine, scores.split(G)))
        except RewardFunctionError as e:
            error = str(e)
        if self.ranks is not None:  # every rank gets the whole batch (token ids, logprobs and rewards: small)
            parts = self.ranks.gather((samples, rewards, error, failure))
            error = next((e for _, _, e, _ in parts if e is not None), None)
            failure = next((f for _, _, _, f in parts if f is not None), None)
            if failure is not None:
                raise RuntimeError(f"sampling failed on {failure}")
            for s_part, r_part, _, _ in parts:
                samples.update(s_part)
                rewards.update(r_part)
        if error is not None:
            raise RewardFunctionError(error)
        samples = [samples[k] for k in range(len(items))]
        rewards = torch.cat([rewards[k] for k in range(len(items))])
        groups = [i for i, group in enumerate(samples) for _ in group]
        advantages = group_advantages(rewards, groups, cfg.grpo.scale_rewards)
        std = group_std(rewards, groups) if cfg.grpo.scale_rewards != "batch" else rewards.std().expand_as(rewards)
        masks = [[0.0] * len(ids) + [float(not (cfg.grpo.mask_truncated_completions and s.truncated))] *
                 len(s.completion_ids) for ids, group in zip(prompt_ids, samples) for s in group]
        weights = token_weights(masks, cfg.grpo.loss_type, max_completion_length=cfg.sampling.max_new_tokens)
        flat = [(ids, s, gi) for gi, (ids, group) in enumerate(zip(prompt_ids, samples)) for s in group]
        rollouts = [[] for _ in samples]
        for (ids, s, gi), mask, w, a in zip(flat, masks, weights, advantages.tolist()):
            rollouts[gi].append(Rollout(ids + s.completion_ids, mask, advantages=a, weights=w, group=gi))
        return Batch(prompt_ids, samples, rollouts, rewards, advantages, std)

    def update(self, batch: Batch) -> dict:
        """num_iterations optimizer updates on `batch`; returns the loss metrics (averaged over the updates)."""
        g, temperature, engine = self.config.grpo, self.config.sampling.temperature, self.config.engine
        trees = [RolloutTree(group) for group in batch.rollouts]
        trained = [t for t in trees if g.beta > 0 or g.entropy_coef > 0 or
                   any(r.advantages.any() and r.weights.any() for r in t.rollouts)]
        plan = None
        if self.ranks is not None and trained:
            plan = shard(trained, self.ranks.world_size, self.model.config, allow_empty=True)
        local = plan.parts[self.rank] if plan else trained  # this rank's trees (engine/sharding.py)
        if local and g.num_iterations > 1:  # the sampling policy's logprobs, before the first update
            with self.gathered(), self.autocast():
                old = replay_logprobs(self.model, local, temperature=temperature, engine=engine,
                                      force=self.force).logprobs
            for r, lp in zip(_rollouts(local), old):
                r.old_logprobs = lp
        if local and g.beta > 0:  # the reference model is a full copy on every rank
            with self.autocast():
                ref = replay_logprobs(self.ref_model, local, temperature=temperature, engine=engine,
                                      force=self.force).logprobs
            for r, lp in zip(_rollouts(local), ref):
                r.ref_logprobs = lp
        loss_fn = GRPOLoss(g.epsilon, g.epsilon_high, g.beta, g.entropy_coef, g.use_bias_correction_kl, g.delta,
                           entropy_tokens=sum(float(r.loss_mask.sum()) for t in trees for r in t.rollouts))
        history = []
        for _ in range(g.num_iterations):
            for p in self.params:  # zeros, not None: AdamW then moves every parameter as TRL's would
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
            loss_fn.stats = LossStats()  # the clip, KL and entropy sums of this update (losses.py)
            if self.dp is None:
                with self.autocast():
                    result = accumulate(self.model, local, loss_fn, g.micro_batch_prompts, temperature, engine,
                                        self.force) if local else None
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, g.max_grad_norm).item()
            else:  # every rank has the same `trained`: all of them run the collectives, or none
                result = self.accumulate_sharded(local, loss_fn) if trained else None
                grad_norm = self.dp.clip_grad_norm_(g.max_grad_norm)
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            history.append({"loss": result.loss if result else 0.0, "grad_norm": grad_norm, "learning_rate": lr,
                            **(loss_fn.stats.metrics() if result else {})})
        out = {k: sum(h[k] for h in history) / len(history) for k in history[-1]}
        if plan is not None:
            out.update({"dist/world_size": self.ranks.world_size, "dist/imbalance": plan.imbalance,
                        "dist/recomputed_positions": plan.recomputed_positions,
                        **{f"dist/physical_tokens/rank{r}": n for r, n in enumerate(plan.physical_tokens)}})
        stats = sum((t.stats for t in trees[1:]), trees[0].stats)
        out.update({"tree/logical_tokens": stats.logical_tokens, "tree/physical_tokens": stats.physical_tokens,
                    "tree/token_ratio": stats.token_ratio})
        return out

    def accumulate_sharded(self, local: list[RolloutTree], loss_fn: GRPOLoss) -> ReplayResult:
        """This rank's trees forward and backward (micro-batched), the gradient reduced once over the ranks; the
        loss and the loss statistics summed over the ranks (every rank returns the step's totals)."""
        g = self.config.grpo
        trees = local or [_idle_tree(self.model)]  # a rank without rollouts still joins the one reduction
        with self.dp.accumulate(), self.autocast():
            result = accumulate(self.model, trees, loss_fn, g.micro_batch_prompts, self.config.sampling.temperature,
                                self.config.engine, self.force, final_backward=self.dp.final_sync())
        if not local:
            result = ReplayResult([], [], 0.0, result.stats)
        self.dp.reduce_replicated()
        sums = loss_fn.stats.sums if loss_fn.stats.sums is not None else torch.zeros(5, dtype=torch.float64)
        totals = self.ranks.sum([result.loss, *sums.tolist()])
        result.loss = totals[0]
        loss_fn.stats.sums = torch.tensor(totals[1:], dtype=torch.float64)
        loss_fn.stats.kl = g.beta != 0
        return result

    def gathered(self):
        """The FSDP2 layers' full parameters while inside (sampling and logprob forwards: any number per rank)."""
        return self.dp.gathered() if self.dp is not None else contextlib.nullcontext()

    def train_step(self, step: int) -> dict | None:
        """generate + update; returns the step's metrics, or None (with a warning) when the reward failed."""
        t0 = time.perf_counter()
        try:
            batch = self.generate(step)
        except RewardFunctionError as e:
            warnings.warn(f"step {step} skipped: {e}", RuntimeWarning, stacklevel=2)
            return None
        t1 = time.perf_counter()
        self.status(f"step {step}: training on {sum(map(len, batch.rollouts))} rollouts")
        metrics = self.update(batch)
        t2 = time.perf_counter()
        lengths = [len(s.completion_ids) for group in batch.samples for s in group]
        self.num_tokens += sum(len(r) for group in batch.rollouts for r in group)
        return {
            "step": step,
            "reward": batch.rewards.mean().item(),
            "reward_std": batch.reward_std.mean().item(),
            "frac_reward_zero_std": torch.isclose(batch.reward_std, torch.zeros(())).float().mean().item(),
            "completions/mean_length": sum(lengths) / len(lengths),
            "completions/clipped_ratio": sum(s.truncated for g in batch.samples for s in g) / len(lengths),
            "num_tokens": self.num_tokens,
            **metrics,
            "time/sample_s": t1 - t0,
            "time/train_s": t2 - t1,
            "time/step_s": t2 - t0,
            "memory/peak_bytes": peak_memory_bytes(self.model.device),
        }

    # -- the run ------------------------------------------------------------------------------------------------------

    def fit(self, resume: str | Path | None = None) -> Path:
        """Train `train.steps` steps in the run folder (train.output_dir, or `resume`); returns the run folder.

        Raises ValueError when the folder already holds checkpoints and `resume` is not given, FileNotFoundError when
        `resume` holds none, TrainingInterrupted after SIGINT/SIGTERM (the checkpoint is written first)."""
        cfg = self.config.train
        run_dir = Path(resume if resume is not None else cfg.output_dir)
        if resume is None and latest_checkpoint(run_dir) is not None:
            raise ValueError(f"{run_dir} already holds a run; continue it with --resume {run_dir}, or choose another "
                             "--train.output_dir")
        if resume is not None:
            found = latest_checkpoint(run_dir)
            if found is None:
                raise FileNotFoundError(f"--resume {run_dir}: no complete checkpoint in {run_dir / 'checkpoints'}")
            self.step, extra = load_checkpoint(found, self.model, self.optimizer, self.scheduler)
            self.num_tokens = extra.get("num_tokens", 0)
            self.console.print(f"resumed {run_dir} from {found.name}")
        self.config.train.output_dir = str(run_dir)
        if self.rank == 0:  # rank 0 alone writes the run folder
            run_dir.mkdir(parents=True, exist_ok=True)
            self.config.save(run_dir / "config.yaml")
        if self.ranks is None:  # data-parallel runs checked before sharding (__init__)
            self.force = self.check_family(run_dir)
        log = MetricsLog(run_dir, truncate_after=self.step) if self.rank == 0 else _NoLog()
        stop: list[str] = []
        try:
            with _stop_on_signals(stop, self.console):
                self._loop(run_dir, log, stop)
        finally:
            log.close()
        if self.stopping(stop):
            raise TrainingInterrupted(run_dir, self.step)
        if self.rank == 0:
            summarize(self.console, run_dir, log.records)
        return run_dir

    def _loop(self, run_dir: Path, log: MetricsLog, stop: list) -> None:
        """Steps until train.steps or a stop signal; evaluates and saves on schedule, and always saves at the end."""
        cfg = self.config.train
        bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
                       TimeRemainingColumn(), console=self.console)
        task = bar.add_task("train", total=cfg.steps, completed=self.step, info="")
        self.status = lambda text: bar.update(task, info=text)
        with bar:
            first_eval = self.step == 0 and not log.records and cfg.eval_steps >= 0
            if self.ranks is not None:  # rank 0 holds the metrics log: its decision is everyone's
                first_eval = self.ranks.gather(first_eval)[0]
            if first_eval:
                log.write({"step": 0, **self.evaluate()})
                bar.console.print(step_line(log.records[-1], cfg.steps))
            while self.step < cfg.steps and not self.stopping(stop):
                record = self.train_step(self.step + 1) or {"step": self.step + 1}
                self.step += 1
                last = self.step == cfg.steps
                if cfg.eval_steps >= 0 and (last or (cfg.eval_steps and self.step % cfg.eval_steps == 0)):
                    record.update(self.evaluate())
                log.write(record)
                bar.console.print(step_line(record, cfg.steps))
                bar.update(task, completed=self.step, info=progress_info(record))
                if cfg.save_steps and self.step % cfg.save_steps == 0:
                    self.save(run_dir)
        found = latest_checkpoint(run_dir)
        if found is None or found.name != f"step-{self.step:06d}":
            self.save(run_dir)

    def stopping(self, stop: list) -> bool:
        """Whether to stop before the next step: a signal on any rank stops every rank at the same step."""
        return self.ranks.any(bool(stop)) if self.ranks else bool(stop)

    def check_family(self, run_dir: Path) -> bool:
        """`check.self_check.ensure_supported` on the policy, its verdicts kept in run_dir/self_check.json
        (written atomically, by rank 0); True when the family is unregistered and passed (the engine then runs it
        forced). In a data-parallel run rank 0 checks before sharding and gathers its verdict to every rank."""
        if self.ranks is not None:  # rank 0 decides; the others take its verdict (no rank may disagree)
            outcome = (None, None)
            if self.rank == 0:
                try:
                    outcome = (self._check_family(run_dir), None)
                except UnsupportedModelError as e:
                    outcome = (None, str(e))
            force, error = self.ranks.gather(outcome)[0]
            if error is not None:
                raise UnsupportedModelError(error)
            return force
        return self._check_family(run_dir)

    def _check_family(self, run_dir: Path) -> bool:
        path = run_dir / SELF_CHECK
        verdicts = json.loads(path.read_text()) if path.is_file() else {}
        known = dict(verdicts)
        try:
            return ensure_supported(self.model, self.config.engine, verdicts, log=self.console.print)
        finally:  # a failed verdict is kept too: the refusal is the same on the next try
            if verdicts != known:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, json.dumps(verdicts, indent=1))

    def save(self, run_dir: Path) -> Path:
        """The checkpoint of the current step, written atomically by every rank together (`save_checkpoint`)."""
        return save_checkpoint(run_dir, self.step, self.model, self.optimizer, self.scheduler,
                               keep=self.config.train.keep_checkpoints, extra={"num_tokens": self.num_tokens},
                               tokenizer=self.tokenizer)

    def evaluate(self) -> dict:
        """The held-out score; data-parallel, each rank decodes its share of the split with the full parameters."""
        with self.gathered(), self.autocast():
            return evaluate(self.model, self.tokenizer, self.config, self.eval_data, self.reward_fn,
                            progress=lambda done, total: self.status(f"held-out eval: {done}/{total} answers"),
                            ranks=self.ranks)


# -- pieces ---------------------------------------------------------------------------------------------------------

def accumulate(model, trees: list[RolloutTree], loss, micro_batch_prompts: int, temperature: float,
               engine: EngineConfig = EngineConfig(), force: bool = False, final_backward=None) -> ReplayResult:
    """`replay_backward` over consecutive micro-batches of `micro_batch_prompts` trees (0 = all at once), with the
    run's `engine` section; gradients accumulate in param.grad. `final_backward` (data parallelism: the gradient
    sync) wraps the last micro-batch's last backward. Returns the results merged (`ReplayResult.merge`)."""
    size = micro_batch_prompts or len(trees) or 1
    starts = list(range(0, len(trees), size)) or [0]
    return ReplayResult.merge([replay_backward(model, trees[i : i + size], loss, temperature=temperature,
                                               engine=engine, force=force,
                                               final_backward=final_backward if i == starts[-1] else None)
                               for i in starts])


def prompt_indices(n: int, per_step: int, seed: int, step: int) -> list[int]:
    """Indices into a split of n items for `step` (>= 1): positions (step-1)*per_step ... of the concatenated
    epochs, epoch e being a permutation seeded by (seed, e). Pure function of its arguments."""
    out = []
    for k in range((step - 1) * per_step, step * per_step):
        epoch, pos = divmod(k, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(_mix(seed, -1 - epoch)))
        out.append(int(perm[pos]))
    return out


def _idle_tree(model) -> RolloutTree:
    """Two tokens with zero loss weight: the backward of a rank that has no rollouts this step (fewer trained
    rollouts than ranks) runs through every layer and joins the gradient reduction with zeros."""
    zeros = [0.0, 0.0]
    return RolloutTree([Rollout([0, 0], [0, 1], advantages=0.0, weights=zeros, old_logprobs=zeros,
                                ref_logprobs=zeros)])


class _NoLog:
    """The metrics log of a rank other than 0: records kept in memory, nothing written."""

    def __init__(self):
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def _mix(seed: int, k: int) -> int:
    return (seed * 1_000_003 + k) % (2**63 - 1)


def _rollouts(trees: list[RolloutTree]) -> list[Rollout]:
    return [r for t in trees for r in t.rollouts]


@contextlib.contextmanager
def _stop_on_signals(stop: list, console: Console):
    """While active, the first SIGINT/SIGTERM appends its name to `stop` (the loop then finishes the step, saves and
    stops); a second one raises KeyboardInterrupt at once. Only in the main thread (Python's signal rule)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.append(signal.Signals(signum).name)
        console.print(f"[yellow]{stop[0]}: finishing this step, then saving a checkpoint (again to abort now)")

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# -- entry point for cli.py -------------------------------------------------------------------------------------

def train(config: Config, resume: str | None = None) -> Path:
    """Build the model, task and trainer from `config` and train; returns the run folder. Under torchrun every rank
    calls it (rl/parallel.py); the process group is closed after a run that succeeded (`distributed.shutdown`)."""
    try:
        run_dir = Trainer(config).fit(resume)
    except TrainingInterrupted:
        shutdown()  # every rank stopped at the same step, after the checkpoint
        raise
    shutdown()
    return run_dir


