"""`branchreplay estimate`: the token and FLOP ratios of a run's own prompts laid out as the trainer lays them out,
and the speed-up they predict, checked against what the CPU bench measured: on every current shared-prompt and
low-sharing row of results/ (and the demo's shape) the estimate's FLOP ratio is the bench's own, and its
predicted speed-up (the FLOP ratio) is within 25% of the measured one."""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from branchreplay.bench.runner import BENCH_MODEL
from branchreplay.cli import main
from branchreplay.rl.config import Config
from branchreplay.rl.estimate import estimate

RESULTS = Path(__file__).resolve().parents[1] / "results"
SWEEPS, ROUND4 = "shared-prompt-sweeps-2026-11/", "never-slower-than-dense-2026-12/round4/"
ROWS = [SWEEPS + name for name in ("sp-P1024-G8.json", "sp-P4096-G4.json", "sp-P4096-G8.json", "sp-P4096-G16.json",
                                   "sp-P4096-G64.json", "sp-P16384-G8.json", "sp-P32000-G8.json", "headline.json")] + \
       [ROUND4 + name for name in ("low-sharing-t2.json", "low-sharing-t1-rerun.json", "demo-shape-t1.json",
                                   "demo-shape-t2.json")]
"""The bench files docs/benchmarks.md shows as current (shared-prompt sweeps, the headline, low sharing on 2
threads and 1, the demo's shape)."""


def _measured(name: str) -> list[dict]:
    data = json.loads((RESULTS / name).read_text())
    rows = data["rows"] if isinstance(data, dict) else data
    return [r for r in rows if r["method"] == "branchreplay" and r["scenario"] == "shared-prompt"]


@pytest.mark.parametrize("name", ROWS)
def test_the_estimate_predicts_the_benchs_speedup_within_25_percent(name):
    rows = _measured(name)
    assert rows, name
    for row in rows:
        c = row["config"]
        config = Config.from_dict({"grpo": {"num_generations": c["generations"], "prompts_per_step": 1},
                                   "sampling": {"max_new_tokens": c["response_tokens"]}})
        prompt = [3 + i % 2000 for i in range(c["prompt_tokens"])]
        e = estimate(config, [prompt], LlamaConfig(**BENCH_MODEL))
        assert e.flop_ratio == pytest.approx(row["flop_ratio"], rel=0.05), (name, row["label"])
        assert e.token_ratio == pytest.approx(row["token_ratio"], rel=0.02), (name, row["label"])
        assert abs(e.flop_ratio - row["speedup"]) <= 0.25 * row["speedup"], (name, row["label"], row["speedup"])
        low, high = e.speedup
        assert low < e.flop_ratio < high


def test_estimate_from_the_command_line_on_the_demo_config_and_a_file(model_folder, tmp_path, capsys):
    """configs/demo.yaml's prompts (a shared system prompt and few-shot turns: the step's 4 prompts share most of
    their tokens) and a user's file; a bad count is one line, exit 2."""
    assert main(["estimate", "--config", "configs/demo.yaml", "--model.spec", str(model_folder), "--prompts",
                 "8"]) == 0
    out = capsys.readouterr().out
    ratio = float(out.split("token ratio ")[1].split()[0])
    assert "8 prompts in 2 steps" in out and ratio > 2 and "predicted speed-up" in out and "GiB" in out
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(map(str, range(3, 3 + n)))}) + "\n" for n in (5, 50, 9)))
    assert main(["estimate", "--model.spec", str(model_folder), "--dataset", str(data), "--grpo.num_generations",
                 "4", "--grpo.prompts_per_step", "1", "--completion-tokens", "20"]) == 0
    out = capsys.readouterr().out
    assert "3 prompts in 3 steps: prompts of " in out and "4 completions of 20 tokens" in out
    assert main(["estimate", "--model.spec", str(model_folder), "--prompts", "many"]) == 2
    assert "--prompts='many': a whole number >= 1" in capsys.readouterr().err


def test_a_step_of_one_prompt_and_g_completions_has_the_closed_form_token_ratio():
    """G completions of C tokens below one P-token prompt: G(P + C) / (P + GC), the guide's table (docs/trl.md)."""
    config = Config.from_dict({"grpo": {"num_generations": 8, "prompts_per_step": 1},
                               "sampling": {"max_new_tokens": 64}})
    e = estimate(config, [list(range(3, 1003))], LlamaConfig(**BENCH_MODEL), dtype=torch.float32)
    assert e.token_ratio == pytest.approx(8 * 1064 / (1000 + 8 * 64))
