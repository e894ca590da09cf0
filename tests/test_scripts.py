"""Every script in scripts/ answers `--help` (usage, exit 0, nothing run) and names the docs page it feeds.

The scripts are the maintained tools and the reproducers of the result pages' tables; a script added to the folder
is covered without a change here. Their real runs take minutes to hours (a model, several processes, TRL's suites),
so this checks what rots first: that each still imports and parses its arguments against today's package, and that
the pages and sections its docstring names still exist."""

import ast
import concurrent.futures
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").iterdir() if p.suffix in {".py", ".sh"})
TIMEOUT_S = 180  # most import torch, transformers and the training side: seconds each, more on a busy machine


def _help(name: str) -> tuple[int, str]:
    command = [sys.executable if name.endswith(".py") else "bash", f"scripts/{name}", "--help"]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])})
    except subprocess.TimeoutExpired:
        return -1, f"no answer in {TIMEOUT_S} s"
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def helps() -> dict[str, tuple[int, str]]:
    """Each script's exit status and output for `--help`, run three at a time (their imports take seconds)."""
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        return dict(zip(SCRIPTS, pool.map(_help, SCRIPTS), strict=True))


def _docstring(name: str) -> str:
    """The module docstring of a Python script, the header comment of a shell script, whitespace collapsed."""
    text = (ROOT / "scripts" / name).read_text()
    if name.endswith(".py"):
        doc = ast.get_docstring(ast.parse(text)) or ""
    else:
        doc = "\n".join(line[1:] for line in text.splitlines()[1:] if line.startswith("#") and not line.startswith("#!")
                        ).split("\nset ")[0]
    return " ".join(doc.split())


def _headings(page: Path) -> list[str]:
    return [" ".join(line.lstrip("#").replace("`", "").split()) for line in page.read_text().splitlines()
            if line.startswith("#")]


def test_the_folder_holds_scripts_only():
    assert len(SCRIPTS) >= 15
    other = [p.name for p in (ROOT / "scripts").iterdir() if p.suffix not in {".py", ".sh"} and p.name != "__pycache__"]
    assert not other, other


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_prints_usage_and_exits_0(name, helps):
    code, out = helps[name]
    assert code == 0 and "usage" in out.lower(), f"scripts/{name} --help: exit {code}\n{out[-3000:]}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_docstring_names_the_page_it_feeds(name):
    """At least one docs page, each one there; a section named right after its page (`docs/<page>.md, "Section"` or
    `docs/<page>.md ("Section")`) is the start of one of that page's headings."""
    doc = _docstring(name)
    pages = re.findall(r"docs/[\w./-]+\.md", doc)
    assert pages, f"scripts/{name}'s docstring names no docs page"
    for page in pages:
        assert (ROOT / page).is_file(), f"scripts/{name} names {page}, which is not there"
    for page, section in re.findall(r"(docs/[\w./-]+\.md)(?:,| \() ?\"([^\"]+)\"", doc):
        headings = _headings(ROOT / page)
        assert any(h.startswith(section.replace("`", "")) for h in headings), \
            f"scripts/{name} names the section \"{section}\" of {page}, which has none: {headings}"
