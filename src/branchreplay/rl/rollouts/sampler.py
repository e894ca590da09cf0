"""A step's sampled batch: which prompts (`data.order.prompt_indices`), sampled how (in-process, every group of
the step in one decoding loop, or by the vLLM server; multi-turn through the environment), scored by the reward
functions or the environment, and grouped with their advantages (`batch.group_rollouts`).

Each group (item) k of step s draws from its own torch.Generator seeded by (train.seed, s, k), so its samples do not
depend on the other groups, the world size or a resume. Under torchrun rank r samples and scores the groups k with
k % world == r (multi-turn: the items), and every rank then holds the whole batch (token ids, logprobs, rewards:
small), so advantages and loss weights are normalised over the whole step. With the vLLM backend rank 0 alone talks
to the server: it sends every group of the step at once (one server batches them all and its prefix cache serves
every rank's groups; one weight upload per update, where a server per rank would take one each) and scores them,
and every rank receives the batch.
History: docs/notes/rl-docstrings.md.
"""

from __future__ import annotations

import warnings

import torch

from ...engine.parallel.distributed import raise_together
from ..agent.task import context_limit, trajectory_metrics, trajectory_reward, turn_branching
from ..data.order import mix, prompt_indices
from ..data.rewards import RewardFunctionError, score_columns
from ..data.tasks import prompt_token_ids
from .batch import Batch, group_rollouts
from ...decode.packed_linears import packed_linears
from ...decode.loop import branching_schedule, eos_token_ids, sample_groups
from .trajectories import ItemError, Limits, sample_trajectories_turnwise
from ...decode.turns import InProcessTurns
from .vllm.client import VLLMError
from .vllm.sampling import sample_trees


