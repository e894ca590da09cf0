"""The family census, the table of docs/support.md ("The family census: every causal LM of transformers"): every
decoder-only causal-LM model type of the installed transformers, built tiny and run through the engine against
the naive per-rollout reference.

    .venv/bin/python scripts/family_census.py --json /tmp/census.json --markdown /tmp/census.md [--types a,b]

Every model type of transformers' causal-LM auto mapping gets one row. Its model is a tiny random one of the family's
own config class, only shrunk (`branchreplay.tiny_models.shrunk_config`), saved with save_pretrained and loaded back
by `branchreplay.models.load_model` (float64 and float32), as a user's saved folder is. Then:
  status         "exact": the family as registered (or, unregistered, after the engine's own self-check,
                 `engine.self_check.ensure_supported`) passes `check.verify.verify_model` on --shapes in float64 (max
                 relative gradient error within the bound) and in float32 (its error against float64 within
                 `VS_FLOAT64_FACTOR` x the naive computation's); "refused": the engine refuses the family by name
                 (`UnsupportedModelError`, its first line in the note); "failed": anything else (an exception, an
                 error above the bound, a failed self-check, the time limit), the exception type and first line in
                 the note; "not built": the config class cannot be built tiny (an encoder or encoder-decoder, a
                 composite multimodal config, a config or model transformers refuses at these sizes), why in the note.
  float64 error  max over the trees of the engine's max relative gradient error against naive, float64.
  float32 ratio  the engine's gradient error against float64 over the naive computation's, float32 (verify's
                 bound: at most 2), max over the trees of each.
  state          `engine.families.state_bytes_per_token` in float32: K/V bytes per prefix token over the full-attention
                 layers (recurrent states not counted), and the most the sliding layers ever hold.
  sampler        whether the in-process sampler (`decode.loop.sample_groups`, 2 prompts x 2 samples, 4 new tokens)
                 decodes the float32 model without an error.
  TRL drop-ins   whether `branchreplay.trl`'s trainers take the family when built (`trl.base.check_family`, the
                 check their constructors run; nothing is trained).
Each type runs in a forked child process under --timeout seconds, so that a slow, hanging or crashing family
cannot stall the census; its row then says how far it got.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

FLAGSHIP = ("qwen3_5_text", "qwen3_5_moe_text", "gpt_oss", "deepseek_v3", "glm4_moe", "gemma4_text", "llama4_text",
            "olmo3", "smollm3", "granitemoehybrid", "lfm2_moe", "kimi_linear", "ministral3", "llama", "qwen3_moe")
"""The families tests/test_scripts_family_census.py holds to "exact" or "refused"."""
SHAPES = ("branches-of-branches", "short-beside-long")
"""`reference.shapes.SHAPES` the census verifies on by default (a tree of branches, and packs of uneven length)."""
OWN_SUB_CONFIGS = ("attn_config", "ffn_config")
"""Sub-configs that are parts of one decoder (MPT's, DBRX's); any other makes a composite model, not built here."""
STATUSES = ("exact", "refused", "failed", "not built")
COLUMNS = ("family", "registered", "status", "float64 error", "float32 ratio", "state bytes/token", "sampler",
           "TRL drop-ins", "note")


def first_line(error: BaseException) -> str:
    """`Type: first line of the message`, at most 200 characters."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0].strip() if lines else ''}"[:200]


def causal_lm_types() -> list[str]:
    """Every model type of the installed transformers' causal-LM auto mapping, sorted."""
    from transformers.models.auto import modeling_auto

    return sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def not_decoder_only(model_type: str) -> str | None:
    """Why `model_type` is no decoder-only causal LM (an encoder with a causal head, an encoder-decoder's decoder
    half), or None."""
    from transformers.models.auto import modeling_auto as m

    if model_type in m.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "encoder-decoder: its causal-LM class is the decoder half"
    if model_type in m.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "an encoder (masked LM) whose causal-LM head needs is_decoder"
    return None


def census_row(model_type: str, shapes=SHAPES, report=lambda row: None) -> dict:
    """One type's row (module docstring); `report(row)` is called after each stage with the row so far."""
    row = {"family": model_type, "registered": None, "status": None, "float64_error": None, "float32_ratio": None,
           "state_bytes_per_token": None, "sliding_state_bytes": None, "sampler": None, "trl": None, "note": "",
           "stage": "config"}
    why = not_decoder_only(model_type)
    if why:
        return {**row, "status": "not built", "note": why}
    built = _build(model_type, row, report)
    if built is None:
        return row
    model64, model32 = built
    report(row)
    _state(model32, row)
    _engine(model64, model32, shapes, row)
    row["stage"] = "sampler"
    report(row)
    _sampler(model32, row)
    row["stage"] = "trl"
    report(row)
    _trl(model64, row)
    row["stage"] = "done"
    return row


