"""The docs site holds pages and the pictures they show, no raw data: results live in results/<topic>/, and the
pages' links to them (and to any file outside docs/) go through docs/hooks/repository_links.py, which points them
at the repository and warns (fails `mkdocs build --strict`) on a file that is not there."""

import importlib.util
import logging
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _hook():
    spec = importlib.util.spec_from_file_location("repository_links", DOCS / "hooks" / "repository_links.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_docs_hold_pages_and_pictures_only():
    """What mkdocs copies into the site: Markdown pages, the pictures they show, the stylesheet. The build's own
    hooks are excluded from the site (mkdocs.yml's exclude_docs)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["exclude_docs"].strip() == "hooks/"
    assert "docs/hooks/repository_links.py" in config["hooks"]
    other = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*")
             if p.is_file() and p.suffix not in {".md", ".png", ".css"} and "hooks" not in p.relative_to(DOCS).parts]
    assert not other, f"raw data or other files in docs/ (results go to results/<topic>/): {other}"


def test_every_link_from_a_page_to_the_repository_names_a_file_that_is_there(caplog):
    hook = _hook()
    with caplog.at_level(logging.WARNING):
        for page in DOCS.rglob("*.md"):
            hook.rewrite(page.read_text(), page.relative_to(DOCS).as_posix(), str(DOCS), None)
    assert not caplog.records, "\n".join(r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("repo_url", [None, "https://example.org/o/branchreplay/"])
def test_links_outside_docs_point_at_the_repository(repo_url, caplog):
    hook = _hook()
    page = ("[headline.json](../results/shared-prompt-sweeps-2026-11/headline.json), "
            "[the sweeps](../results/shared-prompt-sweeps-2026-11/), [a page](benchmarks.md#headline), "
            "[out](https://example.org/x.json), [a script](../scripts/compare_methods.py)\n"
            "````markdown\n```bash\n```\ncat [x](../results/nothing.json)\n````\n")
    with caplog.at_level(logging.WARNING):
        out = hook.rewrite(page, "convergence.md", str(DOCS), repo_url)
    assert not caplog.records
    assert "[a page](benchmarks.md#headline)" in out and "[out](https://example.org/x.json)" in out
    assert "cat [x](../results/nothing.json)" in out  # code is left as it is
    if repo_url:
        base = "https://example.org/o/branchreplay"
        assert f"[headline.json]({base}/blob/main/results/shared-prompt-sweeps-2026-11/headline.json)" in out
        assert f"[the sweeps]({base}/tree/main/results/shared-prompt-sweeps-2026-11)" in out
        assert f"[a script]({base}/blob/main/scripts/compare_methods.py)" in out
    else:
        assert "`results/shared-prompt-sweeps-2026-11/headline.json`," in out
        assert "the sweeps (`results/shared-prompt-sweeps-2026-11`)" in out
        assert "a script (`scripts/compare_methods.py`)" in out


def test_a_missing_file_or_a_picture_from_outside_docs_is_a_warning(caplog):
    """Each a warning, which `mkdocs build --strict` turns into an error; the link is left as it was."""
    hook = _hook()
    page = ("[gone](../results/no-such-topic/x.json)\n[above](../../elsewhere.json)\n"
            "![plot](../results/convergence-2026-12/tiny-float64/convergence.png)\n")
    with caplog.at_level(logging.WARNING):
        out = hook.rewrite(page, "benchmarks.md", str(DOCS), None)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and out == page, said
    assert "results/no-such-topic/x.json is not in the repository" in said[0], said
    assert "'../../elsewhere.json'" in said[1] and "is not in the repository" in said[1], said
    assert "a picture a page shows belongs in docs/" in said[2], said


def test_every_docs_page_the_code_names_is_there():
    """The docstrings, comments and help of src/, scripts/, tests/ and configs/ point readers at docs pages by path
    (`docs/notes/execution-stack.md`); a page moved or deleted must take those pointers with it."""
    import re

    named = {}
    for folder in ("src", "scripts", "tests", "configs", "examples"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in {".py", ".sh", ".yaml", ".md"}:
                for page in re.findall(r"docs/[\w./-]+\.md", path.read_text(errors="replace")):
                    named.setdefault(page, path.relative_to(ROOT).as_posix())
    assert len(named) > 10
    missing = {page: where for page, where in named.items() if not (ROOT / page).is_file()}
    assert not missing, f"pages named but not in docs/ (page: first file naming it): {missing}"
