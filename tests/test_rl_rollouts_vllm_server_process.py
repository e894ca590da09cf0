"""`branchreplay vllm-serve` ends the whole server when it is stopped (rl/rollouts/vllm/server_process.py).

The stand-in for vLLM's server is a fake venv python that starts a child (as vLLM's API server starts its
EngineCore) and writes both pids; the wrapper is killed as a user would kill it, by its pid, and no process of the
group may survive. Before the fix, the wrapper's SIGTERM left the server and its child running.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

STAND_IN = """
import os, signal, subprocess, sys, time
if {ignore_term}:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open({pids!r}, "w") as f:
    f.write(f"{{os.getpid()}} {{child.pid}}")
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, just not yet reaped
        return f.read().split(")")[-1].split()[0] != "Z"


def _fake_venv(tmp_path, ignore_term=False):
    pids = tmp_path / "pids"
    script = tmp_path / "server.py"
    script.write_text(STAND_IN.format(ignore_term=ignore_term, pids=str(pids)))
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
    python.chmod(0o755)
    return tmp_path / "venv", pids


def _wait_for(pids, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert time.monotonic() < deadline, "the stand-in server did not start"
        time.sleep(0.05)
    return [int(p) for p in pids.read_text().split()]


def _vllm_serve(tmp_path, venv):
    """`branchreplay vllm-serve` with the fake venv's python as the server."""
    return subprocess.Popen([sys.executable, "-m", "branchreplay", "vllm-serve", "--model", str(tmp_path),
                             "--venv", str(venv)], stderr=subprocess.PIPE, text=True)


def _run_process_group(venv, grace_s=30.0):
    """`run_process_group` of the fake venv's python, in a process of its own."""
    code = ("import sys; from branchreplay.rl.rollouts.vllm.server_process import run_process_group; "
            f"sys.exit(run_process_group([{str(venv / 'bin' / 'python')!r}], grace_s={grace_s}))")
    return subprocess.Popen([sys.executable, "-c", code])


def _gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc: Linux")
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_killing_vllm_serve_by_its_pid_ends_the_server_and_its_children(tmp_path, signum, status):
    venv, pids = _fake_venv(tmp_path)
    wrapper = _vllm_serve(tmp_path, venv)
    server, child = _wait_for(pids)
    assert os.getpgid(server) == server != os.getpgid(wrapper.pid)  # the server leads its own group
    wrapper.send_signal(signum)
    assert wrapper.wait(timeout=60) == status
    assert _gone([server, child], 10.0), "a server process outlived vllm-serve"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc: Linux")
def test_closing_the_terminal_ends_the_server_too(tmp_path):
    """SIGHUP (the terminal or SSH session closed) no longer reaches a server in its own session: it is forwarded."""
    venv, pids = _fake_venv(tmp_path)
    wrapper = _vllm_serve(tmp_path, venv)
    server, child = _wait_for(pids)
    wrapper.send_signal(signal.SIGHUP)
    assert wrapper.wait(timeout=60) == 128 + signal.SIGHUP
    assert _gone([server, child], 10.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc: Linux")
def test_a_server_killed_by_a_signal_gives_the_shells_status(tmp_path):
    """The OOM killer's SIGKILL of the server: vllm-serve exits 137, as a shell reports it (not -9, which exits 247)."""
    venv, pids = _fake_venv(tmp_path)
    wrapper = _run_process_group(venv)
    server, child = _wait_for(pids)
    os.kill(server, signal.SIGKILL)
    assert wrapper.wait(timeout=60) == 137
    assert _gone([child], 10.0)  # the rest of the group is ended with it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc: Linux")
def test_a_server_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    venv, pids = _fake_venv(tmp_path, ignore_term=True)
    wrapper = _run_process_group(venv, grace_s=1.0)
    server, child = _wait_for(pids)
    wrapper.terminate()
    assert wrapper.wait(timeout=60) == 143
    assert _gone([server, child], 10.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG: Linux")
def test_the_server_ends_when_vllm_serve_is_killed_outright(tmp_path):
    """SIGKILL cannot be forwarded: the server's first process gets SIGTERM from the kernel (PR_SET_PDEATHSIG)."""
    venv, pids = _fake_venv(tmp_path)
    wrapper = _run_process_group(venv)
    server, child = _wait_for(pids)
    wrapper.kill()
    wrapper.wait(timeout=60)
    assert _gone([server], 10.0)
    os.kill(child, signal.SIGKILL)  # the stand-in does not end its own child on SIGTERM; vLLM does
