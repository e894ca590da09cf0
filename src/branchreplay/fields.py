"""What every configuration dataclass shares: each field's help in its metadata, and the validation helpers that
name the field and its accepted values (`branchreplay.rl.config` composes the sections and parses them)."""

from __future__ import annotations

import difflib
import typing


def help_of(text: str) -> dict:
    """A field's metadata holding its help (default, unit and range in words): `field(default=..., metadata=
    help_of("..."))`. The command's --help prints it; nothing else documents the field twice."""
    return {"help": text}


def accepted(kind) -> tuple:
    """The values of a closed choice: a `typing.Literal[...]` or a tuple of values."""
    return typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else tuple(kind)


def choice(name: str, value, kind) -> None:
    """Raise ValueError naming `name` and the accepted values unless `value` is one of `kind` (Literal or tuple)."""
    values = accepted(kind)
    if value not in values:
        raise ValueError(f"{name}={value!r} is not valid; accepted values: {', '.join(map(str, values))}")


def check(name: str, ok: bool, expected: str, value) -> None:
    """Raise ValueError naming `name`, its value and the range it must be in (`expected`, e.g. ">= 1") unless ok."""
    if not ok:
        raise ValueError(f"{name}={value!r} is out of range; it must be {expected}")


def nearest(key: str, known: list[str]) -> str:
    """" (did you mean 'X'?)" for the closest of `known` to a misspelt `key` (difflib), or "" when none is close."""
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
