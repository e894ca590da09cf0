"""Run TRL's own trainer test suites with the tree trainers swapped in, and TRL's classes as the control: the
tables of docs/trl_suite.md and docs/trl_suite_grpo.md, summed up in docs/trl_results.md ("TRL's own test
suites").

    .venv/bin/python scripts/trl_suite.py --trl-src PATH [--suites grpo rloo dpo] [--out docs/trl_suite.md]
        [--parallel]

PATH is a TRL source checkout (its `tests/` and `scripts/`; the installed TRL is what runs). Nothing is downloaded:
  - the hub models the tests name (`trl-internal-testing/tiny-<Class>[-<version>]`, and the few full-size names)
    are stood in by local folders of that name: tiny random models of the named class (TRL's own sizes: hidden 8,
    2 layers, 4 heads, bfloat16) with the tokenizer that ships here (SmolLM2's, with its chat template); Gemma3's
    vision-language class as `tiny_models.save_tiny_vision_model` (a local Gemma3 processor on that tokenizer); a class
    with no stand-in here (other vision-language models, remote code) is left out, and its tests "cannot run
    here";
  - the datasets (`trl-internal-testing/zen` and the others TRL's `scripts/generate_*_dataset.py` make) are TRL's
    own generator scripts, run with their `push_to_hub` saving locally;
  - transformers and datasets load a local folder of the hub name, so the tests run from a work folder holding
    them, with HF_HUB_OFFLINE=1.
Each suite (`tests/test_<suite>_trainer.py`, copied into the work folder) runs twice: once as it is (the control),
once with `trl.GRPOTrainer`, `trl.RLOOTrainer` and `trl.DPOTrainer` replaced by the tree trainers before the test
module imports them (a pytest plugin in the work folder; nothing in this repository or in TRL is changed). The
per-test outcomes go into a table: passes with both; refused by name (the tree trainer's ValueError names the
setting); cannot run here (the control fails or skips too, with its reason); FAILS (the control passes, the tree
trainer fails otherwise: a gap to fix).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from unittest import mock

import torch

SUITES = ("grpo", "rloo", "dpo")
HUB_NAME = re.compile(r"\"((?:trl-internal-testing|Qwen|HuggingFaceTB|google|meta-llama)/[A-Za-z0-9._-]+)\"")
TINY = dict(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32)
FAMILY_EXTRA = {  # what a family needs on top of TINY to build at that size
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                     n_shared_experts=1, head_dim=16),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    "cohere2": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "nemotron_h": dict(hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8,
                       n_groups=1, head_dim=16),
}
FULL_SIZE = {"Qwen/Qwen2.5-0.5B-Instruct": "Qwen2ForCausalLM"}  # full-size names the tests use, stood in by a class

PLUGIN = '''"""Swap TRL's trainers for the tree trainers when TRL_SUITE_SIDE=tree (written by scripts/trl_suite.py).

