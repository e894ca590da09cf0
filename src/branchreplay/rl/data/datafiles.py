"""Local data files, one row per record, as TRL's trainers take them: JSONL read line by line (each cell keeps its
JSON type, a bad line is named), JSON and Parquet offline through Hugging Face `datasets`. Used by the user's own
prompts (`tasks.TaskConfig.dataset`) and preference pairs (`preferences.py`)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def read_rows(path: str | Path, field: str, required: tuple[str, ...], hint: str = "") -> list[tuple[str, dict]]:
    """The rows of `path`, each as (where it is in the file, a dict of its columns), checked to hold the `required`
    columns. Where: "line N" of a JSONL file (the file's own 1-based line number, blank lines counted), "record N" of
    a JSON or Parquet file (1-based), for the messages of every later check.

    field: the config field that named the file (e.g. "task.dataset"), for the messages; hint: what the rows need,
    appended to the missing-column error. A `.jsonl` file is read line by line with the standard json module, so a
    cell keeps its JSON type (the string " 1." stays a string) and a bad line is named (`jsonl_rows`); `.json` and
    `.parquet` through Hugging Face datasets. Raises FileNotFoundError (no such file), ValueError (an unknown
    extension, a bad line, no rows, or missing columns: the message lists the columns found)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{field} {path} does not exist")
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{field} {path}: unknown format '{path.suffix}'; use {', '.join(FORMATS)}")
    if path.suffix.lower() == ".jsonl":
        numbered = [(f"line {n}", row) for n, row in jsonl_rows(path, field)]
    else:
        try:
            import datasets
        except ImportError as e:
            raise ValueError(f"{field} is read with Hugging Face datasets, which is not installed: pip install "
                             "datasets") from e
        with quiet_datasets():
            records = datasets.load_dataset(kind, data_files=str(path), split="train")
            numbered = [(f"record {n}", dict(row)) for n, row in enumerate(records, 1)]
    if not numbered:
        raise ValueError(f"{field} {path} has no rows{': ' + hint if hint else ''}")
    first = numbered[0][1]
    missing = [c for c in required if c not in first]
    if missing:
        raise ValueError(f"{field} {path} lacks the column(s) {', '.join(missing)} (it has "
                         f"{', '.join(first)}){': ' + hint if hint else ''}")
    for where, row in numbered:
        missing = [c for c in required if c not in row]
        if missing:
            raise ValueError(f"{field} {path} {where} lacks the column(s) {', '.join(missing)}")
    columns = list(dict.fromkeys(c for _, row in numbered for c in row))  # a cell a row lacks is None, as in datasets
    return [(where, {c: row.get(c) for c in columns}) for where, row in numbered]


def jsonl_rows(path: Path, field: str) -> list[tuple[int, dict]]:
    """(line number, row) of each non-blank line of a JSONL file. Raises ValueError naming the file and the line:
    not UTF-8, not valid JSON, not a JSON object, or a string with a lone surrogate (a \\ud800-\\udfff escape
    without its pair, which is not text)."""
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{field} {path} line {n} is not UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{field} {path} line {n} is not valid JSON: {e.msg} at column {e.colno}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{field} {path} line {n} holds a JSON {type(row).__name__}, not an object of "
                                 "columns")
            column = next((k for k, v in row.items() if not _is_text(v)), None)
            if column is not None:
                raise ValueError(f"{field} {path} line {n}, column {column!r}: a lone surrogate (a \\ud800-\\udfff "
                                 "escape without its pair) is not text")
            rows.append((n, row))
    return rows


def _is_text(value) -> bool:
    """Whether every string inside `value` (a JSON cell) encodes as UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, list):
        return all(_is_text(v) for v in value)
    if isinstance(value, dict):
        return all(_is_text(k) and _is_text(v) for k, v in value.items())
    return True


@contextlib.contextmanager
def quiet_datasets():
    """`datasets` without its progress bars while inside."""
    import datasets

    enabled = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            datasets.utils.logging.enable_progress_bar()
