"""Local data files read offline through Hugging Face `datasets`: JSONL, JSON or Parquet, one row per record, as
TRL's trainers take them. Used by the user's own prompts (`tasks.TaskConfig.dataset`) and preference pairs
(`preferences.py`)."""

from __future__ import annotations

import contextlib
from pathlib import Path

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def read_rows(path: str | Path, field: str, required: tuple[str, ...], hint: str = ""):
    """The rows of `path` as a `datasets.Dataset`, checked to have the `required` columns.

    field: the config field that named the file (e.g. "task.dataset"), for the messages; hint: what the rows need,
    appended to the missing-column error. Raises FileNotFoundError (no such file), ValueError (an unknown extension,
    or missing columns: the message lists the columns found)."""
    try:
        import datasets
    except ImportError as e:
        raise ValueError(f"{field} is read with Hugging Face datasets, which is not installed: pip install "
                         "datasets") from e
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{field} {path} does not exist")
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{field} {path}: unknown format '{path.suffix}'; use {', '.join(FORMATS)}")
    with quiet_datasets():
        rows = datasets.load_dataset(kind, data_files=str(path), split="train")
    missing = [c for c in required if c not in rows.column_names]
    if missing:
        raise ValueError(f"{field} {path} lacks the column(s) {', '.join(missing)} (it has "
                         f"{', '.join(rows.column_names)}){': ' + hint if hint else ''}")
    return rows


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
