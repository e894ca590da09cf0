"""A step's sampled batch: which prompts (`data.order.prompt_indices`), drawn by the run's back-end (in this process,
`decode/in_process.py`, or by a vLLM server, `vllm/backend.py`; multi-turn through the environment), scored by the
reward functions or the environment, and gathered on every rank as one `Batch`.

Each group (item) k of step s draws from its own torch.Generator seeded by (train.seed, s, k), so its samples do not
depend on the other groups, the world size or a resume. Under torchrun each rank scores the groups it drew, and
every rank then holds the whole batch (token ids, logprobs, rewards: small), so advantages and loss weights are
normalised over the whole step. The back-end gets the policy's weights when their `version` moved (an update).
History: docs/notes/sampler.md.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ...decode.in_process import InProcess
from ...decode.loop import eos_token_ids
from ..agent.task import context_limit, trajectory_metrics, trajectory_reward, turn_branching
from ..data.order import mix, prompt_indices
from ..data.rewards import RewardFunctionError, score_columns
from ..data.tasks import prompt_token_ids
from .batch import Batch, Drawn, group_rollouts, group_std
from .trajectories import ItemError, Limits, sample_trajectories_turnwise
from .vllm.backend import VLLM
from .vllm.client import VLLMError

if TYPE_CHECKING:
    from ..config import Config
    from ..policy import Policy
    from ..run.parallel import Ranks


class Sampler:
    """The step's rollouts of a run (module docstring): `sample(step)`, then `score(drawn)`. `policy`: the `Policy`
    that samples; `rewards`: the `RewardFunctions` (None with an environment, which scores the trajectories); `env`:
    the multi-turn environment or None; `client`: the connected `VLLMClient` on rank 0 with sampling.backend vllm;
    `status`: called with the progress bar's phase text."""

    def __init__(self, config: Config, policy: Policy, tokenizer, train_data, rewards, env=None, client=None,
                 ranks: Ranks | None = None,
                 status=lambda text: None):
        self.config, self.policy, self.tokenizer, self.train_data = config, policy, tokenizer, train_data
        self.rewards, self.env, self.ranks, self.status = rewards, env, ranks, status
        s, G, eos = config.sampling, config.grpo.num_generations, eos_token_ids(policy.model, tokenizer)
        shown = lambda text: self.status(text)  # noqa: E731 (the status may be replaced: a sampler process's)
        trajectories = None if env is None else functools.partial(  # the multi-turn driver, with this run's limits
            sample_trajectories_turnwise, tokenizer=tokenizer, env=env, turn_branching=turn_branching(config),
            config=s, limits=Limits(config.agent.max_turns, context_limit(config.agent, policy.model),
                                    config.agent.max_tool_output_tokens))
        self.backend = VLLM(client, s, G, policy, eos, trajectories, ranks, config.model.lora_r > 0, shown) \
            if s.uses_vllm else InProcess(s, G, policy, eos, self.generator, trajectories, ranks, shown)
        self.synced: int | None = None  # the policy's version the back-end last got

    def batch(self, step: int) -> Batch:
        return self.score(self.sample(step))

    def sample(self, step: int) -> Drawn:
        """The rollouts of `step` (>= 1), drawn by the back-end with the policy's current weights. Raises VLLMError
        when the server failed."""
        cfg = self.config
        items = [self.train_data[i] for i in prompt_indices(len(self.train_data), cfg.grpo.prompts_per_step,
                                                            cfg.train.seed, step)]
        sync_s = self.backend.sync(self.policy.full_state_dict if self.policy.version != self.synced else None)
        self.synced = self.policy.version
        if self.env is not None:
            groups, timings, errors = self.backend.items(step, items)
            if not groups:
                raise ItemError(f"step {step}: every item was skipped: {errors[0]}"
                                + (f" (and {len(errors) - 1} more, in the warnings above)" if len(errors) > 1 else ""))
            return Drawn(step, items, trajectories=groups, timings=timings, sync_s=sync_s)
        prompt_ids = [prompt_token_ids(self.tokenizer, item, cfg.task) for item in items]
        samples, failure = self.backend.groups(step, prompt_ids)
        return Drawn(step, items, prompt_ids, samples, failure, sync_s=sync_s)

    def score(self, drawn: Drawn) -> Batch:
        """The drawn rollouts with their rewards, gathered on every rank: the reward functions score this rank's
        groups, the environment each trajectory. Raises RewardFunctionError from the reward, VLLMError when the
        server failed."""
        if self.env is not None:
            return self.scored_trajectories(drawn)
        G, samples, failure = self.config.grpo.num_generations, drawn.samples, drawn.failure
        rewards, error = {}, None
        try:
            if samples:
                self.status(f"step {drawn.step}: scoring {len(samples) * G} completions")
                total, columns = score_columns(self.rewards, self.tokenizer, [drawn.items[k] for k in samples],
                                               list(samples.values()), self.config.task)
                rewards = dict(zip(samples, zip(total.split(G), columns.split(G), strict=True), strict=True))
        except RewardFunctionError as e:
            error = (str(e), e.traceback)
        if self.ranks is not None:  # every rank gets the whole batch (token ids, logprobs and rewards: small)
            parts = self.ranks.gather((samples, rewards, error, failure))
            error = next((e for _, _, e, _ in parts if e is not None), None)
            failure = next((f for _, _, _, f in parts if f is not None), failure)
            samples = {k: s for part, _, _, _ in parts for k, s in part.items()}
            rewards = {k: r for _, part, _, _ in parts for k, r in part.items()}
        if failure is not None:
            raise VLLMError(failure[1]) if failure[0] == "vllm" else RuntimeError(f"sampling failed on {failure[1]}")
        if error is not None:
            raise RewardFunctionError(*error)
        return self.scored_completions(drawn, [samples[k] for k in range(len(drawn.items))], rewards)

    def scored_completions(self, drawn: Drawn, samples: list[list], rewards: dict) -> Batch:
        """The single-turn `Batch` of every group's samples and (total, per function) rewards, by group."""
        cfg, n = self.config, len(drawn.items)
        total, columns = torch.cat([rewards[k][0] for k in range(n)]), torch.cat([rewards[k][1] for k in range(n)])
        sequences = [[(ids + s.completion_ids, [0.0] * len(ids) + [1.0] * len(s.completion_ids), s.truncated)
                      for s in group] for ids, group in zip(drawn.prompt_ids, samples, strict=True)]
        metrics = {}  # TRL's rewards/<name>/mean and std, over the samples the function scored
        for name, column in zip(self.rewards.names, columns.unbind(1), strict=True):
            kept = column[~column.isnan()]
            metrics[f"rewards/{name}/mean"] = kept.mean().item() if kept.numel() else float("nan")
            metrics[f"rewards/{name}/std"] = kept.std().item() if kept.numel() > 1 else 0.0
        sampler = None
        if self.backend.keeps_logprobs:  # the sampler's logprobs of each rollout's positions (0 on the prompt)
            sampler = [torch.tensor([0.0] * len(ids) + s.logprobs, dtype=torch.float64)
                       for ids, group in zip(drawn.prompt_ids, samples, strict=True) for s in group]
        flat = [s for group in samples for s in group]
        return self.batch_of(sequences, total, cfg.sampling.max_new_tokens, drawn,
                             [len(s.completion_ids) for s in flat], [s.truncated for s in flat],
                             prompt_ids=drawn.prompt_ids, samples=samples, items=drawn.items, sampler_logprobs=sampler,
                             metrics=metrics)

    def scored_trajectories(self, drawn: Drawn) -> Batch:
        """A multi-turn step's `Batch`: one reward per trajectory (`agent.task.trajectory_reward`), by item; the
        items whose environment failed are left out."""
        cfg, a = self.config, self.config.agent
        kept = [k for k in range(len(drawn.items)) if k in drawn.trajectories]
        groups = [drawn.trajectories[k] for k in kept]
        flat = [t for g in groups for t in g]
        rewards = torch.tensor([trajectory_reward(t, a) for t in flat], dtype=torch.float32)
        sequences = [[(t.conversation.ids, t.conversation.loss_mask, t.truncated) for t in g] for g in groups]
        sampler = [torch.tensor(t.logprobs, dtype=torch.float64) for t in flat] if self.backend.keeps_logprobs \
            else None  # the sampler's logprobs of each trajectory's positions (0 outside its replies)
        metrics = {**trajectory_metrics(groups), "time/sample_env_s": drawn.timings["env_s"]}
        return self.batch_of(sequences, rewards, a.max_turns * cfg.sampling.max_new_tokens, drawn,
                             [int(sum(t.conversation.loss_mask)) for t in flat], [t.truncated for t in flat],
                             trajectories=groups, items=[drawn.items[k] for k in kept], metrics=metrics,
                             sampler_logprobs=sampler)

    def batch_of(self, sequences, rewards, max_completion_length: int, drawn: Drawn, *args, metrics: dict,
                 **fields) -> Batch:
        """The `Batch` of (ids, loss mask, truncated) per group, [B] rewards, reward std and weight sync seconds."""
        grpo = self.config.grpo
        rollouts = group_rollouts(sequences, grpo, max_completion_length)
        std = group_std(rewards, [r.group for group in rollouts for r in group], grpo.scale_rewards)
        if drawn.sync_s is not None:
            metrics["time/weight_sync_s"] = drawn.sync_s
        return Batch(rollouts, rewards, std, *args, metrics=metrics, **fields)

    def generator(self, step: int, k: int) -> torch.Generator:
        """The sampling generator of group (item) k of `step`, seeded by (train.seed, step, k)."""
        return torch.Generator(self.policy.model.device).manual_seed(mix(mix(self.config.train.seed, step), k))
