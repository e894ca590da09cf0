"""The policy as the training side runs it: a model together with everything an engine call needs, so that the
algorithms call `logprobs`, `backward` and `function_backward` and never pass a temperature, an engine section or
a family check around.

`Policy` holds the model (a causal LM, or PPO's critic), the temperature its logprobs are taken at, the `engine`
section, train.method, the micro-batch size, mixed precision and, under torchrun, its `DataParallel` and `Ranks`;
once the run builds it, its AdamW and learning-rate schedule. The reference policy of the KL term and DPO, and PPO's
critic, are Policies built from the policy (`sibling`). train.method picks how the logprobs and gradients are
computed (`Policy.tree_backward`: branchreplay, naive or padded), all three equal to floating-point tolerance. Every
engine call takes the policy's one `ReplayOptions` (`options`): the argument list from here to the engine is one
object, not names passed down level by level.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from ..engine import sequence
from ..engine.config import EngineConfig
from ..engine.options import ReplayOptions
from ..engine.parallel.context_parallel import ContextParallelTree
from ..engine.parallel.distributed import DataParallel, clip_grad_norm_
from ..engine.parallel.lockstep import collective_device
from ..engine.replay import replay_with
from ..models import autocast, tied_names
from ..reference.methods import METHODS
from ..tree import ReplayResult, Rollout, RolloutTree, TreeStats

if TYPE_CHECKING:
    from .run.parallel import Ranks
    from .shards import Shards

SCHEDULES = {"cosine": get_cosine_schedule_with_warmup, "linear": get_linear_schedule_with_warmup,
             "constant": get_constant_schedule_with_warmup}


@dataclass
class Policy:
    """A model and how the engine runs it (module docstring).

    model: a Hugging Face causal LM (a peft model for LoRA), or a critic (`value.ValueModel`).
    temperature: logprobs are of softmax(logits / temperature), the sampler's (1.0 for DPO and a critic).
    engine: the run's `EngineConfig`. method: "branchreplay", "naive" or "padded". trusted: run an unregistered
    family unchecked (the trainer checked it, `run/family.py`). micro_batch: trees per engine call in `backward`
    (0 = all at once). dtype: the run's model.dtype ("bfloat16": the forwards under autocast). dp: its
    `DataParallel` under torchrun, else None. ranks: the run's `rl.run.parallel.Ranks`, else None. scope: a context
    every forward runs in (LoRA's reference: the adapter off). optimizer, scheduler: AdamW and its schedule
    (`make_optimizer`), None for a frozen policy. version: the optimizer updates taken (`step`), which a sampler
    reads to know when its copy of the weights is old.
    """

    model: torch.nn.Module
    temperature: float = 1.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    method: str = "branchreplay"
    trusted: bool = False
    micro_batch: int = 0
    dtype: str = "float32"
    dp: DataParallel | None = None
    ranks: Ranks | None = None
    scope: object = contextlib.nullcontext
    optimizer: torch.optim.Optimizer | None = None
    scheduler: object | None = None
    version: int = 0

    def sibling(self, model: torch.nn.Module, temperature: float | None = None, scope=contextlib.nullcontext
                ) -> Policy:
        """Another model run as this one is (engine, method, trust, micro-batching, dtype, ranks), without data
        parallelism or optimizer until given (`distribute`, `make_optimizer`): the reference policy, a critic."""
        return replace(self, model=model, temperature=self.temperature if temperature is None else temperature,
                       dp=None, scope=scope, optimizer=None, scheduler=None, version=0)

    def distribute(self, strategy: str, mode: str | None, broadcast: bool = True) -> None:
        """Make the model data-parallel over the ranks (`engine.parallel.distributed.DataParallel`): "fsdp2" in FSDP2
        `mode` ("gather-once" or "resharded"), or "ddp". Every rank calls it with the same model configuration."""
        self.dp = DataParallel(self.model, strategy, device=self.model.device.type, broadcast=broadcast,
                               mode=mode or "gather-once")

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The trained parameters (after `distribute`, FSDP2's sharded ones)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def make_optimizer(self, grpo, total_updates: int) -> None:
        """AdamW over `params` with the grpo section's learning rate and weight decay, and its schedule
        (grpo.lr_scheduler, grpo.warmup_steps, decaying over `total_updates` optimizer updates), stepped once per
        update. Data-parallel: foreach off (FSDP2's DTensors and plain tensors cannot share one foreach kernel)."""
        self.optimizer = torch.optim.AdamW(self.params, lr=grpo.learning_rate, weight_decay=grpo.weight_decay,
                                           **({} if self.dp is None else {"foreach": False}))
        extra = {"num_training_steps": total_updates} if grpo.lr_scheduler != "constant" else {}
        self.scheduler = SCHEDULES[grpo.lr_scheduler](self.optimizer, num_warmup_steps=grpo.warmup_steps, **extra)

    def continue_schedule(self) -> None:
        """After a checkpoint's optimizer and scheduler states were loaded: the next update's learning rate is this
        schedule's (built for this run's train.steps) at the checkpoint's step, where the optimizer's saved one was
        the schedule's of the run that wrote it (the same when train.steps did not change)."""
        with warnings.catch_warnings():  # torch warns of a schedule step before any optimizer step: none is skipped
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.last_epoch -= 1
            self.scheduler.step()

    def zero_grad(self) -> None:
        """Zeros, not None: AdamW then moves every parameter, as TRL's."""
        for p in self.params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()

    def step(self) -> None:
        """One optimizer update and one step of its schedule: the weights' next `version`."""
        self.optimizer.step()
        self.scheduler.step()
        self.version += 1

    def full_state_dict(self) -> dict:
        """The model's weights unsharded, a tied weight under each of its names (what a vLLM server loads). Under
        FSDP2 a collective that every rank calls, complete on rank 0."""
        if self.dp is None or self.dp.strategy != "fsdp2":
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        state.update({name: state[kept] for name, kept in tied_names(self.model).items() if kept in state})
        return state

    def autocast(self):
        """The forwards' mixed precision (`models.autocast`)."""
        return autocast(self.dtype, self.model.device.type)

    def gathered(self):
        """The FSDP2 layers' full parameters while inside (sampling and forwards outside the engine's step)."""
        return self.dp.gathered() if self.dp is not None else contextlib.nullcontext()

    @property
    def lockstep(self) -> bool:
        """FSDP2 resharded: every engine call runs in lock-step with the other ranks (`engine/parallel/lockstep.py`)."""
        return self.dp is not None and self.dp.lockstep

    def options(self, final_backward=None) -> ReplayOptions:
        """The engine's options of this policy's calls; `final_backward` wraps the call's last backward."""
        return ReplayOptions(self.temperature, self.engine, self.trusted, self.lockstep, final_backward)

    # -- the engine calls -------------------------------------------------------------------------------------------

    def logprobs(self, trees: list) -> ReplayResult:
        """Per-rollout logprobs and entropies (a critic's values) of `trees`, without a graph. Under torchrun every
        rank calls it (`trees` possibly empty): FSDP2 resharded in lock-step, else with the parameters gathered."""
        with contextlib.nullcontext() if self.lockstep else self.gathered(), self.autocast(), self.scope():
            return self.tree_logprobs(trees)

    def backward(self, trees: list, loss) -> ReplayResult:
        """Forward and backward of `loss` over `trees` in micro-batches; gradients accumulate in `param.grad`.
        Under torchrun (every rank calls it, `trees` this rank's, possibly none): the gradient is reduced once over
        the ranks, and the loss and the loss's statistics (`losses.LossStats`) are summed over them, so every rank
        returns the step's totals."""
        if self.dp is None:
            with self.autocast(), self.scope():
                return self.accumulate(trees, loss)
        work = trees or [idle_tree()]  # a rank without rollouts still joins the one reduction
        with self.dp.accumulate(), self.autocast(), self.scope():
            result = self.accumulate(work, loss, final_backward=self.dp.final_sync())
        if not trees:
            result = ReplayResult([], [], 0.0, result.stats)
        self.dp.reduce_replicated()
        stats = getattr(loss, "stats", None)
        totals = self.ranks.sum([result.loss, *(stats.totals() if stats is not None else [])])
        result.loss = totals[0]
        if stats is not None:
            stats.set_totals(totals[1:])
        return result

    def function_backward(self, shards: Shards, loss, first: tuple[list, list] | None = None
                          ) -> tuple[float, list[torch.Tensor], list[torch.Tensor], ReplayResult]:
        """The exact gradient of `loss`(logprobs, entropies) of every rollout of the step (`shards.rollouts`: a loss
        that couples a rollout's tokens, or the rollouts: GSPO, RLOO, DPO) in two passes (`engine.sequence`): pass 1
        on this rank's trees, its values gathered to every rank (`Shards.everywhere`), or `first`, those values
        (logprobs, entropies per rollout of `shards.rollouts`) from a pass under the current weights; the
        coefficients g = dL/dlogp and h = dL/dH from them on every rank alike; then pass 2, the linear loss over this
        rank's trees (`backward`). Returns (the loss value, the logprobs and entropies of pass 1, pass 2's result,
        whose loss is set to the loss value)."""
        if first is None:
            result = self.logprobs(shards.local)
            first = shards.everywhere(result.logprobs), shards.everywhere(result.entropy)
        logprobs, entropy = first
        value, g, h = sequence.function_coefficients(loss, logprobs, entropy)
        result = self.backward(sequence.linear_trees(shards.local, shards.mine(g), shards.mine(h)),
                               sequence.linear_loss)
        result.loss = value
        return value, logprobs, entropy, result

    def accumulate(self, trees: list, loss, final_backward=None) -> ReplayResult:
        """`tree_backward` over consecutive micro-batches of `micro_batch` trees (0 = all at once); gradients
        accumulate in param.grad. `final_backward` (data parallelism: the gradient sync) wraps the last
        micro-batch's last backward. In lock-step (FSDP2 resharded) every rank makes as many calls as the rank with
        the most micro-batches of whole trees, the missing ones empty, and runs its context-parallel parts (which the
        ranks run together; the sharding puts them last) in its last call. Returns the results merged
        (`ReplayResult.merge`)."""
        size = self.micro_batch or len(trees) or 1
        whole = [t for t in trees if not isinstance(t, ContextParallelTree)] if self.lockstep else trees
        calls = [whole[i : i + size] for i in range(0, len(whole), size)] or [[]]
        if self.lockstep:  # one small collective: the ranks' numbers of micro-batches
            count = torch.tensor([len(calls)], device=collective_device())
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            calls += [[] for _ in range(int(count) - len(calls))]
            calls[-1] = calls[-1] + [t for t in trees if isinstance(t, ContextParallelTree)]
        return ReplayResult.merge([self.tree_backward(part, loss, final_backward if k == len(calls) - 1 else None)
                                   for k, part in enumerate(calls)])

    def tree_backward(self, trees: list, loss, final_backward=None) -> ReplayResult:
        """Forward and backward of `loss` over `trees` by train.method (`method`); gradients accumulate into
        `param.grad`. Same result and errors as `engine.replay_backward` (`final_backward`: branchreplay only).

        The methods, all three equal to floating-point tolerance, so that two runs of one config and seed that
        differ only in the method train the same model (scripts/compare_methods.py, docs/convergence.md):

            branchreplay  the execution stack over the prefix tree (`engine.replay_with`): each unique position once.
            naive         each rollout alone, unpadded, through the unmodified Hugging Face forward
                          (`reference.naive`): the reference every exactness test compares with.
            padded        TRL's padded batch: prompts left-padded, completions right-padded, one [B, T_max] forward
                          and backward (`reference.padded`). Both are looked up in `reference.methods.METHODS`.

        The two references run token-level losses of whole rollouts (GRPO, REINFORCE++, PPO's policy and, naive,
        its critic): `Config` refuses the rest."""
        if self.method == "branchreplay":
            return replay_with(self.model, trees, loss, self.options(final_backward))
        self._no_lockstep()
        return _reference(trees, lambda rollouts: METHODS[self.method].backward(self.model, rollouts, loss,
                                                                                temperature=self.temperature))

    def tree_logprobs(self, trees: list) -> ReplayResult:
        """Per-rollout logprobs and entropies (a critic's values) of `trees` without a graph, by `method`; as
        `engine.replay_logprobs`."""
        if self.method == "branchreplay":
            return replay_with(self.model, trees, None, self.options())
        self._no_lockstep()
        return _reference(trees, lambda rollouts: METHODS[self.method].logprobs(self.model, rollouts,
                                                                                temperature=self.temperature))

    def _no_lockstep(self) -> None:
        if self.lockstep:
            raise ValueError(f"train.method={self.method!r} does not run FSDP2's resharded mode (its lock-step is the "
                             "engine's): use parallel.fsdp_mode gather-once, or train.method branchreplay")


def clip_grad_norm(policies: list[Policy], max_norm: float) -> float:
    """Clip the gradients of every parameter of `policies` together to a total L2 norm of `max_norm` (TRL's one
    optimizer over policy and critic); returns the norm before clipping. One process: torch's `clip_grad_norm_`;
    data-parallel: over the whole models (`engine.parallel.distributed.clip_grad_norm_`)."""
    if all(p.dp is None for p in policies):
        return torch.nn.utils.clip_grad_norm_([q for p in policies for q in p.params], max_norm).item()
    return clip_grad_norm_([p.dp for p in policies], max_norm)


def idle_tree() -> RolloutTree:
    """Two tokens with zero loss weight: the backward of a rank that has no rollouts this step (fewer trained
    rollouts than ranks) runs through every layer and joins the gradient reduction with zeros (a policy's loss or
    a critic's: it carries every per-position field)."""
    zeros = [0.0, 0.0]
    return RolloutTree([Rollout([0, 0], [0, 1], advantages=0.0, weights=zeros, old_logprobs=zeros,
                                ref_logprobs=zeros, returns=zeros, old_values=zeros)])


def _reference(trees: list, run) -> ReplayResult:
    """`run` (a `reference.methods` method) on the trees' rollouts, with the trees' sizes as its stats."""
    if not trees:
        return ReplayResult([], [], 0.0, TreeStats(0, 0, 0, 0, 0))
    stats = sum((t.stats for t in trees[1:]), trees[0].stats)
    result = run([r for t in trees for r in t.rollouts])
    result.stats = stats  # the tree's sizes (what branchreplay would have run), as every method logs them
    return result
