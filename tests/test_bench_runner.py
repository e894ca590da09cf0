"""The benchmark's baselines, FLOP counts, estimation paths and output schema, at tiny sizes."""

import json

import pytest
import torch

from branchreplay.bench.output import plot
from branchreplay.bench.runner import METHODS, Bench, BenchOptions, run_bench
from branchreplay.bench.scenarios import Scenario, agent_trajectories, scenario_grid, tree_sampled
from branchreplay.cli import main
from branchreplay.losses import GRPOLoss
from branchreplay.reference import work as F
from branchreplay.reference.naive import max_rel_grad_err, naive_backward
from branchreplay.reference.padded import padded_backward, padded_shape
from branchreplay.reference.prompt_sharing import prefix_grouper_version, prompt_groups, prompt_sharing_backward
from branchreplay.reference.shapes import SHAPES, make_rollouts, shared_prompt
from branchreplay.tiny_models import tiny_model
from branchreplay.tree import Rollout, RolloutTree

SHAPES_UNDER_TEST = {
    "shared-prompt": SHAPES["shared-prompt"],
    "forest": SHAPES["forest"],  # prompts of different lengths: left padding in the padded batch, 3 groups
    "edge-cases": SHAPES["edge-cases"],  # an empty completion, duplicates, a prefix of another
    "agent": lambda v, g: agent_trajectories(12, 3, 5, 4, (2, 1, 3), v, g),
    "tree-sampled": lambda v, g: tree_sampled(10, 12, ((0, 2), (4, 3)), v, g),
}
PS_IMPLS = ["equivalent"] + (["prefix-grouper"] if prefix_grouper_version() else [])


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", dtype=torch.float64)


def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    result = fn()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()], result


def _rollouts(shape: str, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return make_rollouts(SHAPES_UNDER_TEST[shape](256, g), g, old_logprobs=True)


@pytest.mark.parametrize("shape", list(SHAPES_UNDER_TEST))
def test_padded_batch_equals_naive(model, shape):
    rollouts, loss = _rollouts(shape), GRPOLoss(beta=0.0, epsilon_high=0.28)
    ref, naive = _grads(model, lambda: naive_backward(model, rollouts, loss))
    got, padded = _grads(model, lambda: padded_backward(model, rollouts, loss))
    err = max_rel_grad_err(got, ref)
    assert err < 1e-10, f"{shape}: padded batch gradient differs from naive by {err:.2e} (relative)"
    lp_err = max((a - b).abs().max().item() for a, b in zip(padded.logprobs, naive.logprobs, strict=True))
    assert lp_err < 1e-6 and abs(padded.loss - naive.loss) < 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("impl", PS_IMPLS)
@pytest.mark.parametrize("shape", list(SHAPES_UNDER_TEST))
def test_prompt_sharing_equals_naive(model, shape, impl):
    rollouts, loss = _rollouts(shape), GRPOLoss()
    ref, naive = _grads(model, lambda: naive_backward(model, rollouts, loss))
    got, shared = _grads(model, lambda: prompt_sharing_backward(model, rollouts, loss, impl=impl))
    err = max_rel_grad_err(got, ref)
    # float64 model, but stock HF upcasts some ops to float32 on the cached path (DESIGN.md): about 1e-7
    assert err < 1e-6, f"{shape}/{impl}: prompt-sharing gradient differs from naive by {err:.2e} (relative)"
    lp_err = max((a - b).abs().max().item() for a, b in zip(shared.logprobs, naive.logprobs, strict=True))
    assert lp_err < 1e-6 and abs(shared.loss - naive.loss) < 1e-9
    assert model.config._attn_implementation == "sdpa"  # prefix-grouper's attention switched back


def test_prompt_groups_and_padded_shape():
    rollouts = _rollouts("forest")
    groups = prompt_groups(rollouts)
    assert len(groups) == 3 and sorted(i for _, m in groups for i in m) == list(range(len(rollouts)))
    B, P_max, C_max = padded_shape(rollouts)
    assert B == len(rollouts) and P_max == max(P for P, _ in groups)


def test_flops_shared_prompt_tree_below_naive_and_single_rollout_equal():
    shape = F.ModelShape.of(tiny_model("llama"))
    g = torch.Generator().manual_seed(0)
    rollouts = make_rollouts(shared_prompt(100, 4, 10, 256, g), g)
    tree = F.tree_work(RolloutTree(rollouts))
    naive, shared = F.naive_work(rollouts), F.prompt_sharing_work(rollouts)
    assert tree.positions == 100 + 4 * 10 and naive.positions == 4 * 110
    # a shared prompt is all prompt-sharing can share, so it asks for the tree's FLOPs (its K/V copies are not FLOPs)
    assert tree.flops(shape) == shared.flops(shape) < naive.flops(shape)
    # attention keys: prompt once (1 + ... + 100), each response against 100 + its own
    assert tree.attention_keys == 100 * 101 // 2 + 4 * (10 * 100 + 10 * 11 // 2)
    # one rollout: the same decoder work; only the LM head rows differ (naive computes logits on every position,
    # the tree on trained ones)
    one = rollouts[:1]
    t1, n1 = F.tree_work(RolloutTree(one)), F.naive_work(one)
    assert (t1.positions, t1.attention_keys) == (n1.positions, n1.attention_keys)
    untrained = len(one[0]) - int(one[0].loss_mask.sum())
    assert n1.flops(shape) - t1.flops(shape) == 3 * 2 * shape.hidden * shape.vocab * untrained
    assert F.prompt_sharing_work(one).flops(shape) == t1.flops(shape)  # one suffix: nothing to share or repeat


def test_flops_tree_sampled_shares_response_prefixes():
    shape = F.ModelShape.of(tiny_model("llama"))
    g = torch.Generator().manual_seed(0)
    rollouts = make_rollouts(tree_sampled(50, 20, ((0, 2), (8, 3)), 256, g), g)
    assert F.tree_work(RolloutTree(rollouts)).positions == 50 + 2 * 8 + 6 * 12
    assert F.prompt_sharing_work(rollouts).positions == 50 + 6 * 20
    assert F.tree_work(RolloutTree(rollouts)).flops(shape) < F.prompt_sharing_work(rollouts).flops(shape)


def test_agent_trajectories_shape():
    g = torch.Generator().manual_seed(0)
    seqs = agent_trajectories(512, 4, 96, 64, (2, 1, 3), 2048, g)
    stats = RolloutTree([Rollout(ids, mask) for ids, mask in seqs]).stats
    assert len(seqs) == 18 and {len(ids) for ids, _ in seqs} == {512 + 4 * 96 + 3 * 64}
    assert stats.physical_tokens == 4640 and stats.depth == 5
    ids, mask = seqs[0]
    assert sum(mask) == 4 * 96 and mask[:512] == [0] * 512 and mask[512:608] == [1] * 96 and mask[608:672] == [0] * 64


ROW_KEYS = {"scenario", "config", "label", "method", "method_label", "rollouts", "tree_nodes", "tree_depth",
            "logical_tokens", "physical_tokens", "token_ratio", "attention_keys", "head_rows", "flops", "flop_ratio",
            "seconds", "speedup", "speedup_of_flop_limit", "peak_bytes", "max_rel_grad_err", "grad_err_rollouts",
            "estimated", "peak_estimated", "sample_rollouts", "skipped", "notes", "engine"}


@pytest.mark.slow
def test_estimation_paths_are_labelled():
    """A time budget too small for anything: naive stops after a sample and is scaled; padded / prompt-sharing run
    a one-rollout sample; every gradient error is taken on naive's sample. A memory budget of 1 byte: padded and
    prompt-sharing are skipped with their estimated peak."""
    scenario = Scenario("shared-prompt", 32, generations=3, response_tokens=8)
    result = run_bench([scenario], BenchOptions(max_seconds=1e-9, threads=1))
    rows = {r["method"]: r for r in result["rows"]}
    naive = rows["naive"]
    assert naive["estimated"] and naive["sample_rollouts"] == 1 and naive["seconds"] > 0
    for method in ("padded", "prompt-sharing"):
        r = rows[method]
        assert r["estimated"] and r["sample_rollouts"] == 1 and r["peak_estimated"] and r["notes"]
    for r in rows.values():
        assert r["grad_err_rollouts"] == 1 and r["max_rel_grad_err"] <= 1e-4
    assert not rows["branchreplay"]["estimated"] and rows["branchreplay"]["seconds"] > 0

    result = run_bench([scenario], BenchOptions(max_memory_bytes=1, threads=1))
    rows = {r["method"]: r for r in result["rows"]}
    assert not rows["naive"]["estimated"] and rows["naive"]["grad_err_rollouts"] == 3
    for method in ("padded", "prompt-sharing"):
        r = rows[method]
        assert r["skipped"].startswith("skipped: estimated peak") and r["seconds"] is None
        assert r["peak_estimated"] and r["peak_bytes"] > 1 and r["max_rel_grad_err"] is None


@pytest.mark.slow
def test_bench_json_schema_all_scenarios(capsys, tmp_path):
    png = tmp_path / "bench.png"
    argv = ["bench", "--scenario", "all", "--prompt-tokens", "24,32", "--generations", "2", "--response-tokens", "12",
            "--turns", "2", "--reply-tokens", "4", "--tool-tokens", "3", "--fork-schedule", "0:2,4:2",
            "--threads", "1", "--json", "--plot", str(png)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert png.stat().st_size > 10_000
    assert {"model", "dtype", "device", "threads", "flop_formula", "prompt_sharing", "rows"} <= set(out)
    assert "naive_s" not in out  # the summary keys are only for a single shared-prompt configuration
    assert len(out["rows"]) == 3 * 2 * len(METHODS)
    for r in out["rows"]:
        assert set(r) == ROW_KEYS, set(r) ^ ROW_KEYS
        assert r["method"] in METHODS and r["seconds"] > 0 and r["max_rel_grad_err"] <= 1e-4
        assert r["token_ratio"] == r["logical_tokens"] / r["physical_tokens"]
    by = {(r["scenario"], r["config"]["prompt_tokens"], r["method"]): r for r in out["rows"]}
    for scenario in ("shared-prompt", "multi-turn", "tree-sampled"):
        naive, tree = by[(scenario, 32, "naive")], by[(scenario, 32, "branchreplay")]
        assert naive["flop_ratio"] == 1.0 and tree["flop_ratio"] > 1.0
        assert tree["physical_tokens"] < by[(scenario, 32, "prompt-sharing")]["physical_tokens"] or \
            scenario == "shared-prompt"
    assert by[("multi-turn", 24, "branchreplay")]["tree_depth"] >= 3


def test_scenario_grid_and_options_validation():
    grid = scenario_grid(["shared-prompt", "tree-sampled"], [16, 32], [2, 4], [40])
    assert [s.name for s in grid].count("shared-prompt") == 4 and [s.name for s in grid].count("tree-sampled") == 2
    with pytest.raises(ValueError, match="fork depths"):
        scenario_grid(["tree-sampled"], [16], response_tokens=[16])
    with pytest.raises(ValueError, match="unknown scenario"):
        scenario_grid(["nope"])
    with pytest.raises(ValueError, match="unknown methods"):
        BenchOptions(methods=("naive", "fast"))


def test_plot_writes_png_from_skipped_rows(tmp_path):
    rows = [dict(scenario="shared-prompt", method=m, seconds=None if m == "padded" else 1.0, speedup=1.5,
                 flop_ratio=2.0, logical_tokens=100, peak_bytes=2**20, estimated=m == "naive", peak_estimated=False)
            for m in METHODS]
    plot({"rows": rows, "model": "m", "dtype": "float32", "device": "cpu", "prompt_sharing_impl": "equivalent"},
         str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_bench_methods_subset_still_runs_naive():
    bench = Bench(BenchOptions(methods=("branchreplay",)))
    assert bench.methods == ("naive", "branchreplay")


def test_prompt_sharing_falls_back_to_the_equivalent_without_the_package(monkeypatch):
    import branchreplay.bench.runner as bench

    monkeypatch.setattr(bench, "prefix_grouper_version", lambda: None)
    b = Bench(BenchOptions(methods=("prompt-sharing",)))
    assert b.ps_impl == "equivalent" and "prefix-grouper-equivalent" in b.ps_label
    with pytest.raises(ImportError, match="pip install prefix-grouper"):
        Bench(BenchOptions(prompt_sharing="prefix-grouper"))


SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256, max_position_embeddings=4096)


@pytest.mark.slow
def test_bench_ppo_and_dpo_rows_exact_and_cheaper():
    """bench --loss ppo | dpo on a small model: every method's gradient equals naive's within float32's 1e-4
    (policy and critic for PPO; the float64 exactness of both paths is test_rl_algorithms' and
    test_engine_sequence's), and the tree's FLOPs are below naive's (DPO's count its extra forward pass)."""
    from branchreplay.bench.objectives import format_objective_table, run_dpo, run_ppo
    from branchreplay.bench.scenarios import Scenario

    rows = run_ppo([Scenario("shared-prompt", 48, generations=3, response_tokens=8)], SMALL, torch.float32)
    rows += run_dpo([40], [6], 2, SMALL, torch.float32)
    assert [r["method"] for r in rows] == ["naive", "branchreplay", "naive", "padded", "branchreplay"]
    for r in rows:
        assert r["max_rel_grad_err"] <= 1e-4, r
    tree = [r for r in rows if r["method"] == "branchreplay"]
    assert all(r["flop_ratio"] > 1 for r in tree)
    dpo = rows[2:]
    assert dpo[2]["physical_tokens"] == 2 * (40 + 6 + 6) and dpo[0]["physical_tokens"] == 4 * (40 + 6)
    assert "dpo-pairs" in format_objective_table("dpo", dpo, "header")


def test_bench_loss_cli_refuses_what_it_would_ignore(capsys):
    from branchreplay.cli import main

    assert main(["bench", "--loss", "dpo", "--nproc", "2"]) == 2
    assert "drop --nproc" in capsys.readouterr().err


@pytest.mark.slow
def test_recorded_trajectories_bench_items_as_the_trainer_runs_them(capsys, tmp_path):
    """bench --scenario multi-turn --trajectories: the recorded file's trajectories, one tree per item and the items
    that open alike as one forest (as the trainer's engine calls run them), every method exact; ids past the model's
    vocabulary are refused by name."""
    g = torch.Generator().manual_seed(0)
    first = [{"item": 0, "ids": ids, "loss_mask": mask}  # 3 trajectories sharing their prompt and first turns
             for ids, mask in agent_trajectories(10, 2, 4, 3, (3, 1), 2048, g)[:3]]
    rows = first + [{**r, "item": 1} for r in first]  # a second item that opens (and goes on) the same way
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["bench", "--scenario", "multi-turn", "--trajectories", str(path), "--threads", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    by = {r["method"]: r for r in out["rows"]}
    assert set(by) == set(METHODS) and all(r["max_rel_grad_err"] <= 1e-4 for r in by.values())
    assert by["branchreplay"]["label"] == "recorded t.jsonl" and by["branchreplay"]["rollouts"] == 6
    one_item = RolloutTree([Rollout(r["ids"], r["loss_mask"]) for r in first]).stats.physical_tokens
    assert by["branchreplay"]["physical_tokens"] == one_item  # one forest: the second item shares every node
    path.write_text(json.dumps({"ids": [5000], "loss_mask": [1]}) + "\n")
    assert main(["bench", "--scenario", "multi-turn", "--trajectories", str(path)]) == 2
    assert "another tokenizer" in capsys.readouterr().err
    assert main(["bench", "--loss", "ppo", "--trajectories", str(path)]) == 2


def test_memory_plot_joins_only_one_swept_size_of_one_scenario():
    from branchreplay.bench.output import sweeps

    def row(scenario, **config):
        return {"scenario": scenario, "config": config}

    rows = [row("shared-prompt", prompt_tokens=p, generations=g) for p, g in
            [(1024, 8), (4096, 8), (16384, 8), (4096, 4), (4096, 16), (2048, 2)]]
    rows += [row("multi-turn", prompt_tokens=1024, turns=4), row("tree-sampled", prompt_tokens=1024,
                                                                 fork_schedule=[[0, 2]]),
             row("tree-sampled", prompt_tokens=1024, fork_schedule=[[0, 4]])]
    lines = {(k, tuple((r["config"]["prompt_tokens"], r["config"].get("generations")) for r in line))
             for k, line in sweeps(rows)}
    assert lines == {("prompt_tokens", ((1024, 8), (4096, 8), (16384, 8))),
                     ("generations", ((4096, 4), (4096, 8), (4096, 16)))}  # no line across scenarios or schedules
