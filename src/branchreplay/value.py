"""The value model (critic) of PPO: a causal LM's decoder with a scalar head, V(prefix) at every position.

As TRL's PPOTrainer (trl 0.24, trl/trainer/ppo_trainer.py; PPO left TRL in 1.x), the critic is a SEPARATE model
initialised from the policy, with a scalar head `score` (TRL: an `AutoModelForSequenceClassification` with
num_labels=1, `model.score(backbone(ids).hidden_states[-1])`, trl/trainer/utils.py `get_reward`), so the value loss
never moves the policy and vf_coef means what it means in TRL. The value of response token t is read from the hidden
state that predicts it (position t - 1), as TRL's `full_value[:, context_length - 1 : -1]`: over a prefix tree every
unique position has ONE value, shared by the rollouts through it, like its logprob. `ValueModel` wraps any decoder
the engine runs; TRL's critic works as well (`is_value_model` recognises both).
Design notes: docs/algorithms.md ("PPO's critic").
"""

from __future__ import annotations

import copy

import torch

from .models import base_decoder


class ValueModel(torch.nn.Module):
    """A critic: `decoder` (a causal LM's base model, e.g. `LlamaModel`) and `score`, Linear(hidden_size, 1, no bias).

    forward(input_ids [B, S]) -> values [B, S] in the decoder's dtype: V of the prefix ending at each position.
    The attribute names follow transformers' ForSequenceClassification (base_model_prefix, score), which is what the
    engine and TRL's `get_reward` read.
    """

    def __init__(self, decoder: torch.nn.Module, config, base_model_prefix: str = "model"):
        super().__init__()
        self.config = config
        self.base_model_prefix = base_model_prefix
        setattr(self, base_model_prefix, decoder)
        self.score = torch.nn.Linear(config.hidden_size, 1, bias=False)

    @classmethod
    def from_policy(cls, policy, seed: int = 0) -> ValueModel:
        """A critic whose decoder is a copy of `policy`'s (a Hugging Face causal LM) and whose head is drawn from
        N(0, config.initializer_range) with `seed`, as transformers initialises a fresh `score`; same dtype and device
        as the policy. The policy is left unchanged."""
        prefix = policy.base_model_prefix
        decoder = copy.deepcopy(base_decoder(policy))
        critic = cls(decoder, decoder.config, prefix)  # one config object: the decoder's
        head = critic.score.weight
        std = float(getattr(policy.config, "initializer_range", 0.02))
        with torch.no_grad():
            head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(seed)) * std)
        return critic.to(device=policy.device, dtype=policy.dtype)

    @property
    def decoder(self) -> torch.nn.Module:
        return getattr(self, self.base_model_prefix)

    @property
    def device(self) -> torch.device:
        return self.score.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.score.weight.dtype

    def set_attn_implementation(self, implementation) -> None:
        """transformers' switch of the attention implementation, on the decoder (whose config this is)."""
        self.decoder.set_attn_implementation(implementation)

    def get_output_embeddings(self):
        """None: a critic has no LM head (as a ForSequenceClassification model)."""
        return None

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        hidden = self.decoder(input_ids=input_ids, **kwargs).last_hidden_state
        return self.score(hidden).squeeze(-1)


def is_value_model(model) -> bool:
    """Whether `model` is a critic: a scalar `score` head and no LM head (`ValueModel`, or a Hugging Face
    ForSequenceClassification with num_labels=1)."""
    score = getattr(model, "score", None)
    return (isinstance(score, torch.nn.Linear) and score.out_features == 1
            and model.get_output_embeddings() is None)


def check_critic(critic, policy) -> None:
    """Refuse a critic that cannot score the policy's rollouts.

    Raises ValueError naming the field: a critic without a scalar head, of another architecture (model_type) or
    with another vocabulary size than the policy (its embeddings would read other tokens than were sampled)."""
    if not is_value_model(critic):
        raise ValueError(f"the critic ({type(critic).__name__}) has no scalar value head: pass a "
                         "branchreplay.value.ValueModel or an AutoModelForSequenceClassification with num_labels=1")
    c, p = critic.config, policy.config
    if c.model_type != p.model_type:
        raise ValueError(f"ppo.value_model is a {c.model_type} model and the policy a {p.model_type} one: the critic "
                         "must be of the policy's architecture (leave ppo.value_model empty to copy the policy)")
    if c.vocab_size != p.vocab_size:
        raise ValueError(f"ppo.value_model has a vocabulary of {c.vocab_size} tokens and the policy {p.vocab_size}: "
                         "the critic must read the policy's token ids (same tokenizer)")
