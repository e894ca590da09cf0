import json

import pytest

from branchreplay.check.verify import VS_FLOAT64_FACTOR
from branchreplay.cli import main


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gpt2"])
def test_verify_json_passes_for_each_tiny_arch(arch, capsys):
    assert main(["verify", "--arch", arch, "--json", "--random-trees", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["arch"] == arch and out["dtype"] == "float64" and out["passed"] is True
    assert 0 <= out["max_rel_grad_err"] <= 1e-6 and out["max_abs_logprob_err"] <= 1e-9


def test_verify_fails_with_exit_1_when_the_engine_is_wrong(monkeypatch, capsys):
    """Break the engine (drop the first-token transition of every child) and check verify notices."""
    import branchreplay.engine.stack as engine

    original = engine._Run.trained_rows

    def broken(self, node, hidden, parent_h):
        return original(self, node, hidden, None if parent_h is None else parent_h.detach() * 0)

    monkeypatch.setattr(engine._Run, "trained_rows", broken)
    assert main(["verify", "--arch", "llama", "--json", "--random-trees", "0"]) == 1
    assert json.loads(capsys.readouterr().out)["passed"] is False


def test_verify_lists_supported_families(capsys):
    assert main(["verify", "--list"]) == 0
    assert "llama" in capsys.readouterr().out


def test_bench_json_keys(capsys):
    assert main(["bench", "--scenario", "shared-prompt", "--prompt-tokens", "64", "--generations", "2",
                 "--response-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["method"]: r for r in out["rows"]}
    replay, naive = rows["branchreplay"], rows["naive"]
    for key in ("logical_tokens", "physical_tokens", "token_ratio", "seconds", "speedup", "peak_bytes",
                "max_rel_grad_err"):
        assert key in replay
    assert naive["seconds"] > 0 and naive["peak_bytes"] is not None
    assert replay["logical_tokens"] == 2 * 72 and replay["physical_tokens"] == 64 + 16
    assert replay["max_rel_grad_err"] <= 1e-4


@pytest.mark.slow
def test_bench_from_json_merges_runs_into_one_table_and_plot(tmp_path, capsys):
    paths = []
    for g in ("2", "3"):
        assert main(["bench", "--scenario", "shared-prompt", "--prompt-tokens", "32", "--generations", g,
                     "--response-tokens", "4", "--methods", "naive,branchreplay", "--json"]) == 0
        paths.append(tmp_path / f"g{g}.json")
        paths[-1].write_text(capsys.readouterr().out)
    png = tmp_path / "merged.png"
    assert main(["bench", "--from-json", ",".join(map(str, paths)), "--plot", str(png), "--json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert [r["rollouts"] for r in merged["rows"]] == [2, 2, 3, 3] and png.stat().st_size > 0
    other = json.loads(paths[0].read_text())
    paths[0].write_text(json.dumps({**other, "threads": other["threads"] + 1}))
    assert main(["bench", "--from-json", ",".join(map(str, paths))]) == 2
    assert "different threads" in capsys.readouterr().err


@pytest.mark.parametrize("text, said", [
    ("", "is empty"),
    ('{"model_type": "llama", "hidden_size": 64,}', "not valid JSON: Expecting property name enclosed in double "
                                                     "quotes at line 1, column 43"),
    ("[1]", "holds a JSON list"),
    ('{"model_type": "llama", "hidden_size": "sixty-four"}', "'hidden_size' expected int, got str (value: "
                                                            "'sixty-four')"),
])
def test_verify_a_folder_with_a_broken_config_json_is_one_line(tmp_path, capsys, text, said):
    """`verify --model FOLDER` whose config.json is broken: one line naming the file and what is wrong, exit 2."""
    (tmp_path / "config.json").write_text(text)
    assert main(["verify", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'config.json'}") and said in err and err.count("\n") == 1, err


def test_bad_cli_input_is_one_line_error(capsys):
    """Typos end in `error: ...` and exit 2, not a traceback."""
    assert main(["verify", "--arch", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["verify", "--model", "/nonexistent/model"]) == 2
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "--prompt-tokens", "-5"])
    assert e.value.code == 2 and "positive integers" in capsys.readouterr().err
    assert main(["train", "--task.name", "nope"]) == 2  # refused before any model is loaded
    assert "unknown task 'nope'" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", "/nonexistent/run"]) == 2
    assert "no such folder" in capsys.readouterr().err


LONGROPE = ["--arch", "llama", "--json", "--random-trees", "0"]


def _longrope_llama(monkeypatch):
    """`verify --arch llama` on the issue's longrope Llama (original_max_position_embeddings 32, max 128)."""
    import branchreplay.tiny_models as tiny_models

    tiny = tiny_models.tiny_model
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 32}
    monkeypatch.setattr(tiny_models, "tiny_model", lambda arch, **kw: tiny(
        arch, max_position_embeddings=128, rope_parameters=rope, **kw))


def test_verify_crosses_the_models_length_thresholds(monkeypatch, capsys):
    """verify reads the thresholds (rotary regime, engine chunk) and runs a tree across each; it reports them."""
    _longrope_llama(monkeypatch)
    assert main(["verify", *LONGROPE]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["thresholds_covered"] == {"engine.chunk_tokens": 24, "longrope original_max_position_embeddings": 32}
    assert out["passed"] is True and out["max_rel_grad_err"] <= 1e-6


def test_verify_fails_on_a_longrope_model_when_regimes_are_not_held(monkeypatch, capsys):
    """Without the regime holding (the main branch before the fix), verify's threshold tree fails: it can fail."""
    import contextlib

    import branchreplay.engine.replay as engine

    _longrope_llama(monkeypatch)
    monkeypatch.setattr(engine, "held_at_length", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(engine, "regimes", lambda rotaries, lengths: [(max(lengths), list(range(len(lengths))))])
    assert main(["verify", *LONGROPE]) == 1
    assert json.loads(capsys.readouterr().out)["passed"] is False


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_float32_and_bfloat16_measure_both_sides_from_float64(dtype, capsys):
    """The claim in float32 / bfloat16: the engine's error against a float64 copy of the model is at most 2x the
    naive computation's own (bfloat16 failed before at 3.2e-2 against a fixed 1e-2 bound)."""
    assert main(["verify", "--arch", "llama", "--dtype", dtype, "--json", "--random-trees", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True
    assert 0 < out["max_rel_grad_err_vs_f64"] <= VS_FLOAT64_FACTOR * out["naive_rel_grad_err_vs_f64"]
    if dtype == "float32":
        assert out["max_rel_grad_err"] <= 1e-4  # the tiny config's engine-vs-naive bound still holds


def test_the_float32_bound_has_the_models_rounding_level_as_its_floor(monkeypatch, capsys):
    """SmolLM2 in float32 failed `verify` on a one-rollout tree (engine 9.7e-5 from float64, naive 4.7e-5: both
    float32 rounding, the model's level about 1e-3): the bound is 2x naive's largest error over the trees. A real
    departure stays far above it: dropping the first-token transition of every child fails float32 too."""
    import branchreplay.engine.stack as engine
    from branchreplay.check.verify import ShapeResult, judge_against_float64

    def result(engine_err, naive_err):
        return ShapeResult("tree", 1, 10, 10, 0.0, 0.0, False, max_rel_grad_err_vs_f64=engine_err,
                           naive_rel_grad_err_vs_f64=naive_err, logprob_err_vs_f64=1e-6,
                           naive_logprob_err_vs_f64=1e-6)

    rows = judge_against_float64([result(9.69e-5, 4.72e-5), result(1.1e-3, 1e-3), result(9e-4, 8e-4)])
    assert all(r.passed for r in rows) and rows[0].bound_vs_f64 == pytest.approx(VS_FLOAT64_FACTOR * 1e-3)
    assert not judge_against_float64([result(5e-2, 4.72e-5), result(1.1e-3, 1e-3), result(9e-4, 8e-4)])[0].passed
    original = engine._Run.trained_rows
    monkeypatch.setattr(engine._Run, "trained_rows", lambda self, node, hidden, parent_h: original(
        self, node, hidden, None if parent_h is None else parent_h.detach() * 0))
    assert main(["verify", "--arch", "llama", "--dtype", "float32", "--json", "--random-trees", "0"]) == 1
    assert json.loads(capsys.readouterr().out)["passed"] is False


def test_verify_refuses_flags_it_would_ignore(capsys):
    """--mixed-precision with --dtype or --nproc, and --nproc with a device other than the CPU: exit 2, naming the
    flag (they used to be ignored silently)."""
    assert main(["verify", "--mixed-precision", "bfloat16", "--dtype", "float32"]) == 2
    assert "drop --dtype" in capsys.readouterr().err
    assert main(["verify", "--nproc", "2", "--device", "cuda"]) == 2
    assert "drop --device cuda" in capsys.readouterr().err
    assert main(["verify", "--shapes", "short-beside-long,nope"]) == 2
    assert "--shapes 'short-beside-long,nope': name one or more of shared-prompt" in capsys.readouterr().err
    assert main(["verify", "--loss", "dpo", "--shapes", "forest"]) == 2
    assert "drop --shapes" in capsys.readouterr().err


def test_verify_checks_the_named_shapes_alone(capsys):
    assert main(["verify", "--arch", "llama", "--json", "--shapes", "short-beside-long,forest"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True and out["trees"] == 2 and out["thresholds_covered"] == {}


def test_verify_loss_dpo_passes_and_fails_a_wrong_gradient(capsys, monkeypatch):
    """`verify --loss dpo --json`: every DPO loss type on pair trees, passed at float64; a second pass that
    doubles its loss (a wrong dL/ds) is caught: exit 1. With --nproc 2 the data-parallel DPO update passes."""
    import branchreplay.engine.sequence as sequence

    assert main(["verify", "--arch", "llama", "--loss", "dpo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True and out["loss"] == "dpo" and out["max_rel_grad_err"] <= 1e-10
    original = sequence.linear_loss
    monkeypatch.setattr(sequence, "linear_loss", lambda x: 2 * original(x))
    assert main(["verify", "--arch", "llama", "--loss", "dpo", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["passed"] is False
    monkeypatch.undo()  # data-parallel: the trainer's DPO update on 2 gloo processes against one process
    assert main(["verify", "--loss", "dpo", "--nproc", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True and out["loss"] == "dpo" and out["world_size"] == 2
    assert out["max_rel_grad_err"] <= 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["ppo", "rloo"])
def test_verify_loss_ppo_and_rloo_pass_and_catch_a_wrong_critic_or_ratio(loss, capsys, monkeypatch):
    """`verify --loss ppo` checks the policy and a critic made from the model (rows <shape>/critic), `--loss rloo`
    the sequence-level ratio; both pass at float64 on a recurrent family, and a wrong gradient is caught: the
    critic's values doubled in the engine only (ppo), the second pass's weights doubled (rloo)."""
    import branchreplay.engine.sequence as sequence
    import branchreplay.engine.stack as stack

    assert main(["verify", "--arch", "lfm2", "--loss", loss, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True and out["loss"] == loss and out["max_rel_grad_err"] <= 1e-10
    if loss == "ppo":
        original = stack.token_values
        monkeypatch.setattr(stack, "token_values", lambda head, rows: 2 * original(head, rows))
    else:
        original = sequence.linear_loss
        monkeypatch.setattr(sequence, "linear_loss", lambda x: 2 * original(x))
    assert main(["verify", "--arch", "llama", "--loss", loss, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["passed"] is False
    # --nproc 2 --loss ppo | rloo runs `check.parallel.algorithm_gradients`: tests/test_rl_algorithms_parallel.py


def test_config_files_and_model_specs_that_fail_are_one_line_errors(tmp_path, capsys, monkeypatch):
    """Issue 14's new-user trips: a YAML syntax error, a YAML list, an unreachable hub id (a relative path without
    ./), a bad --threads: `error: ...` and exit 2, not a traceback."""
    import branchreplay.models as models

    broken = tmp_path / "broken.yaml"
    broken.write_text("grpo:\n  learning_rate: [1e-5\n")
    assert main(["train", "--config", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config file") and "not valid YAML at line" in err and err.count("\n") == 1
    listed = tmp_path / "list.yaml"
    listed.write_text("- learning_rate: 1e-5\n")
    assert main(["eval", "--config", str(listed)]) == 2
    assert "must hold a mapping of sections" in capsys.readouterr().err

    def offline(spec, *args, **kwargs):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {spec}")

    monkeypatch.setattr(models, "_load_pretrained", offline)
    assert main(["eval", "--model.spec", "runs/exported"]) == 2
    err = capsys.readouterr().err
    assert "taken for a hub id" in err and "./runs/exported" in err and err.count("\n") == 1
    assert main(["train", "--threads", "0"]) == 2
    assert "--threads '0'" in capsys.readouterr().err


def test_eval_of_a_run_reads_its_config(tmp_path):
    """eval --checkpoint RUN_DIR (or one of its checkpoints) takes the run's config.yaml unless --config is given."""
    from branchreplay.rl.config import Config, parse_args, run_config

    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    Config.from_dict({"task": {"eval_size": 7}, "sampling": {"max_new_tokens": 9}}).save(run / "config.yaml")
    for folder in (run, run / "checkpoints" / "step-000002"):
        assert run_config(folder) == run / "config.yaml"
        config, _ = parse_args(["--checkpoint", str(folder)], ("--config", "--checkpoint"))
        assert (config.task.eval_size, config.sampling.max_new_tokens) == (7, 9)
    config, _ = parse_args(["--checkpoint", str(run), "--task.eval_size", "5"], ("--config", "--checkpoint"))
    assert (config.task.eval_size, config.sampling.max_new_tokens) == (5, 9)  # the command line still wins
    other = tmp_path / "other.yaml"
    Config().save(other)
    config, _ = parse_args(["--checkpoint", str(run), "--config", str(other)], ("--config", "--checkpoint"))
    assert config.task.eval_size == Config().task.eval_size
    assert run_config(tmp_path / "elsewhere") is None


@pytest.mark.parametrize("argv", [["train", "--help"], ["eval", "--help"], ["train", "--grpo.epsilon", "2"],
                                  ["train", "--config", "/nonexistent.yaml"], ["--help"]])
def test_help_and_config_errors_come_before_torch_loads(argv):
    """--help and a bad config answer in a fraction of a second: torch, transformers and reasoning-gym are not even
    imported (a fresh interpreter; they took about 5 s here)."""
    import subprocess
    import sys

    code = (f"import sys\nfrom branchreplay.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'reasoning_gym') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stdout, (out.stdout[-500:], out.stderr[-500:])


def test_the_top_level_help_says_what_it_does_with_an_example_per_command(capsys):
    """`branchreplay --help` read like developer notes (wings, module paths), with no example and no docs link:
    it now says what the tool does, gives an example of every command, each using options that command has, and
    where the documentation is."""
    from branchreplay.cli import main
    from branchreplay.rl.config import full_help

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "rollouts share prefixes" in text and "docs/index.md" in text and "wing" not in text
    examples = [line.split()[1:] for line in text.split("examples:")[1].splitlines()
                if line.strip().startswith("branchreplay ")]
    commands = {words[0] for words in examples}
    assert commands == {"verify", "bench", "train", "estimate", "eval", "export", "vllm-serve"}
    for words in examples:
        command, options = words[0], [w for w in words if w.startswith("--")]
        if command in ("train", "eval", "estimate"):
            assert main([command, "--help"]) == 0
            known = capsys.readouterr().out + full_help(command)
        else:
            with pytest.raises(SystemExit):
                main([command, "--help"])
            known = capsys.readouterr().out
        for option in options:
            assert option in known, (command, option)
