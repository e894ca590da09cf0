"""Exact token bookkeeping of a multi-turn trajectory: its ids are built turn by turn and never re-tokenized.

    conv = Conversation.start(tokenizer, opening_messages)        # the chat template's prompt ids
    conv.add_assistant(sampled_ids, text)                         # the ids as sampled (end-of-turn included)
    conv.add_environment(tokenizer, [{"role": "tool", ...}])      # the template's delta for these messages

An assistant turn enters as the token ids the sampler drew, so the training logprobs are of the tokens that were
sampled (decoding and re-tokenizing a conversation silently changes them: BPE merges differ). An environment turn
(tool results, user feedback) enters as the ids the chat template renders for it after an assistant turn, up to and
including the next generation prompt, computed as TRL 1.16's GRPOTrainer `_get_tool_suffix_ids` does
(`message_delta_ids`), exact for a prefix-stable template. The loss mask is 1 on assistant tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...models import chat_prompt_ids

DUMMY = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]


class TemplateNotPrefixStableError(ValueError):
    """The chat template renders a conversation's earlier turns differently once more messages follow."""


def template_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def message_delta_ids(tokenizer, messages: list[dict], end_of_turn: int | None = None,
                      tools: list[dict] | None = None) -> list[int]:
    """The token ids the chat template puts after an assistant turn's end-of-turn token for `messages` (e.g. a
    tool result, a user reply), the next assistant generation prompt included.

    Computed as TRL 1.16's GRPOTrainer `_get_tool_suffix_ids` does: the template's rendering of a dummy conversation
    ending with an assistant turn, cut after its last end-of-turn token, against the same conversation with the new
    messages and the generation prompt. That is exact when the template is prefix-stable (it renders earlier
    messages the same whatever follows); a template that is not is refused by name.

    end_of_turn: the id that ends an assistant turn (default: the tokenizer's EOS); tools: the JSON schemas the
    conversation was started with, for a template that renders them (`models.chat_prompt_ids`). Raises
    TemplateNotPrefixStableError (naming the template) when the conversation with `messages` does not start with the
    rendering without them, ValueError for empty `messages`."""
    if not messages:
        raise ValueError("message_delta_ids needs at least one message")
    end = tokenizer.eos_token_id if end_of_turn is None else end_of_turn
    prefix = chat_prompt_ids(tokenizer, DUMMY, add_generation_prompt=False, tools=tools)
    ends = [i for i, t in enumerate(prefix) if t == end]
    if ends:  # "...<|im_end|>\n": the turn ends at its end-of-turn token, the template's newline belongs to the delta
        prefix = prefix[: ends[-1] + 1]
    full = chat_prompt_ids(tokenizer, DUMMY + list(messages), add_generation_prompt=True, tools=tools)
    if full[: len(prefix)] != prefix:
        raise TemplateNotPrefixStableError(
            f"the chat template of {template_name(tokenizer)} renders an assistant turn differently once "
            f"{[m.get('role') for m in messages]} messages follow it, so a multi-turn trajectory's ids cannot be "
            "built turn by turn; use a prefix-stable template (the model's own usually is: check it with "
            "rl.agent.conversation.message_delta_ids)")
    return full[len(prefix):]


def template_renders_tools(tokenizer, tools: list[dict]) -> bool:
    """Whether the chat template has tool support: passing `tools` (JSON schemas) changes its rendering and names
    the first tool (Qwen2.5's, Llama 3.1's, Hermes'); SmolLM2's ignores them."""
    messages = [{"role": "user", "content": "dummy"}]
    try:
        with_tools = tokenizer.apply_chat_template(messages, tokenize=False, tools=tools)
    except Exception:  # noqa: BLE001 (a template or a tokenizer without the argument: no tool support)
        return False
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    return with_tools != plain and tools[0]["function"]["name"] in with_tools


@dataclass
class Conversation:
    """One trajectory: its messages, token ids [T] and loss mask [T] (1.0 on assistant tokens), and which turn each
    token belongs to (`turn_starts`: the index in `ids` where each assistant turn begins)."""

    messages: list[dict]
    ids: list[int]
    loss_mask: list[float]
    turn_starts: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, tokenizer, messages: list[dict], tools: list[dict] | None = None) -> Conversation:
        """The opening messages (system, user) rendered with the generation prompt; `tools` (JSON schemas) go to a
        template that renders tools itself."""
        ids = chat_prompt_ids(tokenizer, messages, tools=tools)
        return cls(list(messages), ids, [0.0] * len(ids))

    def add_assistant(self, sampled_ids: list[int], text: str) -> None:
        """An assistant turn: `sampled_ids` exactly as sampled (its end-of-turn token included when it ended),
        `text` their decoding (kept in `messages` for the environment and the chat template)."""
        if not sampled_ids:
            raise ValueError("an assistant turn needs at least one sampled token")
        self.turn_starts.append(len(self.ids))
        self.ids += list(sampled_ids)
        self.loss_mask += [1.0] * len(sampled_ids)
        self.messages.append({"role": "assistant", "content": text})

    def add_environment(self, tokenizer, messages: list[dict], end_of_turn: int | None = None,
                        tools: list[dict] | None = None) -> None:
        """The environment's messages after an assistant turn, as the template's delta (`message_delta_ids`, with
        the `tools` the conversation started with), loss mask 0. The last assistant turn must have ended with its
        end-of-turn token."""
        end = tokenizer.eos_token_id if end_of_turn is None else end_of_turn
        if not self.turn_starts or self.ids[-1] != end:
            raise ValueError("environment messages follow a finished assistant turn (its last token the "
                             f"end-of-turn id {end}); a truncated turn ends the trajectory")
        delta = message_delta_ids(tokenizer, messages, end, tools)
        self.ids += delta
        self.loss_mask += [0.0] * len(delta)
        self.messages += list(messages)
