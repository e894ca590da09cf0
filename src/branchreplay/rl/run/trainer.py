"""The training run: one loop for every algorithm (config `algorithm`), the losses and their gradients computed over
prefix trees.

A step is one function, `step.train_step`: sample, score, trees, shard, passes, advantages, updates, optimizer
steps and log, each phase timed. Around it the run: evaluation (`evaluation.py`: greedy, in batches), the metrics
log, atomic checkpoints on schedule, resume, signals and failed steps.
Under torchrun every rank runs the same loop (`parallel.py`). The model stays in eval mode: dropout would break the
equality with the per-rollout computation.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from ...engine.parallel.distributed import fsdp_mode, shutdown
from ...models import apply_lora, load_policy
from ..agent.task import bind, load_agent_task
from ..algorithms import algorithm_class
from ..config import Config
from ..config.resolve import resolved
from ..config.resume import FIRST, check_resume, latest_config, save_run_config
from ..config.run import saved_config
from ..data.rewards import RewardFunctionError, RewardFunctions, make_rewards, with_timeout
from ..data.tasks import load_task
from ..policy import Policy
from ..rollouts.ahead import Ahead, SamplerFailed, check_ahead, start_sampler
from ..rollouts.sampler import Sampler
from ..rollouts.vllm.backend import connect
from ..rollouts.vllm.client import VLLMError
from .checkpoint import incomplete_latest, latest_checkpoint, load_checkpoint, save_checkpoint
from .evaluation import evaluate, score_name
from .family import check_family
from .log import MetricsLog, NoLog, held_out_progress, progress_info, run_console, step_line, summarize
from .parallel import FAILED, launch
from .skips import Skips
from .step import train_step, trained
from .stops import RankDied, TrainingAborted, TrainingFailed, TrainingInterrupted, raise_if_a_rank_died, stop_on_signals

if TYPE_CHECKING:
    from ..algorithms.base import Algorithm
    from .parallel import Ranks

class Trainer:
    """A run of `config`. Everything is built from `config` unless injected (tests inject a tiny model, a character
    tokenizer, a list of {question, answer, ...} items and a reward function with TRL's signature; for a multi-turn
    task an `env`, `rl.agent.environments.Environment`, which then scores the trajectories).

    policy: the trained `Policy`; reference: the frozen reference `Policy` or None; algorithm: the part
    (`algorithms.base.Algorithm`); source: where a step's batch comes from (`Sampler`, `Ahead`, or the part's own:
    each `sample(step)`, then `score(drawn)`)."""

    def __init__(self, config: Config, model=None, tokenizer=None, train_data=None, eval_data=None, reward_fn=None,
                 console: Console | None = None, env=None):
        self.ranks = launch(config.parallel.strategy, config.to_dict(), config.parallel.timeout_s)  # None: one process
        self.rank = self.ranks.rank if self.ranks else 0
        self.config, self.console = config, console or run_console(quiet=self.rank != 0)
        part = algorithm_class(config.algorithm)
        part.check(config)
        check_parallel(config, self.ranks, part)
        # the task, the environment and the reward before the model: a typo there should not cost a model load
        self.env, self.train_data, self.eval_data, self.rewards = load_data(config, env, train_data, eval_data,
                                                                          reward_fn)
        model, self.tokenizer = load_model(config, model, tokenizer)
        check_ahead(config, part.samples, next(model.parameters()).device)
        g = config.grpo
        self.policy = Policy(model.eval(), config.sampling.temperature if part.samples else 1.0, config.engine,
                             config.train.method, micro_batch=g.micro_batch_prompts, dtype=config.model.dtype,
                             ranks=self.ranks)
        vllm = connect(config, self.tokenizer, self.ranks) if config.sampling.uses_vllm else None
        if self.env is not None:
            bind(self.env, self.tokenizer)
        if self.ranks is not None:
            for p in model.parameters():  # every rank starts from rank 0's weights, the reference copy too
                torch.distributed.broadcast(p.data, src=0)
            # rank 0 runs the self-check before sharding and tells the others (its verdict in the run folder)
            self.policy.trusted = self.check_family(Path(config.train.output_dir))
        sampler_of = lambda policy, ranks=None: Sampler(  # noqa: E731
            config, policy, self.tokenizer, self.train_data, self.rewards, self.env, vllm, ranks,
            status=lambda text: self.status(text))
        ahead = config.grpo.max_staleness if part.samples else 0
        process = start_sampler(config, self.policy, sampler_of, self.ranks) if ahead else None  # before sharding
        self.reference = None
        if part.needs_reference(config):  # frozen initial weights, copied before a checkpoint loads or sharding
            self.reference = self.policy.sibling(model, scope=model.disable_adapter) if config.model.lora_r else \
                self.policy.sibling(copy.deepcopy(model).requires_grad_(False))
        self.algorithm = part(config, self.policy, self.reference)
        if self.ranks is not None:  # after the copies: fully_shard changes the model in place
            self.distribute()
        for p in trained(self.algorithm):
            p.make_optimizer(g, config.train.steps * self.algorithm.num_updates)
        self.algorithm.status = lambda text: self.status(text)
        self.source = self.algorithm.batches(self.tokenizer) if not part.samples else \
            sampler_of(self.policy, self.ranks) if not ahead else \
            Ahead(process, sampler_of(self.policy, self.ranks), self.policy, ahead, config.train.steps, self.ranks,
                  status=lambda text: self.status(text))
        self.step, self.num_tokens = 0, 0
        self.skips = Skips(config.train.max_failed_steps)  # the steps skipped (a reward or the environments failed)
        self.completion_rows: list[dict] = []  # the last step's, for RUN_DIR/completions.jsonl (log_completions)
        self.status = lambda text: None  # the progress bar's current phase; set by the run loop
        self.during = "the start"  # what the run is doing: a step, or the checkpoint of a step
        self.score = score_name(config, self.env)  # what the held-out score is: "accuracy" or "mean reward"

    @property
    def model(self):
        return self.policy.model

    def distribute(self) -> None:
        """The trained policies data-parallel with parallel.strategy (auto: FSDP2; LoRA: DDP, its adapters
        replicated) and FSDP2's mode (decided once, from the smallest rank's memory)."""
        p = self.config.parallel
        strategy = p.strategy if p.strategy != "auto" else "ddp" if self.config.model.lora_r else "fsdp2"
        mode = fsdp_mode(self.model, p.fsdp_mode) if strategy == "fsdp2" else None
        self.policy.distribute(strategy, mode, broadcast=False)  # broadcast in __init__
        if self.algorithm.critic is not None:
            self.algorithm.critic.distribute(strategy, mode)

    def train_step(self, step: int) -> dict | None:
        """Step `step` (>= 1): `step.train_step`, its phases in one function."""
        return train_step(self, step)

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
            found = latest_checkpoint(run_dir, verify=True)
            why = incomplete_latest(run_dir, found, verify=True)
            if found is None:
                raise FileNotFoundError(f"--resume {run_dir}: no complete checkpoint in {run_dir / 'checkpoints'}"
                                        + (f" ({why})" if why else ""))
            if why:  # said, not silently: the steps since the complete one train again
                warnings.warn(f"--resume {run_dir}: the latest checkpoint is incomplete or damaged ({why}); resuming "
                              f"from {found.name}", RuntimeWarning, stacklevel=2)
            saved = saved_config(run_dir).to_dict() if latest_config(run_dir).is_file() else None
            if saved is not None:  # what a resume may change (config/resume.py)
                check_resume(saved, resolved(self.config).to_dict(), run_dir)
            self.step, extra = load_checkpoint(found, self.model, self.policy.optimizer, self.policy.scheduler,
                                               critic=self.critic_state(), verify=False)  # verified when found
            for p in trained(self.algorithm):  # a longer run: the schedule over the new train.steps, from the step
                p.continue_schedule()
            self.num_tokens = extra.get("num_tokens", 0)
            self.console.print(f"resumed {run_dir} from {found.name}")
        cfg.output_dir = str(run_dir)
        if self.rank == 0:  # rank 0 alone writes the run folder
            changed = save_run_config(run_dir, resolved(self.config), saved if resume is not None else None,
                                      self.step + 1)
            if changed:
                self.console.print(f"from step {self.step + 1}: {', '.join(changed)} changed (config-resumed-at-step-"
                                   f"{self.step + 1}.yaml; {FIRST} and the others keep what the earlier steps used)")
        if self.ranks is None:  # data-parallel runs checked before sharding (__init__)
            self.policy.trusted = self.check_family(run_dir)
        if isinstance(self.source, Ahead):
            self.console.print(self.source.describe())
        for p in (self.reference, self.algorithm.critic):  # they run the policy's family
            if p is not None:
                p.trusted = self.policy.trusted
        log = MetricsLog(run_dir, truncate_after=self.step, console=self.console, report_to=cfg.report_to,
                         config=resolved(self.config).to_dict()) if self.rank == 0 else NoLog()
        stop: list[str] = []
        aborted = lambda: str(TrainingAborted(run_dir, self.during, latest_checkpoint(run_dir)))  # noqa: E731
        try:
            with stop_on_signals(stop, self.console, aborted):
                self._loop(run_dir, log, stop)
        except KeyboardInterrupt:  # the second signal (stops.py)
            raise TrainingAborted(run_dir, self.during, latest_checkpoint(run_dir)) from None
        except Exception as e:
            if self.ranks is not None and not isinstance(e, TrainingFailed):  # the others name it if its own
                self.ranks.doing(f"{FAILED}{self.during}: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
            if isinstance(e, RuntimeError):
                raise_if_a_rank_died(self.ranks, self.during, run_dir, e)
            raise
        finally:
            log.close()
            if isinstance(self.source, Ahead):
                self.source.close()
        if self.stopping(stop):
            raise TrainingInterrupted(run_dir, self.step)
        if self.rank == 0:
            summarize(self.console, run_dir, log.records, reward_name=self.reward_name())
        return run_dir

    def _loop(self, run_dir: Path, log, stop: list) -> None:
        """Steps until train.steps or a stop signal; evaluates and saves on schedule, and always saves at the end."""
        cfg = self.config.train
        bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
                       TimeRemainingColumn(), console=self.console, disable=not self.console.is_terminal)
        task = bar.add_task("train", total=cfg.steps, completed=self.step, info="")

        def status(text: str) -> None:  # shown, and written for the other ranks (parallel.Heartbeat)
            bar.update(task, info=text)
            if self.ranks is not None:
                self.ranks.doing(text)

        self.status = status
        with bar:
            first_eval = self.step == 0 and not log.records and cfg.eval_steps >= 0
            if self.ranks is not None:  # rank 0 holds the metrics log: its decision is everyone's
                first_eval = self.ranks.gather(first_eval)[0]
            if first_eval:
                log.write({"step": 0, **self.held_out(0)})
                bar.console.print(step_line(log.records[-1], cfg.steps, self.score))
            first, self.skips.in_a_row = self.step, 0  # the step this run started after; none skipped yet
            while self.step < cfg.steps and not self.stopping(stop):
                self.during = f"step {self.step + 1}"  # what a rank's death interrupted
                try:
                    record = self.train_step(self.step + 1)
                except (VLLMError, SamplerFailed) as e:  # raised before the step's update: the state is the last's
                    self.save(run_dir)
                    why = f"the vLLM sampler failed ({e})" if isinstance(e, VLLMError) else str(e)
                    raise TrainingFailed(run_dir, f"step {self.step + 1}: {why}") from e
                self.skips.count(trained=record is not None)
                if self.skips.too_many:
                    failed = self.skips.in_a_row
                    self.step -= failed - 1  # the last good step: no update happened since, so its state is this
                    self.save(run_dir)
                    raise TrainingFailed(run_dir, f"steps {self.step + 1}-{self.step + failed} failed "
                                         f"({self.skips.reason()}); stopped after train.max_failed_steps="
                                         f"{cfg.max_failed_steps}")
                record = record or self.skips.record(self.step + 1)
                self.step += 1
                if self.completion_rows:
                    log.write_completions(self.step, self.completion_rows)
                    self.completion_rows = []
                last = self.step == cfg.steps
                if cfg.eval_steps >= 0 and (last or (cfg.eval_steps and self.step % cfg.eval_steps == 0)):
                    record.update(self.held_out(self.step))
                log.write(record)
                bar.console.print(step_line(record, cfg.steps, self.score))
                bar.update(task, completed=self.step, info=progress_info(record))
                if cfg.save_steps and self.step % cfg.save_steps == 0:
                    self.save(run_dir)
        if self.skips.all_of(self.step - first):  # it trained nothing: not a success
            self.step = first
            self.save(run_dir)
            raise TrainingFailed(run_dir, f"every step of this run was skipped ({self.skips.reason()})")
        found = latest_checkpoint(run_dir)
        if found is None or found.name != f"step-{self.step:06d}":
            self.save(run_dir)

    def stopping(self, stop: list) -> bool:
        """Whether to stop before the next step: a signal on any rank stops every rank at the same step."""
        return self.ranks.any(bool(stop)) if self.ranks else bool(stop)

    def check_family(self, run_dir: Path) -> bool:
        """The run's check of an unregistered family (`family.check_family`): True (the engine runs it trusted,
        checked here) or False (a registered family)."""
        return check_family(self.model, self.config.train.unknown_family, run_dir, self.ranks, self.console.print)

    def save(self, run_dir: Path) -> Path:
        """The checkpoint of the current step, written atomically by every rank together (`save_checkpoint`).
        Raises TrainingFailed on every rank when it cannot be written (a full disk, a read-only folder): the run
        ends there, with the earlier checkpoint intact."""
        self.during = f"the checkpoint of step {self.step}"
        try:
            saved = save_checkpoint(run_dir, self.step, self.model, self.policy.optimizer, self.policy.scheduler,
                                    keep=self.config.train.keep_checkpoints, extra={"num_tokens": self.num_tokens},
                                    tokenizer=self.tokenizer, critic=self.critic_state())
            self.during = f"the end of step {self.step}"  # the checkpoint is written: what follows is not in it
            return saved
        except OSError as e:
            raise_if_a_rank_died(self.ranks, self.during, run_dir, e)  # another rank died while they wrote it
            kept = latest_checkpoint(run_dir)
            raise TrainingFailed(run_dir, f"the checkpoint of step {self.step} could not be written in "
                                 f"{run_dir / 'checkpoints'} ({e}); "
                                 + (f"{kept.name} is intact" if kept else "there is no earlier checkpoint")) from e

    def critic_state(self) -> tuple | None:
        """(critic, its optimizer, its scheduler) for the checkpoint, or None without a critic."""
        critic = self.algorithm.critic
        return None if critic is None else (critic.model, critic.optimizer, critic.scheduler)

    def reward_name(self) -> str:
        """What the run's reward is, for the plot: the environment, DPO's preferences, or the reward functions."""
        if self.env is not None:
            return self.config.agent.environment or type(self.env).__name__
        return " + ".join(self.rewards.names) if self.algorithm.samples else "preferences"

    def held_out(self, step: int) -> dict:
        """`evaluate`, or, when a reward function fails on the held-out answers, {"eval/error": why} with a
        warning: the rule of the training steps (a failing reward skips what it scores, the run goes on)."""
        try:
            return self.evaluate()
        except RewardFunctionError as e:
            warnings.warn(f"held-out evaluation at step {step} skipped: {e}", RuntimeWarning, stacklevel=2)
            return {"eval/error": str(e)}

    def evaluate(self) -> dict:
        """The held-out score; data-parallel, each rank decodes its share of the split with the full parameters."""
        progress = held_out_progress(self.console, self.status)
        with self.policy.gathered(), self.policy.autocast():
            return evaluate(self.model, self.tokenizer, self.config, self.eval_data, self.rewards, progress=progress,
                            ranks=self.ranks, env=self.env)


def load_data(config: Config, env, train_data, eval_data, reward_fn) -> tuple:
    """(environment or None, train items, held-out items, `RewardFunctions` or None) of `config`, each from the
    arguments when given (tests inject them): a multi-turn environment and its items, else the task's splits and
    reward functions (an environment scores its own trajectories: no reward functions)."""
    if env is None and config.agent.environment is not None:
        env, env_train, env_eval = load_agent_task(config)
        train_data = env_train if train_data is None else train_data
        eval_data = env_eval if eval_data is None else eval_data
    if train_data is None:
        train_data, eval_data = load_task(config.task, hold_out=config.train.eval_steps >= 0)
    if reward_fn is not None:  # an injected function (tests), alone, as a user's own
        return env, train_data, eval_data, RewardFunctions([with_timeout(reward_fn, config.task.reward_timeout_s)],
                                                           [1.0])
    return env, train_data, eval_data, None if env is not None else make_rewards(config.task, train_data)


def load_model(config: Config, model=None, tokenizer=None) -> tuple:
    """(model, tokenizer) of config.model unless given, LoRA adapters applied (model.lora_r). Raises ValueError for
    float16 training and for a bfloat16 run handed a model whose parameters are not float32."""
    m = config.model
    if m.dtype == "float16":
        raise ValueError("model.dtype=float16 cannot train: float16 mixed precision needs loss scaling, which "
                         "branchreplay does not do; use bfloat16 (same speed, float32's exponent range)")
    if model is None:
        model, tokenizer = load_policy(m.spec, m.dtype, m.device)
    if m.dtype == "bfloat16" and next(model.parameters()).dtype != torch.float32:
        raise ValueError(f"model.dtype=bfloat16 trains float32 master weights under autocast; the given model's "
                         f"parameters are {next(model.parameters()).dtype}: pass it in float32")
    if m.lora_r:  # before anything copies the model: the adapters are its only trainable parameters
        model = apply_lora(model, m.lora_r, m.lora_alpha, m.lora_targets(), seed=config.train.seed)
    return model, tokenizer


def check_parallel(config: Config, ranks: Ranks | None, part: type[Algorithm]) -> None:
    """What a data-parallel run refuses, by name: a reference train.method (its padded or naive computation runs
    whole trees in one process), LoRA with FSDP2 (its adapters are replicated: parallel.strategy ddp), and fewer
    rollouts a step than ranks."""
    if ranks is None:
        return
    if config.train.method != "branchreplay":
        raise ValueError(f"train.method={config.train.method} runs in one process: start it without torchrun")
    if config.model.lora_r and config.parallel.strategy == "fsdp2":
        raise ValueError("model.lora_r (LoRA) runs data-parallel with its adapters replicated: set "
                         "parallel.strategy ddp (or auto)")
    rollouts = config.grpo.prompts_per_step * config.grpo.num_generations if part.samples else \
        2 * config.dpo.pairs_per_step
    if rollouts < ranks.world_size:
        raise ValueError(f"a step has {rollouts} rollouts for {ranks.world_size} ranks: raise them or start fewer "
                         "processes")


def train(config: Config, resume: str | None = None) -> Path:
    """Build the model, task and trainer from `config` and train; returns the run folder. Under torchrun every rank
    calls it (rl/run/parallel.py); the process group is closed after a run that succeeded (`distributed.shutdown`)."""
    try:
        run_dir = Trainer(config).fit(resume)
    except RankDied:
        raise  # the process group is broken: no barrier (cli.py exits at once)
    except (TrainingInterrupted, TrainingFailed):
        shutdown()  # every rank stopped at the same step, after the checkpoint
        raise
    shutdown()
    return run_dir
