"""What a user's data must hold where it enters the run, checked in one place: the text columns of a data file
(prompts, answers, preference pairs) and the chat messages of a conversational row or of an environment's reply.
Each error names where the value came from (file, row, column; or environment, method, message), what it was, and
what it must be, before any tokenizer or chat template sees it."""

from __future__ import annotations

from collections.abc import Iterable


def check_messages(messages, what: str) -> None:
    """Raise ValueError naming `what` (e.g. "step's", "task.dataset x.jsonl row 3, column 'prompt':") and the field
    unless `messages` is a list of {"role": a non-empty string, "content": a string, or the structured content chat
    templates take: a list of {"type": "text", "text": a string}, or None beside "tool_calls"} (what the chat
    template renders and the conversation tokenizes)."""
    if not isinstance(messages, list):
        raise ValueError(f"{what} gave a {type(messages).__name__}, not a list of messages")
    for k, m in enumerate(messages):
        where = f"{what} message {k}"
        if not isinstance(m, dict):
            raise ValueError(f"{where} is a {type(m).__name__}, not a {{role, content}} dict")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"{where} has 'role' {m.get('role')!r}: a message's role is a string such as 'user'")
        content = m.get("content")
        structured = isinstance(content, list) and all(
            isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content)
        tool_call = content is None and bool(m.get("tool_calls"))  # an assistant's call: chat templates take it
        if not (isinstance(content, str) or structured or tool_call):
            raise ValueError(f"{where} has 'content' {brief(content)} (a {type(content).__name__}): a message's "
                             "content is a string, or a list of {'type': 'text', 'text': ...} parts")


def check_columns(rows: Iterable[tuple[str, dict]], source: str, text: Iterable[str] = (),
                  answers: Iterable[str] = ()) -> None:
    """Every row's `text` columns hold text: a non-empty string, or a non-empty list of chat messages
    (`check_messages`: TRL's conversational format); its `answers` columns a non-blank string or a number (what the
    built-in rewards compare with; a user's reward function gets its columns as they are, as in TRL). `rows`: (where,
    row) pairs of `datafiles.read_rows` ("line 4" of a JSONL file, 1-based); `source`: the config field and the file,
    e.g. "dpo.dataset pairs.jsonl".

    Raises:
        ValueError: "<source> line n, column 'c': ..." with the value found (`chosen: 42`, `prompt: null`, a list of
            numbers), or "... is empty; remove the row or fill it".
    """
    text, answers = tuple(text), tuple(answers)
    for where, row in rows:
        for column in text:
            _check_text(row[column], f"{source} {where}, column {column!r}")
        for column in answers:
            value = row[column]
            if not (isinstance(value, str) or _is_number(value)):
                raise ValueError(f"{source} {where}, column {column!r} holds {brief(value)} (a "
                                 f"{type(value).__name__}): an answer is a string or a number; fix the row or remove "
                                 "it")
            if isinstance(value, str) and not value.strip():
                raise ValueError(f"{source} {where}, column {column!r} is empty: the reward has no answer to compare "
                                 "with; fill it or remove the row")


def _check_text(value, where: str) -> None:
    if isinstance(value, list) and value:
        check_messages(value, f"{where}:")
    elif not isinstance(value, (str, list)):
        raise ValueError(f"{where} holds {brief(value)} (a {type(value).__name__}): it must be text, a string or a "
                         "list of {role, content} messages (TRL's conversational format); fix the row or remove it")
    elif not value:
        raise ValueError(f"{where} is empty; remove the row or fill it")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def brief(value) -> str:
    """repr(value), cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
