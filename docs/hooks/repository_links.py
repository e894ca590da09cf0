"""MkDocs hook: a page's links to files of the repository outside docs/ (the raw results in results/, a script, a
config) point at the repository, since the site holds only the pages and the pictures they show.

The pages link such files by their relative path (`../results/<topic>/x.json`), which works where the Markdown is
read in the repository (GitHub, an editor). On the site each becomes a link to `repo_url`'s copy of the file
(`<repo_url>/blob/main/<path>`, `tree/` for a folder) or, while mkdocs.yml sets no `repo_url`, the path in code.
A link to a file that does not exist, or a picture shown from outside docs/, is a warning (an error under
`--strict`), as mkdocs' own check of links within docs/ is."""

import logging
import os
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.repository_links")

LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
BRANCH = "main"


def repository_link(target: str, page_src: str, docs_dir: str, repo_url: str | None) -> tuple[str | None, str]:
    """(the repository path of `target`, the URL the link becomes: "" without `repo_url`), or (None, "") where
    mkdocs itself checks the link: an absolute URL, an anchor, or a file inside docs/. `page_src` is the page's path
    inside `docs_dir`."""
    path, _, anchor = target.partition("#")
    if not path or "://" in path or path.startswith(("/", "mailto:")):
        return None, ""
    docs = Path(docs_dir).resolve()
    resolved = Path(os.path.normpath(docs / Path(page_src).parent / path))
    if resolved == docs or docs in resolved.parents:
        return None, ""
    repo_path = Path(os.path.relpath(resolved, docs.parent)).as_posix()  # "../x" above the repository's root
    if not repo_url or repo_path.startswith("../"):
        return repo_path, ""
    kind = "tree" if resolved.is_dir() else "blob"
    return repo_path, f"{repo_url.rstrip('/')}/{kind}/{BRANCH}/{repo_path}" + (f"#{anchor}" if anchor else "")


def rewrite(markdown: str, page_src: str, docs_dir: str, repo_url: str | None) -> str:
    root = Path(docs_dir).resolve().parent
    lines, fence = [], None  # the open code fence's marker

    def sub(m: re.Match) -> str:
        image, text, target = m.groups()
        repo_path, url = repository_link(target, page_src, docs_dir, repo_url)
        if repo_path is None:
            return m.group(0)
        if repo_path.startswith("../") or not (root / repo_path).exists():
            log.warning(f"{page_src} links to '{target}': {repo_path} is not in the repository")
            return m.group(0)
        if image:
            log.warning(f"{page_src} shows '{target}' from outside docs/: a picture a page shows belongs in docs/")
            return m.group(0)
        if url:
            return f"[{text}]({url})"
        name = text.strip("`").rstrip("/")
        return f"`{repo_path}`" if name in (repo_path, Path(repo_path).name) else f"{text} (`{repo_path}`)"

    for line in markdown.split("\n"):
        m = FENCE.match(line)
        if m and fence is None:
            fence = m.group(1)
        elif m and line.strip() == m.group(1) and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
            lines.append(line)
            fence = None
            continue
        lines.append(line if fence else LINK.sub(sub, line))
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):
    return rewrite(markdown, page.file.src_path, config["docs_dir"], config.get("repo_url"))
