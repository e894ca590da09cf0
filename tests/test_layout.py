"""The package's floors, drawn from its imports (every `import` and `from ... import`, at module level or inside a
function): no import circle, and no import that runs up the floors. Bottom to top: the vocabulary at the root
(tree, losses, models, ...), `reference` (the other ways to compute the gradient), `engine`, `decode` (in-process
generation), `rl`, `trl`, `check` (verify and its parallel run, above what they check), `bench`; the package's face
(`__init__`, `cli`, `__main__`) above them all. docs/architecture.md draws the same map. And every module's tests
are found by its name, or by its entry in COVERED_BY."""

import ast
import re
from pathlib import Path

import pytest

import branchreplay

FLOORS = ["", "reference", "engine", "decode", "rl", "trl", "check", "bench"]
FACE = {"branchreplay", "branchreplay.cli", "branchreplay.__main__"}


def modules(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} of every module under `root` (the folder of `package`)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(root: Path, package: str, typing: bool = True) -> dict[str, set[str]]:
    """{module: the package's modules it imports}; `from x import name` counts as x.name where that is a module.
    `typing` False leaves out the imports under `if TYPE_CHECKING:` (annotations only: they never run)."""
    known = modules(root, package)
    edges = {}
    for name, path in known.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        tree = ast.parse(path.read_text())
        typed = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
        for node in ast.walk(tree):
            if not typing and id(node) in typed:
                continue
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level + 1] + [node.module or ""]) if node.level else node.module
                base = base.rstrip(".")
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
                lazy = [v.value for v in node.value.values if isinstance(v, ast.Constant)]  # `lazy.lazy_exports`
                levels = [len(v) - len(v.lstrip(".")) for v in lazy]
                targets |= {".".join(here[: len(here) - n + 1] + [v.lstrip(".")]) for v, n in zip(lazy, levels,
                                                                                                  strict=True)}
        edges[name] = {t for t in targets if t in known and t != name}
    return edges


def floor(module: str) -> int:
    if module in FACE:
        return len(FLOORS)
    parts = module.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 2 or parts[1] in FLOORS else 0


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() for b in targets if floor(b) > floor(a))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_and_none_up_the_floors():
    """No floor imports from a floor above it, annotations included; no circle among the imports that run (an
    annotation's import under TYPE_CHECKING never does: `Algorithm` names the `Config` that imports it)."""
    root = Path(branchreplay.__file__).parent
    edges = imports(root, "branchreplay")
    assert set(FLOORS[1:]) <= {m.split(".")[1] for m in edges if m.count(".") >= 1}  # every floor exists
    assert circles(imports(root, "branchreplay", typing=False)) == []
    assert upward(edges) == []


def planted(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package `branchreplay` with the floors engine and rl, and `files` ({path in it: text})."""
    root = tmp_path / "branchreplay"
    for folder in ("engine", "rl"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_the_check_sees_a_planted_circle_and_an_upward_import(tmp_path):
    """Control: a package whose engine imports rl, and two modules importing each other, fails both checks."""
    root = planted(tmp_path, {"engine/stack.py": "from ..rl import policy\n",
                              "rl/policy.py": "def f():\n    from ..engine.stack import run\n",
                              "engine/__init__.py": '_EXPORTS = {"Policy": "..rl.policy"}\n'})
    edges = imports(root, "branchreplay")
    assert upward(edges) == [("branchreplay.engine", "branchreplay.rl.policy"),
                             ("branchreplay.engine.stack", "branchreplay.rl.policy")]
    assert circles(edges) == [["branchreplay.engine.stack", "branchreplay.rl.policy"]]


def test_an_annotation_import_counts_up_the_floors_but_not_in_a_circle(tmp_path):
    """Control: an import under `if TYPE_CHECKING:` that runs up the floors is caught; one that closes a circle of
    annotations is not a circle (it never runs)."""
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {} import a\n"
    root = planted(tmp_path, {"rl/a.py": "from . import b\n", "rl/b.py": typed.format("."),
                              "engine/c.py": typed.format("..rl")})
    assert circles(imports(root, "branchreplay")) == [["branchreplay.rl.a", "branchreplay.rl.b"]]
    assert circles(imports(root, "branchreplay", typing=False)) == []
    assert upward(imports(root, "branchreplay")) == [("branchreplay.engine.c", "branchreplay.rl.a")]


@pytest.mark.parametrize("folder", FLOORS[1:])
def test_each_floor_is_a_folder_of_the_package(folder):
    assert (Path(branchreplay.__file__).parent / folder / "__init__.py").is_file()


def test_every_folder_of_modules_is_a_package():
    """A folder of modules without `__init__.py` imports in an editable install but is left out of a built wheel
    (`packages.find`): engine/parallel/ was, for one commit."""
    root = Path(branchreplay.__file__).parent
    folders = {p.parent for p in root.rglob("*.py")}
    assert sorted(str(f.relative_to(root)) for f in folders if not (f / "__init__.py").is_file()) == []


def test_the_architecture_page_maps_every_module():
    """docs/architecture.md's module map names every folder and module of the package (a word of the map)."""
    page = Path(__file__).parents[1] / "docs" / "architecture.md"
    text = page.read_text().split("## Module map", 1)[1].split("```")[1]
    words = set(re.findall(r"\w+", text))
    root = Path(branchreplay.__file__).parent
    names = {p.stem for p in root.rglob("*.py") if p.stem not in ("__init__", "__main__")}
    names |= {p.name for p in root.rglob("*") if p.is_dir() and (p / "__init__.py").is_file()}
    assert sorted(names - words) == []


def test_rollouts_import_no_algorithm_and_no_back_end_is_compared_by_name():
    """A step's sampling knows nothing of the algorithm that trains on it (rl/rollouts imports no rl/algorithms:
    GRPO's advantages are its own part's estimate), and the sampler's back-end is chosen in one place, the config
    (`SamplingConfig.uses_vllm`): no other module compares sampling.backend by name."""
    root = Path(branchreplay.__file__).parent
    edges = imports(root, "branchreplay")
    crossing = sorted((a, b) for a, targets in edges.items() for b in targets
                      if a.startswith("branchreplay.rl.rollouts") and b.startswith("branchreplay.rl.algorithms"))
    assert crossing == []
    configs = {root / "decode" / "config.py", *(root / "rl" / "config").glob("*.py")}
    compared = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                      if p not in configs and re.search(r"backend\s*[!=]=", p.read_text()))
    assert compared == []


# -- every module's test, findable by name ------------------------------------------------------------------------

TESTS = Path(__file__).parent

COVERED_BY = {  # a module without a test file of its own name: the test files that exercise it
    "__init__.py": ("test_engine_self_check.py", "test_engine_families_unregistered.py"),  # replay_* under `force`
    "__main__.py": "test_rl_rollouts_vllm_server_process.py",  # `python -m branchreplay vllm-serve`
    "cli.py": "test_check_cli.py",
    "fields.py": "test_rl_config.py",
    "lazy.py": ("test_check_cli.py", "test_rl_config.py"),  # the command line and a config parse without torch
    "loss_types.py": ("test_losses_trl.py", "test_engine_sequence.py"),
    "tiny_models.py": ("test_models.py", "test_engine_families_unregistered.py"),
    "value.py": "test_rl_algorithms.py",
    "reference/float64_delta_rule.py": "test_engine_families_recurrent.py",
    "reference/float64_formulas.py": "test_engine_families_gemma4_llama4.py",
    "reference/memory.py": "test_bench_runner.py",
    "reference/naive.py": ("test_engine_replay.py", "test_rl_algorithms.py"),  # the reference of every exactness test
    "reference/padded.py": ("test_reference_methods.py", "test_bench_runner.py"),
    "reference/prompt_sharing.py": "test_bench_runner.py",
    "reference/shapes.py": "test_engine_replay.py",
    "reference/work.py": "test_bench_runner.py",
    "engine/cache.py": ("test_engine_replay.py", "test_engine_attention.py"),
    "engine/config.py": ("test_engine_replay.py", "test_rl_config.py"),
    "engine/options.py": ("test_engine_families_recurrent.py", "test_rl_run_trainer.py"),
    "engine/embedding.py": "test_engine_replay.py",
    "engine/latent.py": "test_engine_families_mla.py",
    "engine/masks.py": ("test_engine_replay.py", "test_engine_attention.py"),
    "engine/model_view.py": "test_engine_replay.py",
    "engine/packs.py": ("test_engine_replay.py", "test_engine_schedule.py"),
    "engine/parallel/lockstep.py": ("test_engine_distributed.py", "test_engine_context_parallel.py"),
    "engine/parallel/sharding.py": ("test_engine_distributed.py", "test_engine_context_parallel.py"),
    "engine/recurrent.py": ("test_engine_families_recurrent.py", "test_engine_families_hybrid.py"),
    "engine/stack.py": "test_engine_replay.py",
    "engine/temperature.py": "test_engine_families_gemma4_llama4.py",
    "decode/config.py": "test_decode_loop.py",
    "decode/forward.py": "test_decode_loop.py",
    "decode/rows/dynamic.py": ("test_decode_loop.py", "test_decode_rows_static.py"),
    "decode/rows/llama.py": "test_decode_loop.py",
    "decode/turns.py": "test_rl_agent.py",
    "decode/in_process.py": ("test_rl_run_trainer.py", "test_rl_agent.py"),  # the in-process sampler back-end
    "rl/cli.py": ("test_rl_data_datafiles.py", "test_models_lora.py"),  # train, eval; export
    "rl/policy.py": ("test_rl_run_trainer.py", "test_engine_distributed.py"),
    "rl/shards.py": "test_rl_algorithms.py",
    "rl/agent/conversation.py": "test_rl_agent_environments.py",
    "rl/agent/task.py": "test_rl_agent.py",
    "rl/algorithms/advantages.py": ("test_rl_algorithms.py", "test_rl_run_trainer.py"),
    "rl/algorithms/base.py": "test_rl_algorithms.py",
    "rl/algorithms/dpo.py": ("test_engine_sequence.py", "test_rl_algorithms_parallel.py"),
    "rl/algorithms/grpo.py": ("test_rl_run_trainer.py", "test_losses_trl.py"),
    "rl/algorithms/mismatch.py": "test_rl_rollouts_vllm.py",  # truncated importance sampling
    "rl/algorithms/ppo.py": "test_rl_algorithms.py",
    "rl/algorithms/reinforce_pp.py": "test_rl_algorithms.py",
    "rl/algorithms/rloo.py": "test_rl_algorithms.py",
    "rl/config/help.py": "test_rl_config.py",
    "rl/config/reference.py": "test_rl_config.py",
    "rl/config/resolve.py": "test_rl_data_datafiles.py",  # eval of a run from another folder
    "rl/config/resume.py": ("test_rl_run_trainer_faults.py", "test_rl_config.py"),
    "rl/config/run.py": "test_rl_config.py",
    "rl/config/sections.py": "test_rl_config.py",
    "rl/config/task.py": "test_rl_data_tasks_rewards.py",
    "rl/config/trl_fields.py": "test_rl_config.py",
    "rl/config/trl_names.py": "test_rl_config.py",
    "rl/config/values.py": "test_rl_config.py",
    "rl/data/cells.py": "test_rl_data_datafiles.py",
    "rl/data/order.py": "test_rl_run_trainer.py",
    "rl/data/preferences.py": "test_engine_sequence.py",
    "rl/data/rewards.py": "test_rl_data_tasks_rewards.py",
    "rl/rollouts/batch.py": "test_tree_forest.py",
    "rl/rollouts/sampler.py": ("test_rl_rollouts_ahead.py", "test_rl_run_trainer.py"),
    "rl/rollouts/trajectories.py": "test_rl_agent.py",
    "rl/rollouts/vllm/backend.py": "test_rl_rollouts_vllm.py",
    "rl/rollouts/vllm/client.py": "test_rl_rollouts_vllm.py",
    "rl/rollouts/vllm/sampling.py": "test_rl_rollouts_vllm.py",
    "rl/rollouts/vllm/weights_file.py": "test_rl_rollouts_vllm.py",
    "rl/run/checkpoint.py": ("test_rl_run_trainer_faults.py", "test_rl_run_crashes.py"),
    "rl/run/dry_run.py": "test_rl_data_datafiles.py",
    "rl/run/evaluation.py": ("test_rl_run_log.py", "test_rl_agent.py"),
    "rl/run/export.py": "test_models_lora.py",
    "rl/run/family.py": "test_rl_run_trainer.py",  # self_check.json in the run folder
    "rl/run/skips.py": "test_rl_run_trainer_faults.py",
    "rl/run/stops.py": ("test_rl_run_parallel.py", "test_rl_run_trainer_faults.py"),
    "rl/run/step.py": ("test_rl_run_trainer.py", "test_rl_algorithms_parallel.py"),  # train_step, its phases
    "trl/base.py": "test_trl_grpo.py",
    "trl/fsdp2.py": "test_trl_processes.py",
    "trl/options.py": ("test_trl_grpo.py", "test_rl_config.py"),
    "trl/rows.py": ("test_trl_grpo.py", "test_trl_vision.py"),
    "trl/split_groups.py": "test_trl_processes.py",
    "trl/zero.py": "test_trl_processes.py",
    "check/parallel.py": ("test_engine_distributed.py", "test_rl_algorithms_parallel.py"),  # verify --nproc 2
    "check/rounding.py": ("test_engine_families_recurrent.py", "test_engine_families_more.py"),
    "check/verify.py": "test_check_cli.py",
    "bench/cli.py": "test_bench_runner.py",
    "bench/fsdp_memory.py": "test_engine_distributed.py",
    "bench/measure.py": "test_bench_runner.py",
    "bench/objectives.py": "test_bench_runner.py",
    "bench/output.py": "test_bench_runner.py",
    "bench/parallel.py": "test_engine_distributed.py",  # bench --nproc 2
    "bench/scenarios.py": "test_bench_runner.py",
    "bench/state.py": ("test_engine_families_attention.py", "test_engine_families_mla.py"),
}
"""The rule (CONTRIBUTING.md): a module's tests are in tests/test_<floor>_<module>.py, its path below the package
with `_` for `/` (rl/run/trainer.py: test_rl_run_trainer.py; tree.py at the root: test_tree.py), or its floor and
its own name (engine/parallel/sharding.py: test_engine_sharding.py); more files add a word
(test_engine_families_mla.py). A module tested elsewhere, through the modules that use it, is listed here."""


def modules_to_test(root: Path) -> list[str]:
    """The package's modules that need a test, as paths below `root`: every module, and a package's `__init__.py`
    that defines a function or class (not one that only imports and re-exports)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        body = ast.parse(path.read_text()).body
        if path.name != "__init__.py" or any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in body):
            out.append(path.relative_to(root).as_posix())
    return out


def named_tests(module: str, tests: set[str]) -> set[str]:
    """The files of `tests` that `module` (a path below the package) has by name: test_<path>.py or
    test_<path>_<more>.py, or test_<floor>_<name>.py."""
    parts = Path(module).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    if not parts:  # the package's own __init__.py: every test's prefix
        return set()
    full = "test_" + "_".join(parts)
    found = {t for t in tests if t == f"{full}.py" or t.startswith(f"{full}_")}
    return found | ({f"test_{parts[0]}_{parts[-1]}.py"} & tests if len(parts) > 2 else set())


def layout_faults(root: Path, tests: set[str], covered_by: dict) -> list[str]:
    """What breaks the rule: a module without a test by name or an entry, an entry for a module that is not there
    or that has a test by name, an entry naming a test file that is not there."""
    modules = modules_to_test(root)
    faults = [f"{m}: no tests/{'test_' + '_'.join(Path(m).with_suffix('').parts)}.py and no COVERED_BY entry"
              for m in modules if not named_tests(m, tests) and m not in covered_by]
    for module, files in covered_by.items():
        if module not in modules:
            faults.append(f"COVERED_BY[{module!r}]: no such module")
        elif named_tests(module, tests):
            faults.append(f"COVERED_BY[{module!r}]: it has {sorted(named_tests(module, tests))} by name")
        faults += [f"COVERED_BY[{module!r}]: no tests/{f}" for f in ((files,) if isinstance(files, str) else files)
                   if f not in tests]
    return faults


def test_every_module_has_a_test_by_name_or_a_covered_by_entry():
    root = Path(branchreplay.__file__).parent
    assert layout_faults(root, {p.name for p in TESTS.glob("test_*.py")}, COVERED_BY) == []


def test_the_layout_check_sees_a_module_without_a_test_and_a_stale_entry(tmp_path):
    """Control: a module with no test, an entry for a removed module, an entry for a module that has its own test
    now, and an entry naming a removed test file are each a fault; a module of a sub-package tested by its floor and
    name, and a package that only re-exports, are not."""
    root = tmp_path / "branchreplay"
    (root / "engine" / "parallel").mkdir(parents=True)
    for name, text in [("__init__.py", "def f():\n    pass\n"), ("tree.py", ""), ("engine/__init__.py", "X = 1\n"),
                       ("engine/stack.py", ""), ("engine/parallel/__init__.py", ""),
                       ("engine/parallel/sharding.py", ""), ("engine/parallel/lockstep.py", "")]:
        (root / name).write_text(text)
    tests = {"test_tree_forest.py", "test_engine_sharding.py", "test_engine_stack.py"}
    covered = {"__init__.py": "test_tree_forest.py", "engine/parallel/lockstep.py": "test_engine_stack.py"}
    assert layout_faults(root, tests, covered) == []
    del covered["engine/parallel/lockstep.py"]
    covered |= {"engine/gone.py": "test_tree_forest.py", "engine/stack.py": "test_engine_stack.py",
                "tree.py": ("test_tree_forest.py", "test_gone.py")}
    assert layout_faults(root, tests, covered) == [
        "engine/parallel/lockstep.py: no tests/test_engine_parallel_lockstep.py and no COVERED_BY entry",
        "COVERED_BY['engine/gone.py']: no such module",
        "COVERED_BY['engine/stack.py']: it has ['test_engine_stack.py'] by name",
        "COVERED_BY['tree.py']: it has ['test_tree_forest.py'] by name",
        "COVERED_BY['tree.py']: no tests/test_gone.py"]


# -- the fast suite -----------------------------------------------------------------------------------------------

FAST_EXACTNESS = {  # floor: a test that proves it exact and that `make test-fast` (`pytest -m "not slow"`) runs
    "": "test_tree_forest.py::test_one_forest_per_step_equals_per_group_trees_and_naive",
    "reference": "test_reference_methods.py::test_reference_methods_train_the_same_model",
    "engine": "test_engine_replay.py::test_packs_below_different_parents_equal_naive",
    "decode": "test_decode_loop.py::test_logprobs_match_uncached_reference",
    "rl": "test_rl_algorithms.py::test_rloo_sequence_loss_equals_naive",
    "trl": "test_trl_rloo.py::test_tree_gradient_equals_rloo_trainer_on_the_same_batch",
    "check": "test_check_cli.py::test_verify_loss_dpo_passes_and_fails_a_wrong_gradient",
    "bench": "test_check_cli.py::test_bench_json_keys",  # the bench's own max_rel_grad_err
}


def marked_slow(path: Path, name: str) -> bool | None:
    """Whether test function `name` of the file `path` is marked slow (`@pytest.mark.slow`, or the module's
    `pytestmark`), read from its source; None when the file has no such function."""
    body = ast.parse(path.read_text()).body
    slow = {"pytest.mark.slow"}
    module = [n.value for n in body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "pytestmark"]
    marks = [ast.unparse(e) for v in module for e in (v.elts if isinstance(v, (ast.List, ast.Tuple)) else [v])]
    function = next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    return None if function is None else bool(slow & {*marks, *(ast.unparse(d) for d in function.decorator_list)})


def test_the_fast_suite_keeps_an_exactness_test_of_each_floor():
    assert set(FAST_EXACTNESS) == set(FLOORS)
    said = {test: marked_slow(TESTS / test.split("::")[0], test.split("::")[1]) for test in FAST_EXACTNESS.values()}
    assert [test for test, slow in said.items() if slow is not False] == []  # missing (None) or slow (True)


def test_the_slow_mark_is_seen_on_a_function_and_on_a_module(tmp_path):
    """Control of `marked_slow`: a decorated function, a module's mark in a list, and a function that is not there."""
    (tmp_path / "test_a.py").write_text("import pytest\n\n\n@pytest.mark.slow\n@pytest.mark.parametrize('x', [1])\n"
                                        "def test_one(x):\n    pass\n\n\ndef test_two():\n    pass\n")
    (tmp_path / "test_b.py").write_text("import pytest\n\npytestmark = [pytest.mark.smollm2, pytest.mark.slow]\n\n\n"
                                        "def test_three():\n    pass\n")
    assert [marked_slow(tmp_path / "test_a.py", name) for name in ("test_one", "test_two", "test_gone")] == \
        [True, False, None]
    assert marked_slow(tmp_path / "test_b.py", "test_three") is True