def _build(model_type: str, row: dict, report):
    """(float64, float32) models loaded by `models.load_model` from a saved tiny folder, or None (row says why)."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from branchreplay.engine.families import FAMILIES
    from branchreplay.models import load_model
    from branchreplay.tiny_models import shrunk_config

    row["registered"] = model_type in FAMILIES
    try:
        config = shrunk_config(model_type)
    except Exception as e:  # noqa: BLE001 - the reason goes into the row
        row.update(status="not built", note=f"config: {first_line(e)}")
        return None
    parts = [k for k in getattr(config, "sub_configs", {}) if k not in OWN_SUB_CONFIGS]
    if parts or getattr(config, "is_encoder_decoder", False):
        text = getattr(getattr(config, "text_config", None), "model_type", None)
        what = "encoder-decoder" if not parts else f"composite config ({', '.join(parts)})" + (
            f"; its text model is {text}" if text else "")
        row.update(status="not built", note=what)
        return None
    row["stage"] = "build"
    report(row)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        row.update(status="not built", note=f"model: {first_line(e)}")
        return None
    row["stage"] = "load"
    try:
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            return load_model(folder, dtype=torch.float64)[0], load_model(folder, dtype=torch.float32)[0]
    except Exception as e:  # noqa: BLE001
        row.update(status="failed", note=f"save / load_model: {first_line(e)}")
        return None


def _state(model, row: dict) -> None:
    import torch

    from branchreplay.engine.families import state_bytes_per_token

    try:
        row["state_bytes_per_token"], row["sliding_state_bytes"] = state_bytes_per_token(model.config, torch.float32)
    except Exception as e:  # noqa: BLE001
        row["state_error"] = first_line(e)


def _engine(model64, model32, shapes, row: dict) -> None:
    """The status: the family's refusal or self-check, then `verify_model` in float64 and in float32."""
    from branchreplay.check.verify import VS_FLOAT64_FACTOR, verify_model
    from branchreplay.engine.families import UnsupportedModelError, family_of
    from branchreplay.engine.self_check import PROCESS_VERDICTS, ensure_supported

    force = not row["registered"]
    try:
        row["stage"] = "self-check" if force else "family"
        if force:  # refusals by name, then the engine's own self-check (its verdict kept for the TRL check)
            ensure_supported(model64, "self-check", PROCESS_VERDICTS, log=lambda message: None)
        else:
            family_of(model64)
        row["stage"] = "verify float64"
        results, _ = verify_model(model64, shapes=list(shapes), force=force)
        row["float64_error"] = max(r.max_rel_grad_err for r in results)
        if not all(r.passed for r in results):
            worst = max(results, key=lambda r: r.max_rel_grad_err)
            row.update(status="failed", note=f"float64: max relative gradient error {row['float64_error']:.1e} "
                                             f"(logprobs {worst.max_abs_logprob_err:.1e} nats) on {worst.shape}, "
                                             "above the bound")
            return
        row["stage"] = "verify float32"
        results, _ = verify_model(model32, shapes=list(shapes), force=force)
        engine = max(r.max_rel_grad_err_vs_f64 for r in results)
        naive = max(r.naive_rel_grad_err_vs_f64 for r in results)
        row["float32_ratio"] = engine / naive if naive > 0 else (0.0 if engine == 0 else float("inf"))
        if not all(r.passed for r in results):
            row.update(status="failed", note=f"float32: against float64 the engine's error is {engine:.1e}, "
                                             f"the naive computation's {naive:.1e} (bound {VS_FLOAT64_FACTOR:g}x)")
            return
        row["status"] = "exact"
    except UnsupportedModelError as e:
        failed = "failed its self-check" in str(e)
        row.update(status="failed" if failed else "refused", note=first_line(e) if failed else _reason(e))
    except Exception as e:  # noqa: BLE001
        row.update(status="failed", note=f"{row['stage']}: {first_line(e)}")


def _reason(error: BaseException) -> str:
    """An UnsupportedModelError's first sentence (its message without the type), at most 200 characters."""
    text = " ".join(str(error).split())
    return text.split(". ")[0][:200]


def _sampler(model, row: dict) -> None:
    import torch

    from branchreplay.decode.config import SamplingConfig
    from branchreplay.decode.loop import sample_groups

    prompts = [[1, 5, 9, 13, 17, 21], [1, 7, 11, 15, 19, 23, 27, 31, 35]]
    try:
        samples = sample_groups(model, prompts, 2, SamplingConfig(max_new_tokens=4), {2},
                                [torch.Generator().manual_seed(k) for k in range(len(prompts))])
        row["sampler"] = "yes" if all(len(s) == 2 for s in samples) else "no"
    except Exception as e:  # noqa: BLE001
        row["sampler"], row["sampler_error"] = "no", first_line(e)


