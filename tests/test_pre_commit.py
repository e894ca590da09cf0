"""The commit hooks (.pre-commit-config.yaml): the commit-msg hook (.pre-commit/check_subject.py) refuses a subject
over 72 characters and passes one of 72; git's comment lines and blank lines before the subject are not it. The
config runs it at commit-msg, and every hook is local (no hook repository to fetch)."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / ".pre-commit" / "check_subject.py"


@pytest.mark.parametrize("message, passes", [
    ("a" * 72 + "\n\n" + "a long body line " * 10 + "\n", True),
    ("a" * 73 + "\n", False),  # the control: one character more
    ("# Please enter the commit message\n\n" + "a" * 72 + "\n", True),
    ("\n# a comment\n" + "a" * 73, False),
    ("é" * 72 + "\n", True),  # characters, not bytes
    ("fixup! " + "a" * 80 + "\n", True),  # folded into another commit by a rebase
], ids=["72", "73", "after-comments", "73-after-comments", "72-non-ascii", "fixup"])
def test_the_commit_msg_hook_refuses_a_subject_over_72_characters(tmp_path, message, passes):
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message, encoding="utf-8")
    done = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=60)
    assert (done.returncode == 0) == passes, done.stdout
    assert passes or "73 characters, over 72" in done.stdout, done.stdout


def test_the_config_runs_local_hooks_and_the_subject_check_on_each_message():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    assert [repo["repo"] for repo in config["repos"]] == ["local"]
    hooks = {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}
    assert set(hooks) == {"ruff", "check-added-large-files", "end-of-file-fixer", "trailing-whitespace",
                          "commit-subject"}
    assert hooks["commit-subject"]["stages"] == ["commit-msg"]
    assert hooks["commit-subject"]["entry"].endswith(str(SCRIPT.relative_to(ROOT)))
    assert "--maxkb=500" in hooks["check-added-large-files"]["entry"]
    assert "commit-msg" in config["default_install_hook_types"] and config["default_stages"] == ["pre-commit"]