class Sampler:
    """The step's rollouts of a run (module docstring). `policy`: the `Policy` that samples; `rewards`: the
    `RewardFunctions` (None with an environment, which scores the trajectories); `env`: the multi-turn environment
    or None; `vllm`: the connected `VLLMClient` on rank 0 when sampling.backend=vllm, else None; `status`: called with
    the progress bar's phase text."""

    def __init__(self, config, policy, tokenizer, train_data, rewards, env=None, vllm=None, ranks=None,
                 status=lambda text: None):
        self.config, self.policy, self.tokenizer, self.train_data = config, policy, tokenizer, train_data
        self.rewards, self.env, self.vllm, self.ranks, self.status = rewards, env, vllm, ranks, status
        self.eos_ids = eos_token_ids(policy.model, tokenizer)
        self.backend = config.sampling.backend
        self.stale = True  # whether the vLLM server lacks the policy's current weights (set after every update)
        self.keeps_logprobs = self.backend == "vllm"  # whether a batch carries its sampler's logprobs (also ahead)
        self.base_synced = False  # LoRA: whether the server holds this run's base weights (sent once per run)

    def batch(self, step: int) -> Batch:
        """Sample, score and group the rollouts of `step` (>= 1). Raises RewardFunctionError from the reward,
        ItemError when every item's environment failed, VLLMError when the server failed."""
        cfg = self.config
        items = [self.train_data[i] for i in prompt_indices(len(self.train_data), cfg.grpo.prompts_per_step,
                                                            cfg.train.seed, step)]
        return self.trajectories(step, items) if self.env is not None else self.completions(step, items)

    def mine(self, n: int) -> list[int]:
        """The groups (items) of `n` this rank samples: k with k % world == rank (all in one process)."""
        return self.ranks.mine(n) if self.ranks is not None else list(range(n))

    def waves(self, groups: list[int]) -> list[list[int]]:
        """`groups` (or items) in the waves the in-process sampler takes together (`sampling.max_num_seqs`)."""
        limit = self.config.sampling.max_num_seqs
        size = len(groups) if limit is None else max(1, limit // self.config.grpo.num_generations)
        return [groups[i : i + size] for i in range(0, len(groups), max(size, 1))]

    def generator(self, step: int, k: int) -> torch.Generator:
        """The sampling generator of group (item) k of `step`, seeded by (train.seed, step, k)."""
        return torch.Generator(self.policy.model.device).manual_seed(mix(mix(self.config.train.seed, step), k))

    def completions(self, step: int, items: list[dict]) -> Batch:
        """A single-turn step: G completions of each item's chat-templated prompt, scored by the reward functions."""
        cfg, G = self.config, self.config.grpo.num_generations
        prompt_ids = [prompt_token_ids(self.tokenizer, item, cfg.task) for item in items]
        sync_s = None
        if self.backend == "vllm":
            sync_s = self.sync_vllm()
            samples, failure = self.vllm_groups(step, prompt_ids)
            scored = list(samples)
        else:
            samples, failure = self.sample(step, prompt_ids)
            scored = self.mine(len(items))
        rewards, error = {}, None
        try:
            if scored:
                self.status(f"step {step}: scoring {len(scored) * G} completions")
                total, columns = score_columns(self.rewards, self.tokenizer, [items[k] for k in scored],
                                               [samples[k] for k in scored], cfg.task)
                rewards = dict(zip(scored, zip(total.split(G), columns.split(G))))
        except RewardFunctionError as e:
            error = (str(e), e.traceback)
        if self.ranks is not None:  # every rank gets the whole batch (token ids, logprobs and rewards: small)
            parts = self.ranks.gather((samples, rewards, error, failure))
            error = next((e for _, _, e, _ in parts if e is not None), None)
            failure = next((f for _, _, _, f in parts if f is not None), failure)
            for s_part, r_part, _, _ in parts:
                samples.update(s_part)
                rewards.update(r_part)
        if failure is not None:
            raise VLLMError(failure[1]) if failure[0] == "vllm" else RuntimeError(f"sampling failed on {failure[1]}")
        if error is not None:
            raise RewardFunctionError(*error)
        return self.scored(prompt_ids, [samples[k] for k in range(len(items))], rewards, items, sync_s)

    def scored(self, prompt_ids, samples, rewards, items, sync_s) -> Batch:
        """The single-turn `Batch` of every group's samples and (total, per function) rewards, by group."""
        cfg = self.config
        columns = torch.cat([rewards[k][1] for k in range(len(items))])
        total = torch.cat([rewards[k][0] for k in range(len(items))])
        sequences = [[(ids + s.completion_ids, [0.0] * len(ids) + [1.0] * len(s.completion_ids), s.truncated)
                      for s in group] for ids, group in zip(prompt_ids, samples)]
        rollouts, advantages, std = group_rollouts(sequences, total, cfg.grpo, cfg.sampling.max_new_tokens)
        flat = [s for group in samples for s in group]
        metrics = {}  # TRL's rewards/<name>/mean and std, over the samples the function scored
        for name, column in zip(self.rewards.names, columns.unbind(1)):
            kept = column[~column.isnan()]
            metrics[f"rewards/{name}/mean"] = kept.mean().item() if kept.numel() else float("nan")
            metrics[f"rewards/{name}/std"] = kept.std().item() if kept.numel() > 1 else 0.0
        sampler = None
        if self.keeps_logprobs:  # the sampler's logprobs of each rollout's positions (0 on the prompt)
            sampler = [torch.tensor([0.0] * len(ids) + s.logprobs, dtype=torch.float64)
                       for ids, group in zip(prompt_ids, samples) for s in group]
        if self.backend == "vllm":
            metrics["time/weight_sync_s"] = sync_s
        return Batch(rollouts, total, advantages, std, [len(s.completion_ids) for s in flat],
                     [s.truncated for s in flat], prompt_ids=prompt_ids, samples=samples, metrics=metrics,
                     items=items, sampler_logprobs=sampler)

    def sample(self, step: int, prompt_ids: list[list[int]]) -> tuple[dict, tuple | None]:
        """This rank's groups sampled in-process, in one decoding loop, each from its own generator: ({k: samples},
        None), or ({}, ("rank", what failed)) on a rank of a data-parallel run (re-raised on every rank)."""
        mine = self.mine(len(prompt_ids))
        cfg = self.config
        rows = max(map(len, self.waves(mine)), default=0) * cfg.grpo.num_generations  # a decoding step's most
        with self.policy.gathered(), self.policy.autocast(), packed_linears(self.policy.model,
                                                                            cfg.sampling.pack_weights, rows):
            try:
                drawn = []
                for wave in self.waves(mine):
                    self.status(f"step {step}: sampling {len(drawn) + len(wave)}/{len(mine)} groups")
                    drawn += sample_groups(self.policy.model, [prompt_ids[k] for k in wave],
                                           cfg.grpo.num_generations, cfg.sampling, self.eos_ids,
                                           [self.generator(step, k) for k in wave])
                return dict(zip(mine, drawn)), None
            except Exception as e:  # noqa: BLE001 (re-raised on every rank)
                if self.ranks is None:
                    raise
                return {}, ("rank", f"rank {self.ranks.rank}: {type(e).__name__}: {e}")

    def vllm_groups(self, step: int, prompt_ids: list[list[int]]) -> tuple[dict, tuple | None]:
        """Every group of the step sampled by the vLLM server, all in flight together, on rank 0: ({k: samples},
        None), ({}, None) on the other ranks, or ({}, ("vllm", the error)) when the server failed under torchrun.
        Raises VLLMError in one process."""
        if self.vllm is None:
            return {}, None
        s, G = self.config.sampling, self.config.grpo.num_generations
        self.status(f"step {step}: sampling {len(prompt_ids)} groups with vLLM")
        try:
            requests = [(p, branching_schedule(self.policy.model, p, G, s)) for p in prompt_ids]
            groups = sample_trees(self.vllm, requests, s, self.eos_ids)
        except Exception as e:  # noqa: BLE001 (re-raised on every rank: the others wait for rank 0)
            if self.ranks is None:
                raise
            return {}, ("vllm", str(e)) if isinstance(e, VLLMError) else ("rank", f"rank 0: {type(e).__name__}: {e}")
        return dict(enumerate(groups)), None

    def sync_vllm(self) -> float:
        """Send the policy's weights to the vLLM server when it lacks them (at the start, after each update);
        returns the seconds it took (0 when nothing was sent). Under torchrun every rank calls it (the full weights
        are gathered to rank 0). Raises VLLMError on every rank."""
        if not self.stale:
            return 0.0
        self.status("syncing the weights to vLLM")
        state = self.policy.full_state_dict()
        seconds, error = 0.0, None
        try:
            if self.vllm is not None and self.config.model.lora_r > 0:  # the adapter alone (a few MB), after the
                if not self.base_synced:  # frozen base once: the server may hold another run's weights
                    seconds += self.vllm.sync_weights(base_weights(state), keep=False)
                    self.base_synced = True
                seconds += self.vllm.sync_adapter(self.policy.model, state)
            elif self.vllm is not None:
                seconds = self.vllm.sync_weights(state)
        except Exception as e:  # noqa: BLE001 (re-raised on every rank: the others wait for rank 0)
            if self.ranks is None:
                raise
            error = e
        if self.ranks is not None:  # every rank raises a VLLMError: the run then stops with a checkpoint
            raise_together(error, "the weight sync to vLLM", kinds=(VLLMError,))
        self.stale = False
        return seconds

    def trajectories(self, step: int, items: list[dict]) -> Batch:
        """A multi-turn step: each item's trajectories (`trajectories.sample_trajectories_turnwise`, in this process
        or by the vLLM server; in this process item k's replies draw from its generator, seeded by (train.seed, step,
        k)), one reward each (`agent.task.trajectory_reward`), group advantages per item.
        Items whose environment fails (ItemError) are skipped with a warning; raises ItemError when every item
        was."""
        cfg, a = self.config, self.config.agent
        sync_s = self.sync_vllm() if self.backend == "vllm" else None
        groups, timings, errors = self.vllm_items(step, items) if self.backend == "vllm" else \
            self.sample_items(step, items)
        kept = [k for k in range(len(items)) if k in groups]
        if not kept:
            raise ItemError(f"step {step}: every item was skipped: {errors[0]}"
                            + (f" (and {len(errors) - 1} more, in the warnings above)" if len(errors) > 1 else ""))
        groups = [groups[k] for k in kept]
        flat = [t for g in groups for t in g]
        rewards = torch.tensor([trajectory_reward(t, a) for t in flat], dtype=torch.float32)
        sequences = [[(t.conversation.ids, t.conversation.loss_mask, t.truncated) for t in g] for g in groups]
        rollouts, advantages, std = group_rollouts(sequences, rewards, cfg.grpo,
                                                   a.max_turns * cfg.sampling.max_new_tokens)
        metrics = {**trajectory_metrics(groups), "time/sample_env_s": timings["env_s"]}
        sampler = None
        if self.keeps_logprobs:  # the sampler's logprobs of each trajectory's positions (0 outside its replies)
            sampler = [torch.tensor(t.logprobs, dtype=torch.float64) for t in flat]
        if self.backend == "vllm":
            metrics["time/weight_sync_s"] = sync_s
        return Batch(rollouts, rewards, advantages, std, [int(sum(t.conversation.loss_mask)) for t in flat],
                     [t.truncated for t in flat], trajectories=groups, items=[items[k] for k in kept],
                     metrics=metrics, sampler_logprobs=sampler)

    def vllm_items(self, step: int, items: list[dict]) -> tuple[dict, dict, list[str]]:
        """`sample_items` by the vLLM server: every item's trajectories turn by turn, each turn's requests of every
        item in flight together (`trajectories.sample_trajectories_turnwise`), on rank 0; every rank receives
        them. Raises VLLMError (on every rank under torchrun) when the server failed."""
        cfg, a = self.config, self.config.agent
        groups, timings, errors, failure = {}, {"env_s": 0.0}, [], None
        if self.vllm is not None:
            self.status(f"step {step}: sampling {len(items)} items with vLLM")
            limits = Limits(a.max_turns, context_limit(a, self.policy.model), a.max_tool_output_tokens)
            turn = lambda requests, keys: sample_trees(self.vllm, requests, cfg.sampling, self.eos_ids)  # noqa: E731
            try:
                groups, errors = sample_trajectories_turnwise(turn, self.tokenizer, self.env, items,
                                                              turn_branching(cfg), cfg.sampling, limits, timings)
            except Exception as e:  # noqa: BLE001 (re-raised on every rank: the others wait for rank 0)
                if self.ranks is None:
                    raise
                failure = e
        if self.ranks is not None:
            raise_together(failure, "sampling the trajectories with vLLM", kinds=(VLLMError,))
            groups, errors = self.ranks.gather((groups, errors))[0]
        for error in errors:
            warnings.warn(f"step {step}: an item was skipped: {error}", RuntimeWarning, stacklevel=3)
        return groups, timings, errors

    def sample_items(self, step: int, items: list[dict]) -> tuple[dict, dict, list[str]]:
        """This rank's items' trajectories ({k: its trajectories}; items whose environment failed are left out with
        a warning), gathered from every rank under torchrun; {"env_s": this rank's environment seconds}; and why
        the items left out were (every rank's)."""
        cfg, a = self.config, self.config.agent
        groups, timings, errors = {}, {"env_s": 0.0}, []
        branching, limit = turn_branching(cfg), context_limit(a, self.policy.model)
        limits = Limits(a.max_turns, limit, a.max_tool_output_tokens)
        failure = None
        mine = self.mine(len(items))
        rows = max(map(len, self.waves(mine)), default=0) * cfg.grpo.num_generations  # a turn's most replies
        with self.policy.gathered(), self.policy.autocast(), packed_linears(self.policy.model,
                                                                            cfg.sampling.pack_weights, rows):
            try:
                started = 0
                for wave in self.waves(mine):
                    started += len(wave)
                    self.status(f"step {step}: sampling {started}/{len(mine)} items")
                    generators = [self.generator(step, k) for k in wave]
                    turns = InProcessTurns(self.policy.model, cfg.sampling, self.eos_ids,
                                           lambda i, path, generators=generators: generators[i])
                    drawn, failed = sample_trajectories_turnwise(turns, self.tokenizer, self.env,
                                                                 [items[k] for k in wave], branching, cfg.sampling,
                                                                 limits, timings)
                    groups.update({wave[i]: trajectories for i, trajectories in drawn.items()})
                    errors += failed
            except Exception as e:  # noqa: BLE001 (re-raised on every rank: the others would wait)
                if self.ranks is None:
                    raise
                failure = e
        for error in errors:
            warnings.warn(f"step {step}: an item was skipped: {error}", RuntimeWarning, stacklevel=3)
        if self.ranks is not None:
            with self.ranks.waiting():
                raise_together(failure, "sampling the trajectories")
            parts = self.ranks.gather((groups, errors))
            errors = [e for _, part in parts for e in part]
            for part, _ in parts:
                groups.update(part)
        return groups, timings, errors


def base_weights(state: dict) -> dict:
    """A peft LoRA model's state dict -> its frozen base model's weights under the Hugging Face names a vLLM server
    loads (`base_model.model.` and `.base_layer` dropped, the adapters' `lora_*` left out)."""
    out = {}
    for name, value in state.items():
        if ".lora_" in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        out[name] = value
    return out
