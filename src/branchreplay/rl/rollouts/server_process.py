"""A server command run as its own process group, ended as a whole (`branchreplay vllm-serve`).

vLLM's OpenAI server starts more processes (the EngineCore and its workers, several GB each). Killing only the
process that started them leaves them running, so the command runs in a new session (its own process group):
SIGTERM or SIGINT to the wrapper is passed to the whole group, and after `grace_s` seconds what is left gets
SIGKILL. On Linux the server's first process also gets SIGTERM if the wrapper itself dies (PR_SET_PDEATHSIG), and
vLLM then ends its own children.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_process_group(command: list[str], env: dict[str, str] | None = None, grace_s: float = 30.0) -> int:
    """Run `command` in its own process group until it exits; SIGTERM / SIGINT to this process end the group (then
    SIGKILL after `grace_s` seconds). Returns the command's exit status, or 128 + the signal's number when a signal
    ended it (130 for Ctrl-C, 143 for SIGTERM)."""
    process = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    received: list[int] = []
    deadline = [float("inf")]  # when the group gets SIGKILL, once a signal came

    def forward(signum, frame):
        received.append(signum)
        deadline[0] = min(deadline[0], time.monotonic() + grace_s)
        _signal_group(process.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                status = process.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline[0]:  # the group ignored SIGTERM for grace_s
                    _signal_group(process.pid, signal.SIGKILL)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _signal_group(process.pid, signal.SIGKILL)  # what the server's first process left behind
    return 128 + received[0] if received else status


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass
