"""The safetensors file a vLLM weight sync writes, kept for the run and overwritten in place.

A new file per sync has the kernel hand out fresh pages every time, most of a sync's time on a machine that returns
freed memory (a VM). So the first sync writes the file and the next ones overwrite its tensors in place (same names,
dtypes and shapes; anything else, or a file that is gone, writes a new one). It lives in /dev/shm where there is
room (memory, not disk: one copy of the weights held for the run), unless TMPDIR is set (a folder the server reads,
e.g. shared with its machine), in a folder named after the host and the process, removed at exit; the folder of a
process of this host that no longer runs (killed before it could remove it) is removed when the next one is made.
Design notes and measurements: docs/notes/sampler.md.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import socket
import tempfile

import torch

PREFIX = "branchreplay-vllm-weights-"
ADAPTER_PREFIX = "branchreplay-vllm-lora-"  # a LoRA sync's folder (`client.VLLMClient.sync_adapter`)
FILE = "model.safetensors"


class WeightsFile:
    """One process's weight-sync file (module docstring). `write(state)` returns the folder to hand the server."""

    def __init__(self):
        self.folder: str | None = None
        self.layout: dict | None = None  # name -> (dtype, shape, byte offset in the file)
        atexit.register(self.close)

    def write(self, state: dict) -> str:
        """`state` ({name: tensor}) as the folder's safetensors file; returns the folder."""
        tensors = unshared(state)
        signature = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        path = os.path.join(self.folder, FILE) if self.folder else None
        if self.layout is None or {n: v[:2] for n, v in self.layout.items()} != signature or \
                not os.path.exists(path):
            self._new(tensors)
            return self.folder
        with open(path, "r+b") as f:
            for name, t in tensors.items():
                f.seek(self.layout[name][2])
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        return self.folder

    def _new(self, tensors: dict) -> None:
        import safetensors.torch

        self.close()
        scratch = scratch_folder(tensors)
        remove_stale(scratch or tempfile.gettempdir())
        self.folder = tempfile.mkdtemp(prefix=owned(PREFIX), dir=scratch)
        path = os.path.join(self.folder, FILE)
        safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
        os.chmod(self.folder, 0o755)
        os.chmod(path, 0o644)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        self.layout = {name: (t.dtype, tuple(t.shape), 8 + n + header[name]["data_offsets"][0])
                       for name, t in tensors.items()}

    def close(self) -> None:
        """Remove the folder (also at exit)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = self.layout = None


def scratch_folder(state: dict) -> str | None:
    """/dev/shm (memory) when it has room for twice the weights and TMPDIR is not set, else the default temporary
    folder (None)."""
    if os.environ.get("TMPDIR"):
        return None
    size = sum(v.numel() * v.element_size() for v in state.values())
    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free > 2 * size else None
    except OSError:
        return None


def unshared(state: dict) -> dict:
    """`state` on the CPU with each tensor that shares storage with an earlier one (a tied LM head) copied: a
    safetensors file holds no shared storage. Only those are copied (copying every tensor would slow each sync)."""
    seen, out = set(), {}
    for name, value in state.items():
        value = value.detach().cpu()
        key = value.untyped_storage().data_ptr()
        out[name] = value.clone() if key in seen else value
        seen.add(key)
    return out


def owned(prefix: str) -> str:
    """A sync folder's name prefix: `prefix`, this host's name and this process's id (`remove_stale`)."""
    return f"{prefix}{socket.gethostname()}-{os.getpid()}-"


def remove_stale(scratch: str) -> None:
    """Remove the sync folders (weights or LoRA adapter) in `scratch` of this host's processes that no longer run
    (a container sharing /dev/shm has another host name and process ids: its folders are left alone)."""
    host = re.escape(socket.gethostname())
    for entry in os.listdir(scratch):
        match = re.fullmatch(rf"(?:{PREFIX}|{ADAPTER_PREFIX}){host}-(\d+)-.*", entry)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(scratch, entry), ignore_errors=True)
        except PermissionError:  # another user's process: it runs
            pass