Both sides: the `is_<package>_available` checks the checkout's tests/testing_utils.py imports from trl.import_utils
that the installed TRL lacks are added to that module in this test process (find_spec of the package), so that
the newer tests collect against the installed TRL.
"""
import importlib
import importlib.util
import os
import re

import trl

_utils = importlib.import_module("trl.import_utils")
_source = open(os.path.join("tests", "testing_utils.py")).read()
for _name in re.findall(r"\\b(is_([a-z_]+)_available)\\b", _source):
    if not hasattr(_utils, _name[0]):
        setattr(_utils, _name[0], lambda package=_name[1]: importlib.util.find_spec(package) is not None)

if os.environ.get("TRL_SUITE_SIDE") == "tree":
    from branchreplay.trl import TreeDPOTrainer, TreeGRPOTrainer, TreeRLOOTrainer

    trl.GRPOTrainer, trl.RLOOTrainer, trl.DPOTrainer = TreeGRPOTrainer, TreeRLOOTrainer, TreeDPOTrainer
'''


def stand_in_model(name: str, root: Path, tokenizer) -> str | None:
    """Save a tiny random model for hub `name` under root/name; None when built, else why not."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    short = name.split("/", 1)[1]
    cls_name = FULL_SIZE.get(name) or re.match(r"tiny-([A-Za-z0-9_]+?)(?:-[0-9.]+|-[A-Za-z]+)*$", short)
    cls_name = cls_name if isinstance(cls_name, str) else (cls_name.group(1) if cls_name else None)
    if cls_name is None:
        return f"no class in the name {name}"
    types = {**{v: k for k, v in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()},
             **{v: k for k, v in modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.items()}}
    if cls_name == "Gemma3ForConditionalGeneration":  # with a local processor (SmolLM2's tokenizer + image tokens)
        from branchreplay.models import default_model_dir
        from branchreplay.tiny_models import save_tiny_vision_model

        save_tiny_vision_model(root / name, default_model_dir(), dtype=torch.bfloat16)
        return None
    if cls_name == "Qwen2VLForConditionalGeneration":  # the engine runs it (tests/test_engine_vision.py)
        return f"{cls_name}: its processor's video processor needs torchvision, which is not installed here"
    if "ConditionalGeneration" in cls_name:  # its processor (image tokens, vision config) has no stand-in here
        return f"{cls_name}: a vision-language model, whose processor has no stand-in here"
    if cls_name not in types or not hasattr(transformers, cls_name):
        return f"{cls_name}: no text model of that class here (remote code or unknown)"
    model_type = types[cls_name]
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=tokenizer.bos_token_id)
    try:
        config = AutoConfig.for_model(model_type, **TINY, **FAMILY_EXTRA.get(model_type, {}), **ids)
        if "SequenceClassification" in cls_name:
            config.num_labels = 1
        torch.manual_seed(0)
        model = getattr(transformers, cls_name)(config).to(torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - the reason goes into the table
        return f"{cls_name}: the stand-in does not build here ({type(e).__name__}: {str(e)[:120]})"
    path = root / name
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return None


def stand_in_datasets(trl_src: Path, root: Path) -> dict[str, str]:
    """Run each of TRL's `scripts/generate_*_dataset.py` with `push_to_hub` saving under root/<repo_id>/<config>;
    returns {script: why it did not run} for those that failed."""
    from datasets import Dataset, DatasetDict

    configs: dict[str, dict[str, list[str]]] = collections.defaultdict(dict)  # repo -> config -> splits

    def save(self, repo_id, config_name="default", **kwargs):
        parts = self if isinstance(self, DatasetDict) else {"train": self}
        for split, part in parts.items():
            target = root / repo_id / config_name / f"{split}.parquet"
            target.parent.mkdir(parents=True, exist_ok=True)
            part.to_parquet(str(target))
            configs[repo_id].setdefault(config_name, []).append(split)

    failed = {}
    with mock.patch.object(Dataset, "push_to_hub", save), mock.patch.object(DatasetDict, "push_to_hub", save):
        for script in sorted((trl_src / "scripts").glob("generate_*_dataset.py")):
            spec = importlib.util.spec_from_file_location(script.stem, script)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
                parser_cls = module.ScriptArguments
                defaults = {f: getattr(parser_cls(), f) for f in parser_cls.__dataclass_fields__}
                module.main(**{**defaults, "push_to_hub": True})
            except Exception as e:  # noqa: BLE001
                failed[script.name] = f"{type(e).__name__}: {str(e)[:120]}"
    for repo_id, by_config in configs.items():  # the README's configs: load_dataset(folder, config_name)
        lines = ["---", "configs:"]
        for config_name, splits in by_config.items():
            lines += [f"- config_name: {config_name}", "  data_files:"]
            lines += [f"  - split: {s}\n    path: {config_name}/{s}.parquet" for s in splits]
        (root / repo_id / "README.md").write_text("\n".join(lines + ["---", ""]))
    return failed


def run_suite(work: Path, suite: str, side: str, extra: list[str], one_thread: bool = False
              ) -> dict[str, tuple[str, str]]:
    """pytest of tests/test_<suite>_trainer.py in `work` for one side (`one_thread`: OMP_NUM_THREADS=1, when the
    sides run at once); {test id: (outcome, message)}."""
    report = work / f"{suite}-{side}.xml"
    env = dict(os.environ, TRL_SUITE_SIDE=side, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(work), CUDA_VISIBLE_DEVICES="",
               **({"OMP_NUM_THREADS": "1"} if one_thread else {}))
    command = [sys.executable, "-m", "pytest", f"tests/test_{suite}_trainer.py", "-p", "swap_trainers", "-q",
               "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={report}", *extra]
    report.unlink(missing_ok=True)  # never read an earlier run's report
    done = subprocess.run(command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode not in (0, 1) or not report.exists():  # 0: all passed, 1: some failed; else pytest broke
        raise RuntimeError(f"pytest of {suite} ({side}) exited {done.returncode}: {done.stdout[-2000:]}")
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        child = next(iter(case), None)
        if child is None or child.tag in ("system-out", "system-err"):
            outcomes[test] = ("passed", "")
        else:
            message = (child.get("message") or child.text or "").strip().splitlines()
            outcomes[test] = (child.tag, message[0][:200] if message else "")
    return outcomes


def verdict(control: tuple[str, str], tree: tuple[str, str]) -> tuple[str, str]:
    """One test's row: (pass | refused by name | cannot run here | FAILS, reason)."""
    if control[0] != "passed":
        return "cannot run here", f"{control[0]} with TRL's class too: {control[1]}"
    if tree[0] == "passed":
        return "pass", ""
    if re.search(r"Tree(GRPO|RLOO|DPO)Trainer: ", tree[1]):  # a refusal, or a family's failed self-check
        return "refused by name", tree[1]
    return "FAILS", f"{tree[0]}: {tree[1]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trl-src", type=Path, required=True, help="a TRL source checkout (tests/ and scripts/)")
    ap.add_argument("--suites", nargs="+", choices=SUITES, default=list(SUITES))
    ap.add_argument("--out", type=Path, default=Path("docs/trl_suite.md"), help="the per-test table (markdown)")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a new temporary one)")
    ap.add_argument("--parallel", action="store_true",
                    help="run the two sides at once, one torch thread each (about half the time on 2 cores)")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments after --, e.g. -- -k 'not vllm'")
    a = ap.parse_args()
    for part in ("tests", "scripts"):
        if not (a.trl_src / part / ("test_grpo_trainer.py" if part == "tests" else "")).exists():
            ap.error(f"--trl-src {a.trl_src}: no {part}/ of a TRL source checkout there (fetch TRL's repository and "
                     "pass its root)")
    from transformers import AutoTokenizer

    from branchreplay.models import default_model_dir

    work = a.work or Path(tempfile.mkdtemp(prefix="trl-suite-"))
    shutil.copytree(a.trl_src / "tests", work / "tests", dirs_exist_ok=True)
    (work / "swap_trainers.py").write_text(PLUGIN)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    names = sorted({n for s in a.suites for n in HUB_NAME.findall((work / f"tests/test_{s}_trainer.py").read_text())})
    missing = {n: why for n in names if "/tiny-" in n or n in FULL_SIZE
               if (why := stand_in_model(n, work, tokenizer)) is not None}
    failed_scripts = stand_in_datasets(a.trl_src, work)
    lines = [f"# TRL's own test suites with the tree trainers ({a.trl_src})", "",
             "Written by `scripts/trl_suite.py`; the control is TRL's own class on the same stand-ins.", ""]
    lines += [f"- no stand-in for `{n}`: {why}" for n, why in missing.items()]
    lines += [f"- dataset script `{s}` did not run: {why}" for s, why in failed_scripts.items()]
    summary = []
    for suite in a.suites:
        with concurrent.futures.ThreadPoolExecutor(2 if a.parallel else 1) as pool:  # the sides: subprocesses
            control, tree = pool.map(functools.partial(run_suite, work, suite, extra=a.pytest_args,
                                                       one_thread=a.parallel), ("trl", "tree"))
        rows = {test: verdict(control[test], tree.get(test, ("missing", ""))) for test in control}
        line, table = section(suite, f"tests/test_{suite}_trainer.py", rows)
        summary.append(line)
        lines += table
    return write_report(a.out, lines, summary, f"work folder: {work}")


def write_report(out: Path, lines: list[str], summary: list[str], where: str) -> int:
    """Write the markdown report `lines` to `out`, print the suites' summary lines and where the table and the work
    are; returns the exit status: 1 when a summary line counts a FAIL, else 0."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(summary))
    print(f"table: {out}; {where}")
    return 1 if any(" 0 FAILS" not in line for line in summary) else 0



def section(name: str, heading: str, rows: dict[str, tuple[str, str]]) -> tuple[str, list[str]]:
    """One suite's outcomes ({test: (verdict, reason)}): its summary line ("<name>: N tests: ...") and its markdown
    section (the heading, the summary, a row per test in name order)."""
    counts = collections.Counter(v for v, _ in rows.values())
    summary = f"{name}: {len(rows)} tests: " + ", ".join(
        f"{counts[k]} {k}" for k in ("pass", "refused by name", "cannot run here", "FAILS"))
    return summary, ["", f"## {heading}", "", summary, "", "| test | outcome | reason |", "|---|---|---|",
                     *(f"| `{t}` | {v} | {why.replace('|', '/')} |" for t, (v, why) in sorted(rows.items()))]

if __name__ == "__main__":
    sys.exit(main())
