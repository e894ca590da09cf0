"""The training loop of every algorithm (config `algorithm`: grpo, ppo, rloo, reinforce_pp), with the losses and
their gradients computed over prefix trees (one tree per prompt group).

One step (TRL GRPOTrainer, `_generate_and_score_completions` and `_compute_loss`):
  1. take `prompts_per_step` prompts of the train split: epochs of a permutation seeded by (train.seed, epoch), so
     step s always gets the same prompts, resumed or not;
  2. chat-template each prompt and sample G completions with the prompt prefilled once, every group of the step in
     one decoding loop (`sampling.sample_groups`), each group k drawing from its own torch.Generator seeded by
     (train.seed, s, k), so that its samples do not depend on the other groups or on the world size (since issue 11;
     earlier versions drew every group of a step from one generator seeded by (train.seed, s));
  3. decode the completions, score them (`rewards.compute_rewards`), and turn the rewards into group-relative
     advantages (`advantages.group_advantages`);
  4. rollouts = prompt ids + sampled ids (never re-tokenized), loss mask 1 on the completion; per-token weights by
     `losses.token_weights(loss_type)` over the WHOLE step, so micro-batching does not change the gradient;
  5. num_iterations > 1: old logprobs of the sampling policy by `replay_logprobs` before the first update (with 1,
     the ratio is against the detached current logprobs, as TRL); beta > 0: reference logprobs of the frozen
     initial model;
  6. per update: `replay_backward` over micro-batches of trees, clip the gradient norm, AdamW, LR schedule.
  (Steps 5 and 6 run the engine, or with engine.method naive / padded a reference computation: `methods.py`.)
Other algorithms (`algorithms.py`): after the old-policy and reference passes (and PPO's critic pass, whose values
come from the same trees) their estimators set per-token advantages; RLOO's updates run its sequence-level loss in
two passes (`engine.sequence`), PPO's the clipped policy loss on the policy and `ValueLoss` on the critic, one AdamW
each with the same schedule and one gradient-norm clip over both (TRL's one optimizer over policy and critic);
ppo.num_ppo_epochs updates per step. They run in one process for now.
Multi-turn tasks (agent.environment, `agent.py`): step 2 samples each item's trajectories across turns
(`trajectories.sample_trajectories`, sampling.turn_branching), the environment's final and per-turn rewards give
one reward per trajectory, and the group of an item (any size: trajectories may end early) is its baseline; step 4's
rollouts are the trajectories' ids with the loss mask on the assistant tokens only. An item whose environment fails
(reset, step or final reward raising) is skipped with a warning.
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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import (get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                          get_linear_schedule_with_warmup)

from ..check.self_check import ensure_supported
from ..engine import EngineConfig, UnsupportedModelError
from ..engine.context_parallel import ContextParallelTree
from ..engine.distributed import DataParallel, fsdp_mode, shutdown
from ..engine.lockstep import collective_device
from ..engine.sequence import replay_function_backward, replay_sequence_backward, sequence_sums
from ..engine.sharding import shard
from ..losses import (GRPOLoss, LossStats, ValueLoss, dpo_loss, dpo_metrics, gspo_loss, rloo_clip_metrics, rloo_loss,
                      token_weights)
from ..models import apply_lora, autocast, load_policy, model_folder
from ..tree import ReplayResult, Rollout, RolloutTree
from ..value import ValueModel, check_critic
from . import agent, algorithms
from .advantages import group_advantages, group_std
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, write_atomic
from .config import Config
from .evaluation import evaluate
from .log import MetricsLog, peak_memory_bytes, progress_info, step_line, summarize
from .parallel import Ranks, launch
from .preferences import load_preferences, pair_trees
from .rewards import RewardFunctionError, RewardFunctions, make_rewards, score_columns
from .methods import tree_backward, tree_logprobs
from .sampling import Sample, eos_token_ids, sample_groups
from .tasks import load_task, prompt_token_ids
from .trajectories import ItemError, sample_trajectories
from .vllm_client import VLLMClient, VLLMError

SELF_CHECK = "self_check.json"  # the run folder's verdicts on unregistered families (check/self_check.py)


class TrainingInterrupted(RuntimeError):
    """SIGINT/SIGTERM stopped training after a checkpoint was written; `run_dir` is the folder to resume."""

    def __init__(self, run_dir: Path, step: int):
        super().__init__(f"training stopped after step {step}; checkpoint saved. Resume with: "
                         f"branchreplay train --resume {run_dir}")
        self.run_dir, self.step = run_dir, step


class TrainingFailed(RuntimeError):
    """The run stopped: train.max_failed_steps consecutive steps were skipped (the reward, or every item's
    environment, failed), or the vLLM server stopped answering; the last good step was checkpointed in `run_dir`,
    so the run resumes from it once the cause is fixed. `why` says what happened."""

    def __init__(self, run_dir: Path, why: str):
        super().__init__(f"{why}. Fix it, then resume from the last good step: branchreplay train --resume {run_dir}")
        self.run_dir = run_dir


class RankDied(TrainingFailed):
    """Another rank of a data-parallel run died (killed, out of memory): this rank's collective failed, and the
    heartbeats (`parallel.Heartbeat`) name the dead rank. The last checkpoint in `run_dir` is complete (written
    atomically), so the run resumes from it."""


@dataclass
class Batch:
    """One step's samples. Groups in prompt (item) order; flat [B] tensors and lists are group-major.

    rollouts: per group, its `Rollout`s with advantages and weights (G of them; a multi-turn group may have fewer).
    rewards, advantages: [B] float32. reward_std: [B] std of each sample's group (of the batch with
    scale_rewards="batch"), as TRL logs it. lengths: [B] trained (completion or assistant) tokens per rollout;
    truncated: [B] whether its last reply hit sampling.max_new_tokens without EOS.
    Single-turn: prompt_ids (per group, the chat-templated prompt) and samples (per group, G `Sample`s). Multi-turn:
    trajectories (per group, its `Trajectory`s) and metrics (`agent.trajectory_metrics`, the environment's seconds).
    """

    rollouts: list[list[Rollout]]
    rewards: torch.Tensor
    advantages: torch.Tensor
    reward_std: torch.Tensor
    lengths: list[int]
    truncated: list[bool]
    prompt_ids: list[list[int]] = field(default_factory=list)
    samples: list[list[Sample]] = field(default_factory=list)
    trajectories: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    items: list[dict] = field(default_factory=list)  # per group, its dataset item
    sampler_logprobs: list[torch.Tensor] | None = None  # sampling.backend=vllm: per rollout [T], the server's

    def completions(self, tokenizer, advantages: bool = True) -> list[dict]:
        """One row per rollout for the completions log: the item's prompt and the decoded completion (multi-turn:
        the conversation's messages, turns, how it ended), its reward, and its group advantage unless `advantages`
        is False (the other algorithms set theirs after the old-policy and critic passes, per token)."""
        rows = []
        flat = [(item, s) for item, group in zip(self.items, self.samples or self.trajectories) for s in group]
        for (item, s), reward, advantage in zip(flat, self.rewards.tolist(), self.advantages.tolist()):
            if self.trajectories:
                row = {"messages": s.conversation.messages, "turns": s.turns, "ended_by": s.ended_by}
            else:
                row = {"prompt": item["question"],
                       "completion": tokenizer.decode(s.completion_ids, skip_special_tokens=True)}
            rows.append({**row, "reward": reward, **({"advantage": advantage} if advantages else {})})
        return rows


class Trainer:
    """GRPO over prefix trees. Everything is built from `config` unless injected (tests inject a tiny model, a
    character tokenizer, a list of {question, answer, ...} items and a reward function with TRL's signature; for a
    multi-turn task an `env`, `rl.environments.Environment`, which then scores the trajectories)."""

    def __init__(self, config: Config, model=None, tokenizer=None, train_data=None, eval_data=None, reward_fn=None,
                 console: Console | None = None, env=None):
        self.ranks: Ranks | None = launch(config.parallel.strategy, config.to_dict(),  # None: one process
                                          config.parallel.timeout_s)
        self.rank = self.ranks.rank if self.ranks else 0
        self.config, self.console = config, console or Console(quiet=self.rank != 0)
        self.env = env
        if env is None and config.agent.environment is not None:  # before the model: a typo should not cost a load
            self.env, env_train, env_eval = agent.load_agent_task(config)
            train_data = env_train if train_data is None else train_data
            eval_data = env_eval if eval_data is None else eval_data
        if train_data is None:  # the task and its reward first: a typo there should not cost a model load
            train_data, eval_data = load_task(config.task)
        if reward_fn is not None:  # an injected function (tests), alone
            self.rewards = RewardFunctions([reward_fn], [1.0])
        else:  # the environment scores multi-turn trajectories
            self.rewards = None if self.env is not None else make_rewards(config.task, train_data)
        m = config.model
        if m.dtype == "float16":
            raise ValueError("model.dtype=float16 cannot train: float16 mixed precision needs loss scaling, which "
                             "branchreplay does not do; use bfloat16 (same speed, float32's exponent range)")
        if model is None:
            model, tokenizer = load_policy(m.spec, m.dtype, m.device)
        if m.dtype == "bfloat16" and next(model.parameters()).dtype != torch.float32:
            raise ValueError(f"model.dtype=bfloat16 trains float32 master weights under autocast; the given model's "
                             f"parameters are {next(model.parameters()).dtype}: pass it in float32")
        if m.lora_r and (self.ranks is not None or config.algorithm == "ppo"):
            raise ValueError("model.lora_r (LoRA) runs in one process and without PPO's critic for now: start it "
                             "without torchrun, with algorithm grpo, rloo, reinforce_pp or dpo")
        if m.lora_r:  # before anything copies the model: the adapters are its only trainable parameters
            model = apply_lora(model, m.lora_r, m.lora_alpha, m.lora_targets(), seed=config.train.seed)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.autocast = lambda: autocast(m.dtype, model.device.type)  # bfloat16: mixed precision (models.autocast)
        self.train_data, self.eval_data = train_data, eval_data
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.vllm, self.vllm_stale = None, True  # the vLLM sampler, and whether it lacks the current weights
        if config.sampling.backend == "vllm":
            if self.ranks is not None:
                raise ValueError("sampling.backend=vllm runs in one process for now: start it without torchrun")
            self.vllm = VLLMClient.connect(config.sampling.vllm_url, model_folder(m.spec), tokenizer,
                                           config.sampling.vllm_timeout_s)
        if self.env is not None:
            agent.bind(self.env, tokenizer)
        self.force = False  # an unregistered family that passed its self-check runs forced (check/self_check.py)
        if self.ranks is not None and config.algorithm != "grpo":
            raise ValueError(f"algorithm={config.algorithm} runs in one process for now (data parallelism covers "
                             "grpo): start it without torchrun, or with parallel.strategy left at auto")
        if self.ranks is not None and self.env is not None:
            raise ValueError("agent.environment (multi-turn) runs in one process for now: start it without torchrun")
        if self.ranks is not None and config.engine.method != "branchreplay":
            raise ValueError(f"engine.method={config.engine.method} runs in one process: start it without torchrun")
        if self.ranks is not None and config.grpo.importance_sampling_level == "sequence":
            raise ValueError("grpo.importance_sampling_level=sequence (GSPO) runs in one process for now: start it "
                             "without torchrun")
        if self.ranks is not None:
            rollouts = config.grpo.prompts_per_step * config.grpo.num_generations
            if rollouts < self.ranks.world_size:
                raise ValueError(f"a step has {rollouts} rollouts (grpo.prompts_per_step x grpo.num_generations) for "
                                 f"{self.ranks.world_size} ranks: raise them or start fewer processes")
            for p in model.parameters():  # every rank starts from rank 0's weights, the reference copy too
                torch.distributed.broadcast(p.data, src=0)
            # rank 0 runs the self-check before sharding and tells the others (its verdict in the run folder)
            self.force = self.check_family(Path(config.train.output_dir))
        self.pairs, self.ref_sums = [], {}  # DPO: the preference pairs; their reference sums, by row, when precomputed
        if config.algorithm == "dpo":
            self.pairs, _ = load_preferences(config.dpo.dataset, tokenizer, config.dpo.max_length)
        self.ref_model = None
        kl_coef = {"ppo": config.ppo.kl_coef, "dpo": float(config.dpo.loss_type != "simpo")}.get(
            config.algorithm, config.grpo.beta)
        self.has_reference = kl_coef > 0
        if kl_coef > 0 and not m.lora_r:  # frozen initial weights; copied before any checkpoint is loaded, sharding
            self.ref_model = copy.deepcopy(model).requires_grad_(False)
        self.critic = None
        if config.algorithm == "ppo":  # a separate value model initialised from the policy, as TRL's (value.py)
            base = model if config.ppo.value_model is None else load_policy(config.ppo.value_model, m.dtype,
                                                                            m.device)[0]
            self.critic = ValueModel.from_policy(base, seed=config.train.seed).eval()
            check_critic(self.critic, model)
        self.dp = None
        if self.ranks is not None:  # after the reference copy: fully_shard changes the model in place
            strategy = "fsdp2" if config.parallel.strategy == "auto" else config.parallel.strategy
            self.dp = DataParallel(model, strategy, device=model.device.type, broadcast=False,  # broadcast above
                                   mode=fsdp_mode(model, config.parallel.fsdp_mode))
        g = config.grpo
        self.num_updates = {"ppo": config.ppo.num_ppo_epochs, "dpo": 1}.get(config.algorithm, g.num_iterations)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # foreach=False: the FSDP2 layers' DTensors and the replicated plain tensors cannot share one foreach kernel
        self.optimizer, self.scheduler = self.optimizer_for(self.params, foreach=self.dp is None)
        self.critic_params, self.critic_optimizer, self.critic_scheduler = [], None, None
        if self.critic is not None:  # its own AdamW and schedule, the same as the policy's: one AdamW over both
            self.critic_params = [p for p in self.critic.parameters() if p.requires_grad]
            self.critic_optimizer, self.critic_scheduler = self.optimizer_for(self.critic_params)
        self.step, self.num_tokens = 0, 0
        self.failure: str | None = None  # why the last step was skipped (the warning's text)
        self.completion_rows: list[dict] = []  # the last step's, for RUN_DIR/completions.jsonl (log_completions)
        self.status = lambda text: None  # the progress bar's current phase; set by the run loop

    def optimizer_for(self, params: list, foreach: bool = True):
        """AdamW over `params` and its LR schedule (grpo section), stepped once per update."""
        g = self.config.grpo
        optimizer = torch.optim.AdamW(params, lr=g.learning_rate, weight_decay=g.weight_decay,
                                      **({} if foreach else {"foreach": False}))
        schedule = {"cosine": get_cosine_schedule_with_warmup, "linear": get_linear_schedule_with_warmup,
                    "constant": get_constant_schedule_with_warmup}
        extra = {"num_training_steps": self.config.train.steps * self.num_updates} if g.lr_scheduler != "constant" \
            else {}
        return optimizer, schedule[g.lr_scheduler](optimizer, num_warmup_steps=g.warmup_steps, **extra)

    # -- one step ---------------------------------------------------------------------------------------------------

    def generate(self, step: int) -> Batch:
        """Sample, score and build the rollouts of `step` (>= 1). Raises RewardFunctionError from the reward."""
        cfg, G = self.config, self.config.grpo.num_generations
        items = [self.train_data[i] for i in prompt_indices(len(self.train_data), cfg.grpo.prompts_per_step,
                                                            cfg.train.seed, step)]
        if self.env is not None:
            return self.generate_trajectories(step, items)
        prompt_ids = [prompt_token_ids(self.tokenizer, item, cfg.task) for item in items]
        mine = self.ranks.mine(len(items)) if self.ranks else list(range(len(items)))
        samples, rewards, error, failure = {}, {}, None, None
        sync_s = None
        if self.vllm is not None:  # every group in flight together: the server batches them (one process)
            sync_s = self.sync_vllm()
            self.status(f"step {step}: sampling {len(prompt_ids)} groups with vLLM")
            samples = dict(enumerate(self.vllm_groups(prompt_ids)))
        else:
            with self.gathered(), self.autocast():
                try:  # one decoding loop over this rank's groups, each drawing from its own generator: a
                    # group's samples do not depend on the other groups or the world size
                    self.status(f"step {step}: sampling {len(mine)} groups")
                    drawn = sample_groups(self.model, [prompt_ids[k] for k in mine], G, cfg.sampling, self.eos_ids,
                                          [self.group_generator(step, k) for k in mine])
                    samples = dict(zip(mine, drawn))
                except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
                    if self.ranks is None:
                        raise
                    failure = f"rank {self.rank}: {type(e).__name__}: {e}"
        try:
            if mine:
                total, columns = score_columns(self.rewards, self.tokenizer, [items[k] for k in mine],
                                               [samples[k] for k in mine], cfg.task)
                rewards = dict(zip(mine, zip(total.split(G), columns.split(G))))
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
        columns = torch.cat([rewards[k][1] for k in range(len(items))])
        rewards = torch.cat([rewards[k][0] for k in range(len(items))])
        sequences = [[(ids + s.completion_ids, [0.0] * len(ids) + [1.0] * len(s.completion_ids), s.truncated)
                      for s in group] for ids, group in zip(prompt_ids, samples)]
        rollouts, advantages, std = self.group_rollouts(sequences, rewards, cfg.sampling.max_new_tokens)
        flat = [s for group in samples for s in group]
        per_function = {}  # TRL's rewards/<name>/mean and std, over the samples the function scored
        for name, column in zip(self.rewards.names, columns.unbind(1)):
            scored = column[~column.isnan()]
            per_function[f"rewards/{name}/mean"] = scored.mean().item() if scored.numel() else float("nan")
            per_function[f"rewards/{name}/std"] = scored.std().item() if scored.numel() > 1 else 0.0
        sampler = None
        if self.vllm is not None:  # the server's logprobs of each rollout's positions (0 on the prompt)
            sampler = [torch.tensor([0.0] * len(ids) + s.logprobs, dtype=torch.float64)
                       for ids, group in zip(prompt_ids, samples) for s in group]
            per_function["time/weight_sync_s"] = sync_s
        return Batch(rollouts, rewards, advantages, std, [len(s.completion_ids) for s in flat],
                     [s.truncated for s in flat], prompt_ids=prompt_ids, samples=samples, metrics=per_function,
                     items=items, sampler_logprobs=sampler)

    def sync_vllm(self) -> float:
        """Send the policy's weights to the vLLM server when it lacks them (at the start, after each update);
        returns the seconds it took (0 when nothing was sent). Raises VLLMError."""
        if not self.vllm_stale:
            return 0.0
        self.status("syncing the weights to vLLM")
        seconds = self.vllm.sync_weights(self.model.state_dict())
        self.vllm_stale = False
        return seconds

    def vllm_groups(self, prompt_ids: list[list[int]]) -> list[list[Sample]]:
        """Every group of the step sampled by the vLLM server (G completions of each prompt). Raises VLLMError."""
        s = self.config.sampling
        groups = self.vllm.sample(prompt_ids, self.config.grpo.num_generations, s.temperature, s.top_p, s.top_k,
                                  s.max_new_tokens, self.eos_ids)
        return [[Sample(ids, logprobs, truncated) for ids, logprobs, truncated in group] for group in groups]

    def group_generator(self, step: int, k: int) -> torch.Generator:
        """The sampling generator of group (item) k of `step`, seeded by (train.seed, step, k): a group's samples do
        not depend on the other groups, the world size or a resume."""
        return torch.Generator(self.model.device).manual_seed(_mix(_mix(self.config.train.seed, step), k))

    def generate_trajectories(self, step: int, items: list[dict]) -> Batch:
        """A multi-turn step: each item's trajectories (`trajectories.sample_trajectories`, item k's generator seeded
        by (train.seed, step, k)), one reward each (`agent.trajectory_reward`), group advantages per item. Items whose
        environment fails (ItemError) are skipped with a warning; raises ItemError when every item was."""
        cfg, a = self.config, self.config.agent
        groups, kept, timings = [], [], {"env_s": 0.0}
        branching, limit = agent.turn_branching(cfg), agent.context_limit(a, self.model)
        with self.autocast():
            for k, item in enumerate(items):
                self.status(f"step {step}: sampling item {k + 1}/{len(items)}")
                generator = self.group_generator(step, k)
                try:
                    groups.append(sample_trajectories(self.model, self.tokenizer, self.env, item, branching,
                                                      cfg.sampling, self.eos_ids, generator, a.max_turns, limit,
                                                      a.max_tool_output_tokens, timings))
                    kept.append(item)
                except ItemError as e:
                    warnings.warn(f"step {step}: item {k} skipped: {e}", RuntimeWarning, stacklevel=2)
        if not groups:
            raise ItemError(f"step {step}: every item was skipped (see the warnings above)")
        flat = [t for g in groups for t in g]
        rewards = torch.tensor([agent.trajectory_reward(t, a) for t in flat], dtype=torch.float32)
        sequences = [[(t.conversation.ids, t.conversation.loss_mask, t.truncated) for t in g] for g in groups]
        rollouts, advantages, std = self.group_rollouts(sequences, rewards, a.max_turns * cfg.sampling.max_new_tokens)
        return Batch(rollouts, rewards, advantages, std, [int(sum(t.conversation.loss_mask)) for t in flat],
                     [t.truncated for t in flat], trajectories=groups, items=kept,
                     metrics={**agent.trajectory_metrics(groups), "time/sample_env_s": timings["env_s"]})

    def group_rollouts(self, sequences: list[list[tuple]], rewards: torch.Tensor, max_completion_length: int
                       ) -> tuple[list[list[Rollout]], torch.Tensor, torch.Tensor]:
        """Per group, its Rollouts from (token ids, loss mask, truncated) in group-major order matching `rewards`
        [B]: group advantages (grpo.scale_rewards), the reward std TRL logs, loss weights over the WHOLE step
        (`losses.token_weights`; truncated sequences masked out with grpo.mask_truncated_completions). Returns
        (rollouts per group, advantages [B], reward_std [B])."""
        g = self.config.grpo
        groups = [gi for gi, group in enumerate(sequences) for _ in group]
        advantages = group_advantages(rewards, groups, g.scale_rewards)
        std = group_std(rewards, groups) if g.scale_rewards != "batch" else rewards.std().expand_as(rewards)
        flat = [(ids, [m * float(not (g.mask_truncated_completions and cut)) for m in mask], gi)
                for gi, group in enumerate(sequences) for ids, mask, cut in group]
        weights = token_weights([mask for _, mask, _ in flat], g.loss_type,
                                max_completion_length=max_completion_length)
        rollouts = [[] for _ in sequences]
        for (ids, mask, gi), w, adv in zip(flat, weights, advantages.tolist()):
            rollouts[gi].append(Rollout(ids, mask, advantages=adv, weights=w, group=gi))
        return rollouts, advantages, std

    def update(self, batch: Batch) -> dict:
        """The step's optimizer updates on `batch` (grpo.num_iterations, or ppo.num_ppo_epochs); returns the loss
        metrics (averaged over the updates). The algorithm decides the advantages (GRPO's were set while sampling,
        the others' need the old-policy, reference and critic passes first: `algorithms`) and the loss."""
        cfg, temperature, engine = self.config, self.config.sampling.temperature, self.config.engine
        g, algorithm = cfg.grpo, cfg.algorithm
        trees = [RolloutTree(group) for group in batch.rollouts]
        quantile = g.top_entropy_quantile < 1 and algorithm in ("grpo", "reinforce_pp")
        # every group counts in the entropy quantile (TRL's), so none is skipped under it
        trained = trees if algorithm != "grpo" or quantile else [t for t in trees if _trains(t, g.beta, g.entropy_coef)]
        plan = None
        if self.ranks is not None and trained:
            plan = shard(trained, self.ranks.world_size, self.model.config, allow_empty=True,
                         layout=cfg.parallel.layout)
        local = plan.parts[self.rank] if plan else trained  # this rank's trees (engine/sharding.py)
        t0 = time.perf_counter()
        entropy = old = None  # the current policy's entropies (and the old pass), when a pass before the update ran
        vllm = batch.sampler_logprobs is not None  # the old policy's logprobs are ours, the sampler's are compared
        cap = cfg.sampling.vllm_importance_sampling_cap  # truncated importance sampling needs them before the loss
        lockstep = self.lockstep  # every rank joins every pass, with or without trees
        if (local or lockstep) and (self.num_updates > 1 or algorithm != "grpo" or cap is not None):  # before updates
            old = self.policy_logprobs(local)
            for r, lp in zip(_rollouts(local), old.logprobs):
                r.old_logprobs = lp
            entropy = old.entropy
        if local and self.has_reference:  # the reference model is a full copy on every rank
            with self.autocast(), self.reference() as reference:
                ref = tree_logprobs(reference, local, temperature=temperature, engine=engine,
                                      force=self.force).logprobs
            for r, lp in zip(_rollouts(local), ref):
                r.ref_logprobs = lp
        mismatch = sampler_mismatch(batch, _rollouts(local), old.logprobs, cap) if vllm and old is not None else {}
        estimated = self.estimate(batch, local)
        passes_s = time.perf_counter() - t0  # the no-grad passes: old policy, reference, critic values
        if algorithm in ("rloo", "reinforce_pp") and not quantile:  # all-zero advantages, no KL or entropy: no gradient
            local = [t for t in local if _trains(t, 0.0, g.entropy_coef)]
        advantages = [r.advantages.clone() for r in _rollouts(local)] if quantile else None
        loss_fn = self.policy_loss(trees)
        value_loss = ValueLoss(cfg.ppo.cliprange_value, cfg.ppo.vf_coef) if self.critic is not None else None
        old_sums = sequence_sums([r.old_logprobs for r in _rollouts(local)], _rollouts(local)) \
            if algorithm == "rloo" and local else None
        history = []
        for k in range(self.num_updates):
            for p in self.params + self.critic_params:  # zeros, not None: AdamW moves every parameter, as TRL's
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
            loss_fn.stats = LossStats()  # the clip, KL and entropy sums of this update (losses.py)
            metrics = {}
            if quantile:  # this update's entropies: the old-policy pass's (the same weights) for the first one
                if entropy is None or k > 0:
                    entropy = self.policy_logprobs(local).entropy if local or lockstep else []
                metrics["entropy_mask/kept"] = self.keep_high_entropy(local, entropy, advantages)
            if self.dp is not None:  # every rank has the same `trained`: all of them run the collectives, or none
                result = self.accumulate_sharded(local, loss_fn) if trained else None
                grad_norm = self.dp.clip_grad_norm_(g.max_grad_norm)
            else:
                with self.autocast():
                    if algorithm == "rloo":
                        result, rloo_metrics = self.rloo_backward(local, old_sums, len(_rollouts(trees)), first=k == 0)
                        metrics.update(rloo_metrics)
                    elif g.importance_sampling_level == "sequence" and algorithm != "ppo":
                        result = self.gspo_backward(local, loss_fn, old if k == 0 and old is not None else None)
                    else:
                        result = accumulate(self.model, local, loss_fn, g.micro_batch_prompts, temperature, engine,
                                            self.force) if local else None
                    if value_loss is not None:
                        value_loss.stats = None
                        accumulate(self.critic, local, value_loss, g.micro_batch_prompts, temperature, engine,
                                   self.force)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params + self.critic_params, g.max_grad_norm).item()
            lr = self.scheduler.get_last_lr()[0]
            for optimizer, scheduler in ((self.optimizer, self.scheduler),
                                         (self.critic_optimizer, self.critic_scheduler)):
                if optimizer is not None:
                    optimizer.step()
                    scheduler.step()
            if vllm and old is None and k == 0 and result is not None:  # on-policy: the update's logprobs are old
                mismatch = sampler_mismatch(batch, _rollouts(local), result.logprobs, None)
            if algorithm == "ppo":
                metrics.update(_ppo_update_metrics(result, local, loss_fn, value_loss))
            elif algorithm != "rloo" and result is not None:
                metrics.update(loss_fn.stats.metrics())
            history.append({"loss": result.loss if result else 0.0, "grad_norm": grad_norm, "learning_rate": lr,
                            **metrics})
        out = {k: sum(h.get(k, 0.0) for h in history) / len(history) for k in history[-1]}
        out.update({**estimated, **mismatch, "time/logprob_s": passes_s})
        self.vllm_stale = True  # the weights moved
        if plan is not None:
            out.update({"dist/world_size": self.ranks.world_size, "dist/imbalance": plan.imbalance,
                        "dist/recomputed_positions": plan.recomputed_positions, "dist/layout": plan.layout,
                        "dist/bytes_moved": max(plan.bytes_moved),
                        **({"dist/fsdp_mode": self.dp.mode} if self.dp.mode else {}),
                        **{f"dist/physical_tokens/rank{r}": n for r, n in enumerate(plan.physical_tokens)}})
        if isinstance(result, ReplayResult) and engine.method == "branchreplay":  # the last update's (schedule.py)
            out.update({"engine/schedule": result.schedule, "engine/shared_nodes_merged": result.shared_nodes_merged})
        stats = sum((t.stats for t in trees[1:]), trees[0].stats)
        out.update({"tree/logical_tokens": stats.logical_tokens, "tree/physical_tokens": stats.physical_tokens,
                    "tree/token_ratio": stats.token_ratio})
        return out

    def estimate(self, batch: Batch, local: list[RolloutTree]) -> dict:
        """The advantages of rloo, reinforce_pp and ppo on the rollouts of `local` (all the step's: one process),
        after the old-policy and reference passes (`algorithms`); returns their metrics. Nothing for grpo."""
        cfg, rollouts = self.config, _rollouts(local)
        if cfg.algorithm == "grpo" or not rollouts:
            return {}
        if cfg.algorithm == "rloo":
            return algorithms.rloo(rollouts, batch.rewards, cfg.grpo.beta, cfg.rloo.normalize_advantages)
        if cfg.algorithm == "reinforce_pp":
            return algorithms.reinforce_pp(rollouts, batch.rewards, cfg.grpo.beta, cfg.reinforce_pp.gamma)
        with self.autocast():
            values = tree_logprobs(self.critic, local, temperature=1.0, engine=cfg.engine, force=self.force).values
        ended = [not cut for cut in batch.truncated]
        return algorithms.ppo(rollouts, batch.rewards, ended, values, cfg.ppo)

    def gspo_backward(self, local: list[RolloutTree], loss_fn: GRPOLoss, first: ReplayResult | None
                      ) -> ReplayResult | None:
        """One update with sequence-level importance ratios (`losses.gspo_loss`) over `local`, micro-batched, in two
        passes (`engine.sequence.replay_function_backward`); `first`: the old-policy pass of these trees, which is
        pass 1 of the first update (the same weights). Returns the merged pass-2 results, their loss the loss."""
        g, engine, temperature = self.config.grpo, self.config.engine, self.config.sampling.temperature
        if not local:
            return None
        results = []
        for part, rows in micro_batches(local, g.micro_batch_prompts):
            rollouts = _rollouts(part)
            head = None if first is None else ReplayResult(first.logprobs[rows], first.entropy[rows], 0.0, first.stats)
            value, _, result = replay_function_backward(
                self.model, part, lambda lps, ents, rollouts=rollouts: gspo_loss(lps, ents, rollouts, loss_fn),
                temperature=temperature, engine=engine, force=self.force, first=head)
            result.loss = value
            results.append(result)
        return ReplayResult.merge(results)

    def keep_high_entropy(self, local: list[RolloutTree], entropy: list[torch.Tensor],
                          advantages: list[torch.Tensor]) -> float:
        """grpo.top_entropy_quantile over the step's completion tokens on every rank (`algorithms.
        keep_high_entropy`); returns the fraction of this rank's tokens kept."""
        gather = (lambda x: torch.cat(self.ranks.gather(x))) if self.ranks is not None else None
        return algorithms.keep_high_entropy(_rollouts(local), entropy, advantages,
                                            self.config.grpo.top_entropy_quantile, gather)

    def policy_loss(self, trees: list[RolloutTree]) -> GRPOLoss:
        """The token-level clipped loss of the algorithm: GRPO's (with its KL term), REINFORCE++'s (the KL is in the
        reward), PPO's (cliprange, token mean; the weights set by `algorithms.ppo`); RLOO's is `rloo_loss`."""
        cfg, g = self.config, self.config.grpo
        tokens = sum(float(r.loss_mask.sum()) for t in trees for r in t.rollouts)
        if cfg.algorithm == "ppo":
            return GRPOLoss(cfg.ppo.cliprange, cfg.ppo.cliprange, 0.0, 0.0, entropy_tokens=tokens)
        beta = g.beta if cfg.algorithm == "grpo" else 0.0
        return GRPOLoss(g.epsilon, g.epsilon_high, beta, g.entropy_coef, g.use_bias_correction_kl, g.delta,
                        entropy_tokens=tokens, loss_type=g.loss_type, sapo_temperature_pos=g.sapo_temperature_pos,
                        sapo_temperature_neg=g.sapo_temperature_neg)

    def rloo_backward(self, local: list[RolloutTree], old_sums: torch.Tensor, num_sequences: int, first: bool
                      ) -> tuple[ReplayResult | None, dict]:
        """One update of RLOO's sequence-level loss over `local`, micro-batched (`engine.sequence`): the first
        update reuses the old-policy pass as its sums (the same weights), later ones run their own. Returns the
        merged result (its loss the TRL loss of these rollouts) and TRL's entropy and clip_ratio metrics."""
        g, engine, temperature = self.config.grpo, self.config.engine, self.config.sampling.temperature
        if not local:
            return None, {}
        results, sums = [], []
        rollouts = _rollouts(local)
        advantages = torch.tensor([float(r.advantages[0]) for r in rollouts], dtype=torch.float64)
        for part, rows in micro_batches(local, g.micro_batch_prompts):
            old, adv = old_sums[rows], advantages[rows]

            def loss(s, old=old, adv=adv):
                return rloo_loss(s, old, adv, epsilon_low=g.epsilon, epsilon_high=g.epsilon_high,
                                 num_sequences=num_sequences)

            value, s, result = replay_sequence_backward(self.model, part, loss, temperature=temperature,
                                                        engine=engine, force=self.force,
                                                        sums=old if first else None)
            result.loss = value
            results.append(result)
            sums.append(s)
        result, s = ReplayResult.merge(results), torch.cat(sums)
        masks = [r.loss_mask for r in rollouts]
        entropy = sum(float((e.double() * m).sum()) for e, m in zip(result.entropy, masks))
        return result, {"entropy": entropy / max(sum(float(m.sum()) for m in masks), 1.0),
                        **rloo_clip_metrics(s, old_sums, advantages, epsilon_low=g.epsilon,
                                            epsilon_high=g.epsilon_high)}

    def accumulate_sharded(self, local: list[RolloutTree], loss_fn: GRPOLoss) -> ReplayResult:
        """This rank's trees forward and backward (micro-batched), the gradient reduced once over the ranks; the
        loss and the loss statistics summed over the ranks (every rank returns the step's totals)."""
        g = self.config.grpo
        trees = local or [_idle_tree(self.model)]  # a rank without rollouts still joins the one reduction
        with self.dp.accumulate(), self.autocast():
            result = accumulate(self.model, trees, loss_fn, g.micro_batch_prompts, self.config.sampling.temperature,
                                self.config.engine, self.force, final_backward=self.dp.final_sync(),
                                lockstep=self.dp.lockstep)
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

    def policy_logprobs(self, local: list[RolloutTree]) -> ReplayResult:
        """The policy's logprobs and entropies of this rank's trees, without a graph. FSDP2 resharded: in lock-step
        with the other ranks (every rank calls it, `local` possibly empty), one layer's parameters at a time;
        otherwise with the full parameters gathered."""
        cfg = self.config
        with contextlib.nullcontext() if self.lockstep else self.gathered(), self.autocast():
            return tree_logprobs(self.model, local, temperature=cfg.sampling.temperature, engine=cfg.engine,
                                 force=self.force, lockstep=self.lockstep)

    @property
    def lockstep(self) -> bool:
        """FSDP2 resharded: every engine call runs in lock-step with the other ranks (`engine/lockstep.py`)."""
        return self.dp is not None and self.dp.lockstep

    def train_step(self, step: int) -> dict | None:
        """generate + update (DPO: `dpo_step`); returns the step's metrics, or None (with a warning) when the reward
        failed."""
        if self.config.algorithm == "dpo":
            return self.dpo_step(step)
        t0 = time.perf_counter()
        try:
            batch = self.generate(step)
        except (RewardFunctionError, ItemError) as e:
            warnings.warn(f"step {step} skipped: {e}", RuntimeWarning, stacklevel=2)
            self.failure = str(e)
            return None
        t1 = time.perf_counter()
        if self.config.train.log_completions and self.rank == 0:
            self.completion_rows = batch.completions(self.tokenizer, advantages=self.config.algorithm == "grpo")
        self.status(f"step {step}: training on {sum(map(len, batch.rollouts))} rollouts")
        metrics = self.update(batch)
        t2 = time.perf_counter()
        lengths = batch.lengths
        self.num_tokens += sum(len(r) for group in batch.rollouts for r in group)
        timing = {"time/sample_model_s": t1 - t0 - batch.metrics["time/sample_env_s"]} if batch.trajectories else {}
        return {
            "step": step,
            "reward": batch.rewards.mean().item(),
            "reward_std": batch.reward_std.mean().item(),
            "frac_reward_zero_std": torch.isclose(batch.reward_std, torch.zeros(())).float().mean().item(),
            "completions/mean_length": sum(lengths) / len(lengths),
            "completions/clipped_ratio": sum(batch.truncated) / len(lengths),
            "num_tokens": self.num_tokens,
            **batch.metrics,
            **metrics,
            "time/sample_s": t1 - t0,
            **timing,
            "time/train_s": t2 - t1,  # the whole update, its no-grad passes (time/logprob_s) included
            "time/step_s": t2 - t0,
            "memory/peak_bytes": peak_memory_bytes(self.model.device),
        }

    def dpo_step(self, step: int) -> dict:
        """One DPO optimizer step on `dpo.pairs_per_step` pairs (in the seeded order of `prompt_indices`): the
        reference's summed logprobs (or the precomputed ones), then `dpo_loss` over the pair trees through
        `engine.sequence` (micro-batched by grpo.micro_batch_prompts trees). Returns TRL DPOTrainer's metrics:
        rewards/chosen, rewards/rejected (beta x the policy-minus-reference summed logprob; simpo: beta x the mean
        logprob, as TRL's CPOTrainer), rewards/accuracies, rewards/margins, logps/chosen, logps/rejected (summed)."""
        cfg, d, g = self.config, self.config.dpo, self.config.grpo
        t0 = time.perf_counter()
        picked = [self.pairs[i] for i in prompt_indices(len(self.pairs), d.pairs_per_step, cfg.train.seed, step)]
        trees, pairs = pair_trees(picked)
        rollouts = _rollouts(trees)
        lengths = torch.tensor([float(r.loss_mask.sum()) for r in rollouts], dtype=torch.float64)
        ref = self.reference_sums(trees, pairs) if self.has_reference else None
        t1 = time.perf_counter()
        for p in self.params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
        sums, loss_value = [], 0.0
        with self.autocast():
            for part, slices in micro_batches(trees, g.micro_batch_prompts):

                def loss(s, slices=slices):
                    r = ref[slices] if ref is not None else None
                    per_pair = dpo_loss(s[0::2], s[1::2], r[0::2] if r is not None else None,
                                        r[1::2] if r is not None else None, beta=d.beta, loss_type=d.loss_type,
                                        label_smoothing=d.label_smoothing, chosen_tokens=lengths[slices][0::2],
                                        rejected_tokens=lengths[slices][1::2], simpo_gamma=d.simpo_gamma)
                    return per_pair.sum() / len(pairs)

                value, s, _ = replay_sequence_backward(self.model, part, loss, engine=cfg.engine, force=self.force)
                loss_value += value
                sums.append(s)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, g.max_grad_norm).item()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        t2 = time.perf_counter()
        stats = sum((t.stats for t in trees[1:]), trees[0].stats)
        self.num_tokens += stats.logical_tokens
        return {
            "step": step, "loss": loss_value, "grad_norm": grad_norm, "learning_rate": lr,
            **dpo_metrics(torch.cat(sums), ref, lengths, beta=d.beta, loss_type=d.loss_type),
            "num_tokens": self.num_tokens,
            "tree/logical_tokens": stats.logical_tokens, "tree/physical_tokens": stats.physical_tokens,
            "tree/token_ratio": stats.token_ratio,
            "time/sample_s": 0.0, "time/logprob_s": t1 - t0, "time/train_s": t2 - t0, "time/step_s": t2 - t0,
            "memory/peak_bytes": peak_memory_bytes(self.model.device),
        }

    def reference_sums(self, trees: list[RolloutTree], pairs: list) -> torch.Tensor:
        """[2 x pairs] float64 summed completion logprobs of the frozen reference, chosen and rejected interleaved
        as the trees' rollouts (`preferences.pair_trees`). dpo.precompute_ref_log_probs: every pair's once, on the
        first call (TRL's option), then looked up by row."""
        def compute(trees):
            with self.autocast(), self.reference() as reference:
                logprobs = tree_logprobs(reference, trees, temperature=1.0, engine=self.config.engine,
                                         force=self.force).logprobs
            return sequence_sums(logprobs, _rollouts(trees))

        if not self.config.dpo.precompute_ref_log_probs:
            return compute(trees)
        if not self.ref_sums:
            self.status("precomputing the reference logprobs of every preference pair")
            all_trees, ordered = pair_trees(self.pairs)
            for p, c, r in zip(ordered, *compute(all_trees).view(-1, 2).unbind(1)):
                self.ref_sums[p.row] = (float(c), float(r))
        return torch.tensor([v for p in pairs for v in self.ref_sums[p.row]], dtype=torch.float64)

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
            self.step, extra = load_checkpoint(found, self.model, self.optimizer, self.scheduler,
                                               critic=self.critic_state())
            self.num_tokens = extra.get("num_tokens", 0)
            self.console.print(f"resumed {run_dir} from {found.name}")
        self.config.train.output_dir = str(run_dir)
        if self.rank == 0:  # rank 0 alone writes the run folder
            run_dir.mkdir(parents=True, exist_ok=True)
            self.config.save(run_dir / "config.yaml")
        if self.ranks is None:  # data-parallel runs checked before sharding (__init__)
            self.force = self.check_family(run_dir)
        log = MetricsLog(run_dir, truncate_after=self.step, console=self.console) if self.rank == 0 else _NoLog()
        stop: list[str] = []
        try:
            with _stop_on_signals(stop, self.console):
                self._loop(run_dir, log, stop)
        except RuntimeError as e:
            self.raise_if_a_rank_died(run_dir, e)
            raise
        finally:
            log.close()
        if self.stopping(stop):
            raise TrainingInterrupted(run_dir, self.step)
        if self.rank == 0:
            summarize(self.console, run_dir, log.records, reward_name=self.reward_name())
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
            failed = 0  # consecutive skipped steps
            while self.step < cfg.steps and not self.stopping(stop):
                try:
                    record = self.train_step(self.step + 1)
                except VLLMError as e:  # raised before the step's update: the state is the last step's
                    self.save(run_dir)
                    raise TrainingFailed(run_dir, f"step {self.step + 1}: the vLLM sampler failed ({e})") from e
                failed = failed + 1 if record is None else 0
                if cfg.max_failed_steps and failed >= cfg.max_failed_steps:
                    self.step -= failed - 1  # the last good step: no update happened since, so its state is this
                    self.save(run_dir)
                    raise TrainingFailed(run_dir, f"steps {self.step + 1}-{self.step + failed} failed "
                                         f"({self.failure}); stopped after train.max_failed_steps="
                                         f"{cfg.max_failed_steps}")
                record = record or {"step": self.step + 1}
                self.step += 1
                if self.completion_rows:
                    log.write_completions(self.step, self.completion_rows)
                    self.completion_rows = []
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

    def raise_if_a_rank_died(self, run_dir: Path, error: RuntimeError) -> None:
        """Raise `RankDied` when `error` (a failed collective) came from another rank that stopped beating
        (`parallel.Heartbeat`); return otherwise, and at once in one process or for the trainer's own errors."""
        if self.ranks is None or self.ranks.heartbeat is None or isinstance(error, TrainingFailed):
            return
        dead = self.ranks.heartbeat.dead_ranks()
        if dead:
            self.ranks.heartbeat.leaving()
            said = " ".join(str(error).split())[:200]
            raise RankDied(run_dir, f"rank {', '.join(map(str, dead))} of {self.ranks.world_size} died during step "
                           f"{self.step + 1} (no heartbeat for {self.ranks.heartbeat.wait_s:g} s; the collective "
                           f"said: {said})") from error

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
                               tokenizer=self.tokenizer, critic=self.critic_state())

    @contextlib.contextmanager
    def reference(self):
        """The frozen reference policy of the KL term (and DPO): the copy of the initial weights, or, with LoRA,
        the policy with its adapter off (TRL's way: no second model)."""
        if self.ref_model is not None:
            yield self.ref_model
        else:
            with self.model.disable_adapter():
                yield self.model

    def reward_name(self) -> str:
        """What the run's reward is, for the plot: the environment, DPO's preferences, or the reward functions."""
        if self.env is not None:
            return self.config.agent.environment or type(self.env).__name__
        if self.config.algorithm == "dpo" or self.rewards is None:
            return "preferences"
        return " + ".join(self.rewards.names)

    def critic_state(self) -> tuple | None:
        """(critic, its optimizer, its scheduler) for the checkpoint, or None without a critic."""
        return None if self.critic is None else (self.critic, self.critic_optimizer, self.critic_scheduler)

    def evaluate(self) -> dict:
        """The held-out score; data-parallel, each rank decodes its share of the split with the full parameters."""
        with self.gathered(), self.autocast():
            return evaluate(self.model, self.tokenizer, self.config, self.eval_data, self.rewards,
                            progress=lambda done, total: self.status(f"held-out eval: {done}/{total} answers"),
                            ranks=self.ranks, env=self.env)


