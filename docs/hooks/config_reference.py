"""MkDocs hook: docs/reference/config.md's marker replaced by the config reference generated from the code
(`branchreplay.rl.config.reference`, then the TRL drop-ins' keywords, `branchreplay.trl.options`), so that the page
lists every field `--help-all` does, never a stale copy."""

from branchreplay.rl.config.reference import MARKER, config_reference
from branchreplay.trl.options import keywords_reference


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, config_reference() + "\n" + keywords_reference())
