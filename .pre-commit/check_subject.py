"""The commit-msg hook of .pre-commit-config.yaml: refuses a commit whose subject (the first line of its message)
is longer than 72 characters (CONTRIBUTING.md, "Commits"). Git's comment lines and blank lines before it are not the
subject. Passed as they are: git's own merge subjects, and fixup!, squash! and amend! commits, which a rebase folds
into another. Usage: check_subject.py MESSAGE_FILE; exit 1 with one line naming the length and the limit."""

import sys
from pathlib import Path

LIMIT = 72
PASSED = ("Merge ", "fixup! ", "squash! ", "amend! ")


def subject(message: str) -> str:
    """The message's first line that is neither blank nor a git comment (`#`), without its line end."""
    return next((line.rstrip() for line in message.splitlines() if line.strip() and not line.startswith("#")), "")


def main(argv: list[str]) -> int:
    first = subject(Path(argv[1]).read_text(encoding="utf-8", errors="replace"))
    if len(first) <= LIMIT or first.startswith(PASSED):
        return 0
    print(f"the commit subject is {len(first)} characters, over {LIMIT}: shorten it and move the rest to the body, "
          f"after a blank line ({first[:40]!r}...)")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