# -- pieces ---------------------------------------------------------------------------------------------------------

def accumulate(model, trees: list[RolloutTree], loss, micro_batch_prompts: int, temperature: float,
               engine: EngineConfig = EngineConfig(), force: bool = False, final_backward=None,
               lockstep: bool = False) -> ReplayResult:
    """`methods.tree_backward` (the engine, or a reference by `engine.method`) over consecutive micro-batches of
    `micro_batch_prompts` trees (0 = all at once), with the run's `engine` section; gradients accumulate in
    param.grad. `final_backward` (data parallelism: the gradient sync) wraps the last micro-batch's last backward.
    `lockstep` (FSDP2 resharded): every rank makes as many calls as the rank with the most micro-batches of whole
    trees, the missing ones empty, and runs its context-parallel parts (which the ranks run together; the sharding
    puts them last) in its last call. Returns the results merged (`ReplayResult.merge`)."""
    size = micro_batch_prompts or len(trees) or 1
    whole = [t for t in trees if not isinstance(t, ContextParallelTree)] if lockstep else trees
    calls = [whole[i : i + size] for i in range(0, len(whole), size)] or [[]]
    if lockstep:  # one small collective: the ranks' numbers of micro-batches
        count = torch.tensor([len(calls)], device=collective_device())
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        calls += [[] for _ in range(int(count) - len(calls))]
        calls[-1] = calls[-1] + [t for t in trees if isinstance(t, ContextParallelTree)]
    return ReplayResult.merge([tree_backward(model, part, loss, temperature=temperature, engine=engine, force=force,
                                             lockstep=lockstep,
                                             final_backward=final_backward if k == len(calls) - 1 else None)
                               for k, part in enumerate(calls)])


def micro_batches(trees: list[RolloutTree], micro_batch_prompts: int):
    """Consecutive micro-batches of `micro_batch_prompts` trees (0 = all at once): (the trees, the slice of their
    rollouts among all the trees' rollouts in order), for losses that index per-rollout tensors of the step."""
    size, k = micro_batch_prompts or len(trees) or 1, 0
    for i in range(0, len(trees), size):
        part = trees[i : i + size]
        n = sum(len(t.rollouts) for t in part)
        yield part, slice(k, k + n)
        k += n


def prompt_indices(n: int, per_step: int, seed: int, step: int) -> list[int]:
    """Indices into a split of n items for `step` (>= 1): positions (step-1)*per_step ... of the concatenated
    epochs, epoch e being a permutation seeded by (seed, e). Pure function of its arguments."""
    out = []
    for k in range((step - 1) * per_step, step * per_step):
        epoch, pos = divmod(k, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(_mix(seed, -1 - epoch)))
        out.append(int(perm[pos]))
    return out


def _trains(tree: RolloutTree, beta: float, entropy_coef: float) -> bool:
    """Whether a tree has a gradient: a KL or entropy term, or a rollout with a non-zero advantage and weight."""
    return beta > 0 or entropy_coef > 0 or any(r.advantages.any() and r.weights.any() for r in tree.rollouts)


def _ppo_update_metrics(result: ReplayResult | None, local: list[RolloutTree], loss_fn: GRPOLoss,
                        value_loss: ValueLoss) -> dict:
    """TRL PPOTrainer's per-update metrics: policy/approxkl_avg (0.5 mean (logp - old_logp)^2), val/ratio (the mean
    ratio), policy/entropy_avg, policy/clipfrac_avg, loss/policy_avg (this update's token-mean policy loss),
    loss/value_avg and val/clipfrac_avg. Means over the completion tokens (TRL's include its padding)."""
    if result is None:
        return {}
    rollouts = _rollouts(local)
    diffs = torch.cat([(lp.double() - r.old_logprobs)[r.loss_mask > 0] for lp, r in zip(result.logprobs, rollouts)])
    stats = loss_fn.stats.metrics()
    return {"policy/approxkl_avg": float(0.5 * (diffs ** 2).mean()) if diffs.numel() else 0.0,
            "val/ratio": float(diffs.exp().mean()) if diffs.numel() else 1.0,
            "policy/entropy_avg": stats["entropy"], "policy/clipfrac_avg": stats["clip_ratio/region_mean"],
            "loss/policy_avg": result.loss, **value_loss.value_metrics()}


def sampler_mismatch(batch: Batch, rollouts: list[Rollout], logprobs: list[torch.Tensor], cap: float | None) -> dict:
    """The vLLM sampler's logprobs s against the run's own old-policy logprobs t (`logprobs`, per rollout of
    `rollouts` [T]: an old-policy pass's, or on-policy the first update's) on every trained token:
    sampling/logprob_diff_mean and _max = mean and max |t - s| (nats), sampling/mismatch_kl = mean of
    exp(t - s) - (t - s) - 1 (the k3 estimate of KL(sampler || trainer) on the sampler's tokens). With `cap`: TRL's
    truncated importance sampling (token_truncate) multiplies each trained token's policy term by
    min(exp(t - s), cap), logged as sampling/importance_sampling_ratio/min, /mean and /max; the term is linear in the
    advantage, so the factor goes into the advantages, leaving the KL and entropy terms alone, as TRL's."""
    sampler = {id(r): lp for r, lp in zip((r for group in batch.rollouts for r in group), batch.sampler_logprobs)}
    diffs, ratios = [], []
    for r, t in zip(rollouts, logprobs):
        mask = r.loss_mask.bool()
        d = (t.double() - sampler[id(r)])[mask]
        diffs.append(d)
        if cap is not None:
            ratio = torch.ones(len(r), dtype=torch.float64)
            ratio[mask] = torch.exp(d).clamp(max=cap)
            r.advantages = r.advantages * ratio
            ratios.append(ratio[mask])
    d = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    if not d.numel():
        return {}
    out = {"sampling/logprob_diff_mean": d.abs().mean().item(), "sampling/logprob_diff_max": d.abs().max().item(),
           "sampling/mismatch_kl": (d.exp() - d - 1).mean().item()}
    if ratios:
        ratio = torch.cat(ratios)
        out.update({f"sampling/importance_sampling_ratio/{k}": getattr(ratio, k)().item()
                    for k in ("min", "mean", "max")})
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

    def write_completions(self, step: int, rows: list[dict]) -> None:
        pass

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
    except RankDied:
        raise  # the process group is broken: no barrier (cli.py exits at once)
    except (TrainingInterrupted, TrainingFailed):
        shutdown()  # every rank stopped at the same step, after the checkpoint
        raise
    shutdown()
    return run_dir


