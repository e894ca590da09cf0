"""Command-line and YAML values for the config's fields: `apply_overrides` (`--section.field value`) and the
coercion of a value to its field's declared type. Torch-free."""

from __future__ import annotations

import types
import typing
from typing import Literal

import yaml

from ...fields import accepted, choice, nearest
from .sections import SECTIONS
from .trl_names import TRL_NAMES

TRL_COMMAND_LINE = "_trl_names_from_the_command_line"  # apply_overrides -> Config.from_dict, never in a file
MOVED = {("engine", "method"): "train", ("engine", "unknown_family"): "train"}
"""Keys that moved to another section ((old section, key): new section); the files of earlier runs are read with
them in their new place (`run._moved_keys`)."""


def moved(section: str, key: str) -> str:
    """" (it is now train.method)" for a key of `MOVED`, else ""."""
    new = MOVED.get((section, key))
    return f" (it is now {new}.{key})" if new else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `--section.field value` / `--section.field=value` (and `--algorithm NAME`) arguments to {section:
    {field: value}} (a copy).

    Raises ValueError for an argument that is not of that form, a missing value, or an unknown section or key."""
    for k, v in data.items():
        if k in SECTIONS and v is not None and not isinstance(v, dict):
            raise ValueError(f"config section '{k}' must be a mapping, got {v!r}")
    data = {k: dict(v or {}) if k in SECTIONS else v for k, v in data.items()}  # others: algorithm, TRL names
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if arg.split("=", 1)[0] == "--algorithm":
            key, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(overrides):
                    raise ValueError("--algorithm needs a value")
                value, i = overrides[i + 1], i + 1
            data["algorithm"] = value
            i += 1
            continue
        flat = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if flat in TRL_NAMES:  # TRL's flat name, e.g. --learning_rate 1e-5 (from_dict maps it; it wins)
            key, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(overrides):
                    raise ValueError(f"--{key} needs a value")
                value, i = overrides[i + 1], i + 1
            data.setdefault(TRL_COMMAND_LINE, {})[key] = yaml.safe_load(value)
            i += 1
            continue
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ValueError(f"unexpected argument '{arg}'{nearest(arg.split('=', 1)[0], _option_names())}: "
                             f"overrides look like --section.field=value (sections: {', '.join(SECTIONS)})")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(overrides):
                raise ValueError(f"--{key} needs a value")
            value, i = overrides[i + 1], i + 1
        section, _, name = key.partition(".")
        if section not in SECTIONS:
            raise ValueError(f"unknown config section '{section}' in --{key}{nearest('--' + key, _option_names())}; "
                             f"valid sections: {', '.join(SECTIONS)}")
        hints = field_types(SECTIONS[section])
        if name not in hints:
            raise ValueError(f"unknown key '{key}'{moved(section, name) or nearest(name, list(hints))}; valid keys "
                             f"of '{section}': "
                             f"{', '.join(hints)}")
        data.setdefault(section, {})[name] = parse_cli(value, hints[name])
        i += 1
    return data


def _option_names() -> list[str]:
    """Every option `train` and `eval` take, for the nearest one to a misspelt option."""
    fields = [f"--{section}.{name}" for section, cls in SECTIONS.items() for name in field_types(cls)]
    return ["--algorithm", "--config", "--resume", "--checkpoint", "--threads", *fields,
            *(f"--{name}" for name in TRL_NAMES)]


def field_types(cls: type) -> dict[str, type]:
    return typing.get_type_hints(cls)


def kind(tp) -> str:
    """A field type for people: `int`, `float | None`, `one of 'keep', 'replay', 'auto'`."""
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(v) for v in accepted(tp))
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def parse_cli(text: str, tp) -> object:
    """A command-line string for a field of type `tp`: strings stay strings (an optional string too, unless it is
    YAML's null: empty, `null` or `~`), so text that looks like YAML (a JSON tool schema as task.system_prompt) is
    kept as written; everything else is read as YAML."""
    if tp is str:
        return text
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and set(typing.get_args(tp)) == {str, type(None)}:
        return None if text.strip() in ("", "null", "Null", "NULL", "~") else text
    return yaml.safe_load(text)


def coerce(value, tp, name: str):
    """`value` as type `tp` (int, float, bool, str, X | None, tuple/list/dict); ValueError naming the field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        choice(name, value, tp)
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return coerce(value, tp, name)
    try:
        if tp is bool:
            if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
                return value.lower() in ("true", "yes", "1")
            if isinstance(value, bool):
                return value
        elif tp is int and not isinstance(value, bool):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        elif tp is float and not isinstance(value, bool):
            return float(value)  # also "1e-6", which YAML 1.1 reads as a string
        elif tp is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        elif (origin or tp) in (tuple, list) and isinstance(value, (list, tuple)):
            return value  # the section's __post_init__ normalises and checks the items
        elif (origin or tp) is dict and isinstance(value, dict):
            return value
    except (TypeError, ValueError):
        pass
    kind = getattr(tp, "__name__", str(tp))
    accepted = "; accepted values: true, false (also yes, no, 1, 0)" if tp is bool else ""
    raise ValueError(f"{name}={value!r} is not a valid {kind}{accepted}")


def plain(x):
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x
