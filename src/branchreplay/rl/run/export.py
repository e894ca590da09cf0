"""`branchreplay export RUN_DIR OUT`: a checkpoint as a plain Hugging Face model folder (transformers, vLLM).

The run's own config.yaml gives the base model (model.spec) and its LoRA settings; the checkpoint's weights (a
LoRA run's adapter, merged into the base weights with peft's `merge_and_unload`) go into OUT with the model's
config, generation config and tokenizer, in float32 safetensors, the files made as the user's umask says. OUT is
written in a temporary folder beside it and renamed into place when complete; an existing OUT is never replaced.
Before the rename, the folder is loaded back with `AutoModelForCausalLM.from_pretrained` and its logits compared
with the checkpoint's own model's (the LoRA model before its merge) on a few tokens: a mismatch writes nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from ...models import apply_lora, load_policy
from ..config import Config, run_config
from .checkpoint import is_lora, latest_checkpoint, load_weights


def export(checkpoint: str | Path, out: str | Path) -> float:
    """Write the checkpoint `checkpoint` (a run folder, whose latest checkpoint is used, or a step folder) as a
    model folder `out`; returns the largest |logit difference| of the reloaded folder against the checkpoint on 8
    tokens (0 up to float rounding).

    Raises:
        FileNotFoundError: no checkpoint there, or no config.yaml of the run above it.
        FileExistsError: `out` exists (choose a new folder; nothing is overwritten).
        ValueError: the checkpoint does not fit the run's model (`load_weights`), or the reloaded folder computes
            other logits than the checkpoint (beyond `reload_tolerance`); nothing is written then.
    """
    path, out = Path(checkpoint), Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; export writes a new folder (choose another name or remove it)")
    found = run_config(path)
    if found is None:
        raise FileNotFoundError(f"{path} is not in a run folder (no config.yaml beside it or two levels up); give "
                                "RUN_DIR or RUN_DIR/checkpoints/step-N")
    if not path.name.startswith("step-"):
        path = latest_checkpoint(path) or path
    config = Config.from_yaml(found, [])
    m = config.model
    model, tokenizer = load_policy(m.spec, "float32", "cpu")
    if m.lora_r:
        model = apply_lora(model, m.lora_r, m.lora_alpha, m.lora_targets())
    load_weights(model, path)
    model.eval()
    ids = torch.arange(1, 9)[None] % model.config.vocab_size
    with torch.no_grad():
        expected = model(ids).logits  # the checkpoint's own model (a LoRA model before the merge)
    if is_lora(model):
        model = model.merge_and_unload()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        diff = _check_reload(tmp, ids, expected)
        _respect_umask(tmp)
        os.rename(tmp, out)  # an `out` made meanwhile, if empty, is replaced: rename never merges folders
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return diff


def _respect_umask(folder: Path) -> None:
    """Folders 0777 and files 0666 less the umask, as `mkdir` and `open` make them (mkdtemp and safetensors make
    them private)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for f in folder.rglob("*"):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~mask)


RELOAD_TOLERANCE = 3e-4
"""The reloaded folder's logits may differ from the checkpoint's by this fraction of the logits' scale (their
largest |value|). The merged model and the checkpoint's LoRA model are two float32 computations of the same
function, which round apart by what a deep float32 forward rounds (tenfold margin over SmolLM2's after LoRA
training); adapters on a tied LM head, whose merge moves the embedding too, miss by far more
(tests/test_models_lora.py).
Figures: docs/lora.md."""


def reload_tolerance(expected: torch.Tensor) -> float:
    """The largest |logit difference| the reload check accepts for the checkpoint's `expected` logits (float32):
    `RELOAD_TOLERANCE` of their scale, and at least 1e-5."""
    return max(RELOAD_TOLERANCE * float(expected.abs().max()), 1e-5)


@torch.no_grad()
def _check_reload(folder: Path, ids: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest |logit difference| of `folder` loaded with transformers against the checkpoint's `expected`
    logits of `ids`. Raises ValueError above `reload_tolerance` (e.g. adapters on a tied LM head, which a merge
    cannot keep)."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    diff = float((reloaded(ids).logits - expected).abs().max())
    bound = reload_tolerance(expected)
    if diff > bound:
        raise ValueError(f"the exported model's logits are {diff:.2g} away from the checkpoint's (logits up to "
                         f"{float(expected.abs().max()):.3g}: the bound is {bound:.2g}, float32 rounding of the merge "
                         "stays far below it; LoRA adapters on a tied embedding or LM head do not survive a merge); "
                         "nothing was written")
    return diff
