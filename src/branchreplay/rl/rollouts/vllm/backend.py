"""The vLLM sampler back-end (sampling.backend vllm): a vLLM server draws a step's rollouts, with prefix caching, and
gets the policy's weights after every update. The same four answers as the in-process back-end
(`decode/in_process.py`): `groups`, `items`, `sync` and `keeps_logprobs` (always: the server's logprobs travel with
the batch and are compared with the run's own).

Under torchrun rank 0 alone talks to the server: it sends every group of the step at once (one server batches them
all and its prefix cache serves every rank's groups; one weight upload per update, where a server per rank would
take one each), and every rank receives what it drew. A server that fails raises `VLLMError` on every rank.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from ....decode.config import SamplingConfig
from ....decode.loop import branching_schedule
from ....engine.parallel.distributed import raise_together
from ....models import model_folder
from .client import VLLMClient, VLLMError
from .sampling import sample_trees

if TYPE_CHECKING:
    from ...config import Config
    from ...policy import Policy
    from ...run.parallel import Ranks


class VLLM:
    """The vLLM server samples (module docstring). `client`: the connected `VLLMClient` on rank 0, None on the
    others; `policy`: the trained `rl.policy.Policy` (its model's generation settings); `trajectories(turn, items=,
    timings=)`: the multi-turn driver, None for a single-turn run; `lora`: whether the policy is a LoRA model (its
    adapter alone is sent after the frozen base once)."""

    def __init__(self, client: VLLMClient | None, sampling: SamplingConfig, num_generations: int, policy: Policy,
                 eos_ids: set[int], trajectories=None, ranks: Ranks | None = None, lora: bool = False,
                 status=lambda text: None):
        self.client, self.sampling, self.G, self.policy = client, sampling, num_generations, policy
        self.eos_ids, self.trajectories, self.ranks, self.lora, self.status = eos_ids, trajectories, ranks, lora, status
        self.keeps_logprobs = True
        self.base_synced = False  # LoRA: whether the server holds this run's base weights (sent once per run)

    def sync(self, weights) -> float:
        """Send the policy's weights to the server: `weights()` gives the full state dict (under FSDP2 a collective:
        every rank calls `sync`), None when they did not change since the last sync. Returns the seconds it took
        (0 when nothing was sent). Raises VLLMError on every rank."""
        if weights is None:
            return 0.0
        self.status("syncing the weights to vLLM")
        state = weights()
        seconds, error = 0.0, None
        try:
            if self.client is not None and self.lora:  # the adapter alone (a few MB), after the frozen base once:
                if not self.base_synced:  # the server may hold another run's weights
                    seconds += self.client.sync_weights(base_weights(state), keep=False)
                    self.base_synced = True
                seconds += self.client.sync_adapter(self.policy.model, state)
            elif self.client is not None:
                seconds = self.client.sync_weights(state)
        except Exception as e:  # noqa: BLE001 (re-raised on every rank: the others wait for rank 0)
            if self.ranks is None:
                raise
            error = e
        if self.ranks is not None:  # every rank raises a VLLMError: the run then stops with a checkpoint
            raise_together(error, "the weight sync to vLLM", kinds=(VLLMError,))
        return seconds

    def groups(self, step: int, prompts: list[list[int]]) -> tuple[dict, tuple | None]:
        """Every group of the step, all in flight together, on rank 0: ({k: samples}, None), ({}, None) on the other
        ranks, or ({}, ("vllm", the error)) when the server failed under torchrun. Raises VLLMError in one process."""
        if self.client is None:
            return {}, None
        self.status(f"step {step}: sampling {len(prompts)} groups with vLLM")
        try:
            requests = [(p, branching_schedule(self.policy.model, p, self.G, self.sampling)) for p in prompts]
            groups = sample_trees(self.client, requests, self.sampling, self.eos_ids)
        except Exception as e:  # noqa: BLE001 (re-raised on every rank: the others wait for rank 0)
            if self.ranks is None:
                raise
            return {}, ("vllm", str(e)) if isinstance(e, VLLMError) else ("rank", f"rank 0: {type(e).__name__}: {e}")
        return dict(enumerate(groups)), None

    def items(self, step: int, items: list[dict]) -> tuple[dict, dict, list[str]]:
        """Every item's trajectories turn by turn, each turn's requests of every item in flight together, on rank 0;
        every rank receives them. Raises VLLMError (on every rank under torchrun) when the server failed."""
        groups, timings, errors, failure = {}, {"env_s": 0.0}, [], None
        if self.client is not None:
            self.status(f"step {step}: sampling {len(items)} items with vLLM")
            turn = lambda requests, keys: sample_trees(self.client, requests, self.sampling, self.eos_ids)  # noqa: E731
            try:
                groups, errors = self.trajectories(turn, items=items, timings=timings)
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


def connect(config: Config, tokenizer, ranks: Ranks | None) -> VLLMClient | None:
    """The vLLM server's client on rank 0 (it alone talks to the server); None on the others. Raises VLLMError
    on every rank when it cannot connect."""
    s, client, error = config.sampling, None, None
    if ranks is None or ranks.rank == 0:
        try:
            client = VLLMClient.connect(s.vllm_url, model_folder(config.model.spec), tokenizer, s.vllm_timeout_s)
        except VLLMError as e:
            if ranks is None:
                raise
            error = e
    if ranks is not None:
        raise_together(error, "connecting to the vLLM server", kinds=(VLLMError,))
    return client


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
