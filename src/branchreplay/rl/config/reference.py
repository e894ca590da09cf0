"""The config reference page: every field of every run-config section and of `EngineConfig` (the `engine` section),
with its type, default, accepted values, TRL's name where one maps, and its help, all read from the dataclasses'
fields and metadata (`fields.help_of`), the source `--help-all` prints too. docs/hooks/config_reference.py puts it,
and the TRL drop-ins' keywords (`trl.options.keywords_reference`, in the same table form), into
docs/reference/config.md when the site is built."""

from __future__ import annotations

import dataclasses

from .help import ALGORITHM_HELP
from .sections import SECTIONS
from .trl_names import TRL_NAMES
from .values import field_types, kind, plain

MARKER = "<!-- config-reference -->"
"""Where in docs/reference/config.md the generated tables go."""


def config_reference() -> str:
    """Markdown: one table per section (`--section.field`, type and default, TRL's name, help)."""
    trl = {}
    for name, target in TRL_NAMES.items():
        trl.setdefault(target, []).append(name)
    out = ["## algorithm", "", _table([("--algorithm", "`grpo`, `ppo`, `rloo`, `reinforce_pp`, `dpo` or "
                                        "`package.module:Class`; default `'grpo'`", "", ALGORITHM_HELP)])]
    for section, cls in SECTIONS.items():
        out += [f"## {section}", "", _summary(cls), "",
                _table([(f"--{section}.{f.name}", _type_and_default(cls, f),
                         ", ".join(f"`{n}`" for n in trl.get(f"{section}.{f.name}", ())), _help(f))
                        for f in dataclasses.fields(cls)])]
    return "\n".join(out)


def fields_table(cls, first: str = "keyword") -> str:
    """A markdown table of the dataclass `cls`'s fields by their own names: type and default, help."""
    return _table([(f.name, _type_and_default(cls, f), "", _help(f)) for f in dataclasses.fields(cls)], first)


def _summary(cls) -> str:
    """The first paragraph of the section class's docstring, on one line."""
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(doc.split())


def _type_and_default(cls, f) -> str:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return f"{_cell(kind(field_types(cls)[f.name]))}; default `{plain(default)!r}`"


def _help(f) -> str:
    return _cell(f.metadata.get("help", ""))


def _cell(text: str) -> str:
    """`text` inside a table cell: pipes escaped, on one line."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(rows, first: str = "option") -> str:
    lines = [f"| {first} | type and default | TRL name | meaning |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {tp} | {trl} | {text} |" for name, tp, trl, text in rows]
    return "\n".join(lines) + "\n"
