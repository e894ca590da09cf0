"""scripts/family_census.py (docs/support.md's table): the flagship families are each "exact" or "refused" by name,
never "failed", when built tiny from their own config class (`tiny_models.shrunk_config`), saved and loaded back
by `models.load_model`; and the table and JSON rows come out as the script writes them."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "family_census.py"


def census_module():
    spec = importlib.util.spec_from_file_location("family_census", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_runs_without_torch():
    done = subprocess.run([sys.executable, "-c", f"import runpy, sys; sys.argv = ['x', '--help']\n"
                           f"try:\n    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
                           "except SystemExit:\n    pass\nprint('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--types" in done.stdout and done.stdout.strip().endswith("False")


def test_shrunk_config_keeps_the_layer_pattern():
    from branchreplay.tiny_models import shrunk_config

    config = shrunk_config("smollm3")  # NoPE every 4th layer: one layer with rotary, one without
    assert config.num_hidden_layers == len(config.no_rope_layers) == len(config.layer_types) == 2
    assert sorted(config.no_rope_layers) == [0, 1] and config.hidden_size == 64 and config.vocab_size == 256
    config = shrunk_config("gemma3_text")  # sliding and full attention layers both kept
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}


@pytest.fixture(scope="module")
def flagship_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("census")
    module = census_module()
    code = module.main(["--types", "flagship", "--shapes", "branches-of-branches", "--timeout", "120", "--jobs", "2",
                        "--json", str(out / "census.json"), "--markdown", str(out / "census.md")])
    rows = json.loads((out / "census.json").read_text())
    return code, rows, (out / "census.md").read_text(), module


@pytest.mark.slow
def test_the_flagship_families_are_exact_or_refused(flagship_rows):
    code, rows, _, module = flagship_rows
    assert [r["family"] for r in rows] == list(module.FLAGSHIP)
    failed = {r["family"]: r["note"] for r in rows if r["status"] not in ("exact", "refused")}
    assert not failed, failed
    assert code == 0
    for r in rows:
        if r["status"] == "exact":
            assert r["float64_error"] <= 1e-4 and r["float32_ratio"] <= 2.0, r


@pytest.mark.slow
def test_the_table_has_a_line_per_type_and_the_counts(flagship_rows):
    _, rows, table, module = flagship_rows
    lines = table.splitlines()
    assert lines[0] == "| " + " | ".join(module.COLUMNS) + " |"
    assert len([line for line in lines if line.startswith("| ")]) == len(rows) + 1
    assert lines[-1].endswith(f"(of {len(rows)} types)")
