"""Run TRL's own distributed tests with the tree trainers swapped in, and TRL's classes as the control, on CPU:
the table of docs/trl_distributed_suite.md, summed up in docs/trl_results.md ("Several processes: DDP, FSDP2,
DeepSpeed ZeRO").

    .venv/bin/python scripts/trl_distributed_suite.py --trl-src PATH [--configs ddp zero2 zero3 fsdp2]
        [--max-steps N] [--out docs/trl_distributed_suite.md] [-- PYTEST_ARGS]

PATH is a TRL source checkout (its `tests/` and `scripts/`; the installed TRL is what runs, with its own
`trl/scripts/`). TRL's `tests/distributed/test_distributed.py` launches TRL's example scripts on 2 processes,
`accelerate launch --config_file tests/distributed/data/accelerate_configs/<config>.yaml trl/scripts/<trainer>.py`
(configs: ddp, zero2, zero3, fsdp2; a test passes when the launch exits 0), on the tiny Qwen2 models and the
`trl-internal-testing/zen` dataset. The tests that launch a GRPO, RLOO or DPO script run here (the SFT, KTO and
reward tests build no trainer that the tree replaces); nothing is downloaded and no GPU is needed:
  - the models and datasets are scripts/trl_suite.py's stand-ins (tiny random models of the named class, TRL's own
    dataset generator scripts), in a work folder that the launches run from, with HF_HUB_OFFLINE=1;
  - `trl/scripts/` in the work folder is the installed TRL's (the tests launch it by that path from their root);
  - the 2 GPUs are 2 CPU processes: a pytest plugin in the work folder lifts the tests' "requires multiple
    accelerators" skip, stands in for pytest-datadir's `lazy_shared_datadir` (not installed here: the test
    module's data/ folder), and replaces the test module's `run_command` by one that adds `--use_cpu` to the
    launched script's arguments (and `--max_steps N` with --max-steps), keeps each launch's output in
    <work>/logs/<side>/, stops it after --timeout seconds, and fails with the output's error lines;
  - accelerate selects FSDP or DeepSpeed only with an accelerator: a sitecustomize.py in the work folder (on
    PYTHONPATH) installs tests/trl_ranks.py's `on_cpu_processes` shim in each launched process (for the
    DeepSpeed configs first `deepspeed.init_distributed` over gloo; DS_ACCELERATOR=cpu), so the yaml's FSDP2 or
    ZeRO stage runs over the gloo processes.
Each selected test runs twice: once as it is (the control), once with `trl.GRPOTrainer`, `trl.RLOOTrainer` and
`trl.DPOTrainer` replaced by the tree trainers in each launched process before TRL's script imports them (the same
sitecustomize.py; nothing in this repository or in TRL is changed). The per-test outcomes go into a table: passes
with both; refused by name (the tree trainer's error names the setting); cannot run here (the control fails or
skips too, with its reason); FAILS (the control passes, the tree trainer fails otherwise: a gap to fix).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import trl_suite

TEST_FILE = "tests/distributed/test_distributed.py"
CONFIGS_DIR = "tests/distributed/data/accelerate_configs"
TRAINER_TESTS = "grpo or rloo or dpo"
"""The tests whose launched script builds a trainer that the tree replaces (pytest -k)."""
RANKS = Path(__file__).resolve().parents[1] / "tests" / "trl_ranks.py"

SITECUSTOMIZE = '''"""In each process that accelerate launches (LOCAL_RANK set; written by
scripts/trl_distributed_suite.py): the FSDP or DeepSpeed state that the accelerate config asks for, over the gloo
CPU processes (tests/trl_ranks.py's shim), and, when TRL_SUITE_SIDE=tree, the tree trainers in place of TRL's
before TRL's script imports them.
"""
import os

if "LOCAL_RANK" in os.environ:
    import importlib.util

    _spec = importlib.util.spec_from_file_location("trl_ranks", {ranks!r})
    _ranks = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_ranks)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":  # what accelerate does on a GPU
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    _ranks.on_cpu_processes().start()
    if os.environ.get("TRL_SUITE_SIDE") == "tree":
        import trl

        from branchreplay.trl import TreeDPOTrainer, TreeGRPOTrainer, TreeRLOOTrainer

        trl.GRPOTrainer, trl.RLOOTrainer, trl.DPOTrainer = TreeGRPOTrainer, TreeRLOOTrainer, TreeDPOTrainer
'''

PLUGIN = '''"""TRL's distributed tests on 2 CPU processes (written by scripts/trl_distributed_suite.py; loaded after
swap_trainers.py, which makes the checkout's tests/testing_utils.py import against the installed TRL).
"""
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests import testing_utils

testing_utils.require_torch_multi_accelerator = pytest.mark.skipif(False, reason="2 CPU processes stand in")
ERROR_LINE = re.compile(r"^(?:\\[rank\\d+\\]: )?([A-Za-z_][\\w.]*(?:Error|Exception): .*)")
LAUNCHER_ERRORS = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError", "subprocess.CalledProcessError")


@pytest.fixture
def lazy_shared_datadir(request):
    """pytest-datadir's fixture (that plugin is not installed here): the test module's data/ folder."""
    return request.path.parent / "data"


def error_lines(output: str) -> str:
    """The launch's distinct exception lines (not the launcher's own report of them), else its last line."""
    found = dict.fromkeys(match[1].strip() for line in output.splitlines() if (match := ERROR_LINE.match(line)))
    found = [line for line in found if not line.startswith(LAUNCHER_ERRORS)]
    return " / ".join(found[:3]) or (output.strip().splitlines() or ["no output"])[-1]


@pytest.fixture(autouse=True)
def launched_on_cpu(request, monkeypatch):
    """The test module's run_command: the launch with --use_cpu (and --max_steps), its output kept, a time limit."""
    logs = Path(os.environ["TRL_SUITE_LOGS"])
    log = logs / (re.sub(r"[^\\w.-]+", "_", request.node.name) + ".log")
    steps = os.environ.get("TRL_SUITE_MAX_STEPS")

    def run_command(command, env):
        command = [str(c) for c in command] + ["--use_cpu"]
        if steps and "--max_steps" not in command:
            command += ["--max_steps", steps]
        with open(log, "w") as out:
            launch = subprocess.Popen(command, env=env, cwd=request.module.ROOT, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True)
            try:
                returncode = launch.wait(timeout=float(os.environ["TRL_SUITE_TIMEOUT"]))
            except subprocess.TimeoutExpired:
                os.killpg(launch.pid, signal.SIGKILL)  # the launcher and its ranks
                launch.wait()
                pytest.fail(f"timed out after {os.environ['TRL_SUITE_TIMEOUT']} s ({log})")
        if returncode != 0:  # TRL's run_command asserts it is 0
            pytest.fail(f"exit {returncode}: {error_lines(log.read_text(errors='replace'))}")

    if hasattr(request.module, "run_command"):
        monkeypatch.setattr(request.module, "run_command", run_command)
'''


def prepare(trl_src: Path, work: Path) -> list[str]:
    """The work folder: TRL's tests, the installed TRL's scripts, the stand-ins, the plugins; the notes on what
    has no stand-in."""
    import trl
    from transformers import AutoTokenizer

    from branchreplay.models import default_model_dir

    shutil.copytree(trl_src / "tests", work / "tests", dirs_exist_ok=True)
    shutil.copytree(Path(trl.__file__).parent / "scripts", work / "trl" / "scripts", dirs_exist_ok=True)
    (work / "swap_trainers.py").write_text(trl_suite.PLUGIN)
    (work / "distributed_on_cpu.py").write_text(PLUGIN)
    (work / "sitecustomize.py").write_text(SITECUSTOMIZE.format(ranks=str(RANKS)))
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    names = sorted(set(trl_suite.HUB_NAME.findall((work / TEST_FILE).read_text())))
    notes = [f"- no stand-in for `{n}`: {why}" for n in names if "/tiny-" in n or n in trl_suite.FULL_SIZE
             if (why := trl_suite.stand_in_model(n, work, tokenizer)) is not None]
    return notes + [f"- dataset script `{s}` did not run: {why}"
                    for s, why in trl_suite.stand_in_datasets(trl_src, work).items()]


def run_side(work: Path, side: str, selection: str, a: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """pytest of the distributed tests in `work` for one side; {test id: (outcome, message)}."""
    report = work / f"distributed-{side}.xml"
    logs = work / "logs" / side
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TRL_SUITE_SIDE=side, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=str(work), CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", TQDM_DISABLE="1",
               OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               TRL_SUITE_LOGS=str(logs), TRL_SUITE_TIMEOUT=str(a.timeout),
               **({"TRL_SUITE_MAX_STEPS": str(a.max_steps)} if a.max_steps else {}))
    command = [sys.executable, "-m", "pytest", TEST_FILE, "-p", "swap_trainers", "-p", "distributed_on_cpu", "-q",
               "-p", "no:cacheprovider", "-o", "addopts=", "-k", selection, f"--junitxml={report}", *a.pytest_args]
    report.unlink(missing_ok=True)  # never read an earlier run's report
    done = subprocess.run(command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(done.stdout[-3000:], flush=True)
    if done.returncode not in (0, 1) or not report.exists():  # 0: all passed, 1: some failed; else pytest broke
        raise RuntimeError(f"pytest ({side}) exited {done.returncode}: {done.stdout[-2000:]}")
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        child = next((c for c in case if c.tag not in ("system-out", "system-err")), None)
        message = "" if child is None else (child.get("message") or child.text or "").strip()
        outcomes[case.get("name")] = ("passed", "") if child is None else (child.tag, " ".join(message.split())[:400])
    return outcomes


def config_of(test: str) -> str:
    """The accelerate config a test id names: `test_grpo[zero2]` -> zero2."""
    return test[test.index("[") + 1:-1] if "[" in test else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trl-src", type=Path, required=True, help="a TRL source checkout (tests/ and scripts/)")
    ap.add_argument("--configs", nargs="+", default=None,
                    help=f"accelerate configs (the yaml names in {CONFIGS_DIR}; default all)")
    ap.add_argument("--max-steps", type=int, default=None,
                    help="--max_steps for each launched script (default: TRL's, the scripts' full default training)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds each launch may take")
    ap.add_argument("--out", type=Path, default=Path("docs/trl_distributed_suite.md"), help="the table (markdown)")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a new temporary one)")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments after --, e.g. -- -x")
    a = ap.parse_args()
    if not (a.trl_src / TEST_FILE).exists() or not (a.trl_src / "scripts").is_dir():
        ap.error(f"--trl-src {a.trl_src}: no {TEST_FILE} and scripts/ of a TRL source checkout there")
    configs = a.configs or sorted(p.stem for p in (a.trl_src / CONFIGS_DIR).glob("*.yaml"))
    selection = f"({TRAINER_TESTS}) and ({' or '.join(configs)})"
    work = a.work or Path(tempfile.mkdtemp(prefix="trl-distributed-"))
    notes = prepare(a.trl_src, work)
    control = run_side(work, "trl", selection, a)
    tree = run_side(work, "tree", selection, a)
    rows = {test: trl_suite.verdict(control[test], tree.get(test, ("missing", ""))) for test in control}
    lines = [f"# TRL's distributed tests with the tree trainers ({a.trl_src})", "",
             "Written by `scripts/trl_distributed_suite.py`; 2 CPU processes per launch; the control is TRL's own "
             f"class on the same stand-ins. Tests: `-k \"{selection}\"`"
             f"{f', each launch with --max_steps {a.max_steps}' if a.max_steps else ''}.", "", *notes]
    summary = []
    for config in configs:
        line, table = trl_suite.section(config, config, {t: v for t, v in rows.items() if config_of(t) == config})
        summary.append(line)
        lines += table
    return trl_suite.write_report(a.out, lines, summary, f"work folder: {work} (each launch's output in logs/<side>/)")


if __name__ == "__main__":
    sys.exit(main())