def _trl(model, row: dict) -> None:
    from branchreplay.engine.families import UnsupportedModelError
    from branchreplay.trl.base import check_family

    try:
        check_family(model, "self-check", "TreeGRPOTrainer")
        row["trl"] = "yes"
    except UnsupportedModelError as e:
        row["trl"], row["trl_error"] = "refused", _reason(e)
    except Exception as e:  # noqa: BLE001
        row["trl"], row["trl_error"] = "no", first_line(e)


def _child(model_type: str, shapes, connection) -> None:
    """A forked child's work: one thread, the row sent after each stage and at the end."""
    import logging
    import os
    import warnings

    import torch
    import transformers

    torch.set_num_threads(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what a family prints (a config in an error) stays out of the table
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.getLogger("branchreplay").setLevel(logging.WARNING)
    try:
        row = census_row(model_type, shapes, report=lambda partial: connection.send(dict(partial)))
    except BaseException as e:  # noqa: BLE001 - a row, whatever happened
        row = {"family": model_type, "status": "failed", "note": f"census: {first_line(e)}"}
    connection.send({**row, "final": True})
    connection.close()


TIMEOUT = 90.0
"""Seconds per type, by default."""


def census(types, shapes=SHAPES, timeout: float = TIMEOUT, jobs: int = 1, log=print) -> list[dict]:
    """The rows of `types`, each computed in a forked child under `timeout` seconds, `jobs` children at a time.
    A child that runs out of time or dies gives the last row it sent, "failed" with how far it got."""
    import multiprocessing

    import torch  # noqa: F401 - imported once, before the children fork
    import transformers
    from huggingface_hub.utils import disable_progress_bars

    from branchreplay.check import verify  # noqa: F401
    from branchreplay.trl import base  # noqa: F401

    transformers.utils.logging.disable_progress_bar()
    disable_progress_bars()
    try:  # save_pretrained imports it where installed; here, so that its banner prints once, not per child
        import deepspeed  # noqa: F401
    except ImportError:
        pass

    context = multiprocessing.get_context("fork")
    pending, running, rows = list(types), [], {}
    while pending or running:
        while pending and len(running) < jobs:
            model_type = pending.pop(0)
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(model_type, shapes, send), daemon=True)
            process.start()
            send.close()
            running.append((model_type, process, receive, time.monotonic(), {"family": model_type}))
        time.sleep(0.05)
        still = []
        for model_type, process, receive, start, last in running:
            while receive.poll():
                try:
                    last = receive.recv()
                except EOFError:
                    break
            elapsed = time.monotonic() - start
            if last.get("final"):
                process.join()
            elif process.is_alive() and elapsed < timeout:
                still.append((model_type, process, receive, start, last))
                continue
            else:
                why = f"timed out after {timeout:g} s" if process.is_alive() else \
                    f"the child process died (exit code {process.exitcode})"
                process.kill()
                process.join()
                last = {**last, "status": "failed", "note": f"{last.get('stage', 'start')}: {why}"}
            last.pop("final", None)
            last["seconds"] = round(elapsed, 1)
            rows[model_type] = last
            log(f"{model_type}: {last['status']} ({last['seconds']} s) {last.get('note', '')}"[:200])
        running = still
    return [rows[t] for t in types]


def markdown(rows: list[dict]) -> str:
    """The table of `rows` (one line per type) and the counts by status."""
    def cell(value, kind=None):
        if value is None:
            return "-"
        if kind == "error":
            return f"{value:.1e}"
        if kind == "ratio":
            return f"{value:.2f}"
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        state = None if r.get("state_bytes_per_token") is None else \
            f"{r['state_bytes_per_token']}" + (f" (+{r['sliding_state_bytes']} sliding)"
                                               if r.get("sliding_state_bytes") else "")
        registered = None if r.get("registered") is None else ("yes" if r["registered"] else "no")
        lines.append("| " + " | ".join([
            cell(r["family"]), cell(registered), cell(r["status"]), cell(r.get("float64_error"), "error"),
            cell(r.get("float32_ratio"), "ratio"), cell(state), cell(r.get("sampler")), cell(r.get("trl")),
            cell(r.get("note") or "")]) + " |")
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    lines += ["", ", ".join(f"{s}: {n}" for s, n in counts.items()) + f" (of {len(rows)} types)"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", help="a comma list of model types (default: every causal-LM type; 'flagship': "
                                        + ",".join(FLAGSHIP) + ")")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="tree shapes of reference.shapes.SHAPES to "
                                                                    "verify on (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per type (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=1, help="types run at once, one thread each")
    parser.add_argument("--json", help="write the rows (one object per type) to this file")
    parser.add_argument("--markdown", help="write the table to this file (default: print it)")
    args = parser.parse_args(argv)
    if args.types == "flagship":
        types = list(FLAGSHIP)
    elif args.types:
        types = [t.strip() for t in args.types.split(",") if t.strip()]
    else:
        types = causal_lm_types()
    rows = census(types, tuple(args.shapes.split(",")), args.timeout, args.jobs,
                  log=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    table = markdown(rows)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    else:
        print(table)
    return 1 if any(r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
