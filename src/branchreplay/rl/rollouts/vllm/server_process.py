"""A server command run as its own process group, ended as a whole (`branchreplay vllm-serve`).

vLLM's OpenAI server starts more processes (the EngineCore and its workers, several GB each). Killing only the
process that started them leaves them running, so the command runs in a new session (its own process group):
SIGTERM, SIGINT or SIGHUP to the wrapper is passed to the whole group as SIGTERM, and after `grace_s` seconds what
is left gets SIGKILL. On Linux the server's first process also gets SIGTERM if the wrapper itself dies
(PR_SET_PDEATHSIG), and vLLM then ends its own children.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None  # looked up before
# any fork: resolving a symbol between fork and exec can deadlock


def _die_with_parent(parent: int):  # pragma: no cover - runs in the child between fork and exec
    def setup():
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before the death signal was armed
                os.kill(os.getpid(), signal.SIGTERM)
    return setup


def run_process_group(command: list[str], env: dict[str, str] | None = None, grace_s: float = 30.0) -> int:
    """Run `command` in its own process group until it exits; SIGTERM / SIGINT / SIGHUP to this process end the
    group (then SIGKILL after `grace_s` seconds). Returns the command's exit status; 128 + the signal's number when a
    signal ended it, whether sent to this process (130 for Ctrl-C, 143 for SIGTERM) or to the server (137 for the
    OOM killer's SIGKILL)."""
    received: list[int] = []
    deadline = [float("inf")]  # when the group gets SIGKILL, once a signal came
    pgid: list[int] = []  # the group, once started

    def forward(signum, frame):
        received.append(signum)
        deadline[0] = min(deadline[0], time.monotonic() + grace_s)
        if pgid:
            _signal_group(pgid[0], signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}  # before the start: no signal falls between
    try:
        process = subprocess.Popen(command, env=env, start_new_session=True,
                                   preexec_fn=_die_with_parent(os.getpid()))
        pgid.append(process.pid)
        if received:  # a signal came while it started
            _signal_group(process.pid, signal.SIGTERM)
        try:
            while True:
                try:
                    status = process.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline[0]:  # the group ignored SIGTERM for grace_s
                        _signal_group(process.pid, signal.SIGKILL)
        finally:
            _signal_group(process.pid, signal.SIGKILL)  # what the server's first process left behind
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        return 128 + received[0]
    return 128 - status if status < 0 else status


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass
