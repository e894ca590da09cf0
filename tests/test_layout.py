"""The package's floors, drawn from its imports (every `import` and `from ... import`, at module level or inside a
function): no import circle, and no import that runs up the floors. Bottom to top: the vocabulary at the root
(tree, losses, models, ...), `reference` (the other ways to compute the gradient), `engine`, `decode` (in-process
generation), `rl`, `trl`, `check` (verify and its parallel run, above what they check), `bench`; the package's face
(`__init__`, `cli`, `__main__`) above them all. docs/architecture.md draws the same map."""

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
