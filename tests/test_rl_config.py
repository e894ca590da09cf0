"""Configuration: YAML + command-line overrides (CLI > YAML > defaults), typed parsing, errors naming the field."""

import pytest
import yaml

from branchreplay.rl.config import Config, apply_overrides, full_help, parse_args


def _yaml(tmp_path, data) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_precedence_cli_over_yaml_over_defaults(tmp_path):
    path = _yaml(tmp_path, {"grpo": {"learning_rate": "1e-5", "beta": 0.1}, "train": {"steps": 7}})
    config = Config.from_yaml(path, ["--grpo.beta=0.02", "--train.seed", "3"])
    assert config.grpo.learning_rate == 1e-5  # YAML 1.1 reads 1e-5 as a string: coerced to the field's float
    assert config.grpo.beta == 0.02  # CLI wins over YAML
    assert config.train.steps == 7 and config.train.seed == 3
    assert config.grpo.num_generations == 8  # default


def test_typed_overrides():
    data = apply_overrides({}, ["--sampling.branching", "[[0,2],[8,4]]", "--grpo.mask_truncated_completions=yes",
                                "--grpo.epsilon_high", "null", "--task.config", "{min_terms: 2, max_terms: 4}",
                                "--model.spec", "tiny:llama"])
    config = Config.from_dict(data)
    assert config.sampling.branching == ((0, 2), (8, 4))
    assert config.grpo.mask_truncated_completions is True
    assert config.grpo.epsilon_high == config.grpo.epsilon
    assert config.task.config == {"min_terms": 2, "max_terms": 4}
    assert config.model.spec == "tiny:llama"


def test_an_optional_string_keeps_text_that_looks_like_yaml():
    """A JSON tool schema as the system prompt stays the text given (it used to be read as a YAML list and refused);
    YAML's null still unsets it."""
    schema = '[{"type": "function", "function": {"name": "search"}}]\n\nAnswer in <answer></answer> tags.'
    config = Config.from_dict(apply_overrides({}, ["--task.system_prompt", schema]))
    assert config.task.system_prompt == schema
    for null in ("null", "~", ""):
        assert Config.from_dict(apply_overrides({}, [f"--task.system_prompt={null}"])).task.system_prompt is None


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(ValueError, match=r"unknown key 'grpo.lr'.*learning_rate"):
        Config.from_dict(apply_overrides({}, ["--grpo.lr=1"]))
    with pytest.raises(ValueError, match=r"unknown key 'train.stepz'.*steps"):
        Config.from_dict({"train": {"stepz": 3}})
    with pytest.raises(ValueError, match=r"unknown config section 'optim'.*grpo"):
        Config.from_dict({"optim": {}})


def test_bad_values_name_the_field_and_accepted_values():
    with pytest.raises(ValueError, match=r"grpo.loss_type='ppo'.*grpo, bnpo, dr_grpo, dapo"):
        Config.from_dict({"grpo": {"loss_type": "ppo"}})
    with pytest.raises(ValueError, match=r"grpo.scale_rewards.*group, batch, none"):
        Config.from_dict({"grpo": {"scale_rewards": "mean"}})
    with pytest.raises(ValueError, match=r"train.steps='many' is not a valid int"):
        Config.from_dict({"train": {"steps": "many"}})
    with pytest.raises(ValueError, match=r"sampling.enforce_eager='maybe' is not a valid bool; accepted values: true"):
        Config.from_dict({"sampling": {"enforce_eager": "maybe"}})
    with pytest.raises(ValueError, match=r"grpo.epsilon=1.5.*\(0, 1\)"):
        Config.from_dict({"grpo": {"epsilon": 1.5}})
    with pytest.raises(ValueError, match=r"branching.*num_generations=8"):
        Config.from_dict({"sampling": {"branching": [[0, 2], [4, 2]]}})
    with pytest.raises(ValueError, match="needs a value"):
        apply_overrides({}, ["--train.steps"])
    with pytest.raises(ValueError, match=r"grpo.num_generations=1 is out of range; it must be >= 2"):
        Config.from_dict({"grpo": {"num_generations": 1}})


def test_saved_config_round_trips(tmp_path):
    config = Config.from_dict(apply_overrides({}, ["--sampling.branching=[[0,4],[8,2]]", "--train.steps=5"]))
    config.save(tmp_path / "config.yaml")
    assert Config.from_yaml(tmp_path / "config.yaml") == config


def test_parse_train_args_and_resume(tmp_path):
    path = _yaml(tmp_path, {"train": {"steps": 9, "output_dir": str(tmp_path / "r")}})
    config, options = parse_args(["--config", path, "--grpo.beta", "0.01"])
    assert options["--resume"] is None and config.train.steps == 9 and config.grpo.beta == 0.01
    run = tmp_path / "run"
    run.mkdir()
    config.save(run / "config.yaml")
    config, options = parse_args([f"--resume={run}", "--train.steps=12"])
    assert options["--resume"] == str(run) and config.train.steps == 12 and config.grpo.beta == 0.01
    assert config.train.output_dir == str(run)


def entry(text: str, name: str) -> str:
    """The `--help-all` entry of `name`: its line and the indented lines of its help below, joined."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{name} "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
    return " ".join(line.strip() for line in lines[start:end])


def test_help_lists_every_field_wrapped_to_the_terminal():
    """--help-all's lines ran up to 1,755 characters: each field now wraps to the terminal's width, its help
    indented below it."""
    text = full_help("train", width=100)
    for name in ("--grpo.loss_type", "--sampling.temperature", "--task.name", "--train.output_dir", "--task.reward"):
        assert name in text
    assert max(map(len, text.splitlines())) <= 100 and len(text.splitlines()) > 300
    task_config = entry(text, "--task.config")
    assert "create_dataset(name, size=, seed=, **config)" in task_config and "``" not in task_config
    assert "another dataset." in task_config  # the docstring entry's continuation lines are kept


def test_help_is_short_names_trl_first_and_each_command_lists_what_it_reads(capsys):
    """`train --help` was 152 lines, a paragraph per option; `eval --help` listed the training options; the tiny
    specs were offered for training, which refuses them. Now --help is a short view (TRL's names first) and
    --help-all the full text, of what each command reads only."""
    from branchreplay.cli import main

    def shown(*argv):
        assert main(list(argv)) == 0
        return capsys.readouterr().out

    short = shown("train", "--help")  # the options of the own-data recipe and max_staleness are on it (issue 64)
    assert len(short.splitlines()) <= 75 and "--learning_rate | --grpo.learning_rate  (default 1e-06)" in short
    for name in ("--task.prompt_column", "--task.answer_column", "--task.system_prompt", "--task.reward_weights",
                 "--task.eval_dataset", "--grpo.max_staleness", "--dry-run"):
        assert name in short, name
    assert "--help-all" in short and "tiny" not in short
    full = shown("train", "--help-all")
    assert full.count("\n--") > 100 and "--engine.replay " in full and "tiny" not in full
    assert "--max_completion_length  (TRL GRPOConfig) -> sampling.max_new_tokens" in full
    for text in (shown("eval", "--help"), shown("eval", "--help-all")):
        assert "--checkpoint DIR" in text or "--task.eval_size " in text
        assert not [w for w in text.split() if w.startswith(("--grpo.", "--train.", "--engine.", "--parallel."))]
    assert "--task.eval_size" in shown("eval", "--help-all") and "--model.spec" in shown("eval", "--help")


def test_engine_section_typed_choices_and_every_field_helped():
    """EngineConfig is the run config's `engine` section and holds only what the engine reads (train defaults to the
    self-check of unknown families, a library call refuses them: `train.unknown_family`, not an engine field);
    closed choices are Literals; every field's help is its metadata."""
    import dataclasses

    from branchreplay.engine import EngineConfig
    from branchreplay.rl.config import SECTIONS

    config = Config.from_dict(apply_overrides({}, ["--engine.replay", "keep", "--engine.max_pack_tokens=32"]))
    assert config.engine == EngineConfig(replay="keep", max_pack_tokens=32)
    assert Config().train.unknown_family == "self-check"
    assert not {"unknown_family", "method"} & {f.name for f in dataclasses.fields(EngineConfig)}
    with pytest.raises(ValueError, match=r"engine.replay='sometimes' is not valid; accepted values: keep, replay, "):
        Config.from_dict({"engine": {"replay": "sometimes"}})
    with pytest.raises(ValueError, match=r"engine.memory_budget=0 is out of range"):
        Config.from_dict({"engine": {"memory_budget": 0}})
    text = full_help("train")
    line = entry(text, "--engine.replay")
    assert "one of 'keep', 'replay', 'auto'" in line and "default 'auto'" in line
    assert "default 'self-check'" in entry(text, "--train.unknown_family")
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{section}.{f.name} has no help in its metadata"


def test_resuming_a_run_from_before_use_bias_correction_kl_keeps_its_objective(tmp_path):
    """A run saved before the option existed trained with plain k3: its resume keeps it (with a warning), and a
    command line that would switch it is refused (another objective, config/resume.py); a run that saved the option
    gets what it saved."""
    data = Config.from_dict({"grpo": {"beta": 0.04}}).to_dict()
    del data["grpo"]["use_bias_correction_kl"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    with pytest.warns(UserWarning, match="predates grpo.use_bias_correction_kl"):
        config, _ = parse_args(["--resume", str(tmp_path)])
    assert config.grpo.use_bias_correction_kl is False
    with pytest.raises(ValueError, match="grpo.use_bias_correction_kl was False, now True"):  # another objective
        parse_args(["--resume", str(tmp_path), "--grpo.use_bias_correction_kl", "true"])
    Config.from_dict({"grpo": {"beta": 0.04}}).save(tmp_path / "config.yaml")
    assert parse_args(["--resume", str(tmp_path)])[0].grpo.use_bias_correction_kl is True


def test_trl_flat_grpo_config_names_map_onto_sections(tmp_path):
    """A TRL GRPOConfig-style flat YAML (issue 14): each name lands on the field that means the same, TRL's
    spellings converted, other GRPOConfig fields dropped with one warning, typos answered with the nearest key."""
    import warnings

    path = tmp_path / "trl.yaml"
    path.write_text("learning_rate: 3.0e-6\nnum_generations: 4\nmax_completion_length: 256\nmax_steps: 500\n"
                    "save_total_limit: 3\nper_device_train_batch_size: 8\ngradient_accumulation_steps: 3\n"
                    "lr_scheduler_type: linear\nscale_rewards: false\ntop_k: null\nbf16: true\nbeta: 0.04\n"
                    "entropy_coef: 0.01\nlogging_steps: 10\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = Config.from_yaml(path)
    assert (c.grpo.learning_rate, c.grpo.num_generations, c.sampling.max_new_tokens, c.train.steps) == \
        (3e-6, 4, 256, 500)  # every value differs from our defaults: a dropped mapping fails here
    assert (c.train.keep_checkpoints, c.grpo.prompts_per_step, c.grpo.lr_scheduler, c.grpo.scale_rewards) == \
        (3, 6, "linear", "none")  # 8 x 3 completions per step / 4 generations = 6 prompts
    assert (c.model.dtype, c.grpo.beta, c.grpo.entropy_coef, c.sampling.top_k) == ("bfloat16", 0.04, 0.01, 0)
    assert any("ignored: logging_steps" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="top_k=0 .*sampling.top_k=5 disagree"):
        Config.from_dict({"top_k": None, "sampling": {"top_k": 5}})
    with pytest.warns(UserWarning, match="ignored: logging_steps"):
        c, _ = parse_args(["--config", str(path), "--learning_rate", "5e-6", "--max_steps=7"])
    assert (c.grpo.learning_rate, c.train.steps, c.sampling.top_k) == (5e-6, 7, 0)  # the command line wins
    c = Config.from_dict({"grpo": {"learning_rate": 1e-5}, "_trl_names_from_the_command_line": {"learning_rate": 2e-5}})
    assert c.grpo.learning_rate == 2e-5
    rloo = Config.from_dict({"algorithm": "rloo", "per_device_train_batch_size": 6})
    assert (rloo.grpo.num_generations, rloo.grpo.prompts_per_step) == (2, 3)  # RLOO's TRL default G = 2
    iterations = Config.from_dict({"num_iterations": 4, "max_steps": 400, "save_steps": 100})
    assert (iterations.train.steps, iterations.train.save_steps) == (100, 25)  # TRL's optimizer steps / mu
    with pytest.raises(ValueError, match="not a whole number of sampling rounds"):
        Config.from_dict({"num_iterations": 3, "max_steps": 400})
    with pytest.raises(ValueError, match="TRL's steps_per_generation is not supported here"):
        Config.from_dict({"steps_per_generation": 4})
    with pytest.raises(ValueError, match="did you mean 'learning_rate'"):
        Config.from_dict({"learnin_rate": 1e-6})
    with pytest.raises(ValueError, match=r"unknown key 'grpo.learnig_rate' \(did you mean 'learning_rate'"):
        Config.from_dict({"grpo": {"learnig_rate": 1e-6}})
    with pytest.raises(ValueError, match="disagree"):
        Config.from_dict({"learning_rate": 1e-6, "grpo": {"learning_rate": 1e-5}})
    with pytest.raises(ValueError, match="not divisible by num_generations=8"):
        Config.from_dict({"per_device_train_batch_size": 12})
    with pytest.raises(ValueError, match="grpo.prompts_per_step=3: keep one"):
        Config.from_dict({"per_device_train_batch_size": 16, "grpo": {"prompts_per_step": 3}})
    with pytest.raises(ValueError, match="lr_scheduler_type='polynomial'"):
        Config.from_dict({"lr_scheduler_type": "polynomial"})
    assert "--max_completion_length  (TRL GRPOConfig) -> sampling.max_new_tokens" in full_help("train")
    lora = Config.from_dict({"use_peft": True, "lora_alpha": 64, "lora_target_modules": ["q_proj", "v_proj"],
                             "lora_dropout": 0.0}).model
    assert (lora.lora_r, lora.lora_alpha, lora.lora_target_modules) == (16, 64, "q_proj,v_proj")  # TRL's r = 16
    assert Config.from_dict({"use_peft": False, "lora_r": 8}).model.lora_r == 0
    with pytest.raises(ValueError, match="without use_peft: true"):
        Config.from_dict({"lora_r": 8})
    with pytest.raises(ValueError, match="lora_dropout=0.05"):
        Config.from_dict({"use_peft": True, "lora_dropout": 0.05})
    assert Config.from_dict({"use_peft": True, "model": {"lora_r": 4}}).model.lora_r == 4  # no TRL default over it
    with pytest.raises(ValueError, match="lora_alpha=16 but model.lora_alpha=64"):
        Config.from_dict({"use_peft": True, "lora_alpha": 16, "model": {"lora_alpha": 64}})
    with pytest.raises(ValueError, match="lora_r=0 but model.lora_r=16"):
        Config.from_dict({"use_peft": False, "model": {"lora_r": 16}})
    with pytest.raises(ValueError, match="use_peft='no' is not true or false"):
        Config.from_dict({"use_peft": "no"})


def test_a_run_folder_config_from_before_the_move_still_reads(tmp_path):
    """engine.method and engine.unknown_family moved to the train section: a config.yaml of an earlier run reads them
    there, with a warning naming the file; on the command line the old names are unknown keys."""
    old = tmp_path / "config.yaml"
    old.write_text("engine:\n  method: naive\n  unknown_family: refuse\n  max_pack_tokens: 32\n")
    with pytest.warns(UserWarning, match=r"engine.method is now train.method"):
        config = Config.from_yaml(old)
    assert (config.train.method, config.train.unknown_family, config.engine.max_pack_tokens) == ("naive", "refuse", 32)
    with pytest.raises(ValueError, match=r"unknown key .engine.method. \(it is now train.method\)"):
        apply_overrides({}, ["--engine.method", "naive"])


def test_a_data_parallel_run_resumes_in_one_process_without_a_flag(tmp_path, monkeypatch):
    """The run's parallel.strategy fsdp2 (its torchrun launch) becomes auto when the resume is not started by
    torchrun, with a warning; the command line still decides when it names the strategy."""
    monkeypatch.delenv("RANK", raising=False)
    Config.from_dict({"parallel": {"strategy": "fsdp2"}}).save(tmp_path / "config.yaml")
    with pytest.warns(UserWarning, match="not started by torchrun, so it runs in one process"):
        config, _ = parse_args(["--resume", str(tmp_path)])
    assert config.parallel.strategy == "auto"
    assert parse_args(["--resume", str(tmp_path), "--parallel.strategy", "ddp"])[0].parallel.strategy == "ddp"


def test_reading_a_config_never_imports_trl_or_torch(tmp_path):
    """An unknown key, a TRL field that is not supported and a missing data file are errors before any heavy
    import (TRL's GRPOConfig names are a list kept here, checked against the installed TRL below)."""
    import subprocess
    import sys

    code = ("import sys\nfrom branchreplay.rl.config import Config, parse_args\n"
            "for data in ({'learning_rte': 1}, {'steps_per_generation': 2}):\n"
            "    try:\n        Config.from_dict(data)\n    except ValueError as e:\n        print(e)\n"
            "try:\n    parse_args(['--task.dataset', 'no/such.jsonl', '--task.reward', 'math_verify'])\n"
            "except FileNotFoundError as e:\n    print(e)\n"
            "print('trl' in sys.modules, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "did you mean 'learning_rate'" in out and "TRL's steps_per_generation is not supported" in out
    assert "task.dataset no/such.jsonl does not exist" in out and out.strip().endswith("False False")


def test_the_kept_trl_field_names_are_trls():
    import dataclasses

    trl = pytest.importorskip("trl")
    from branchreplay.rl.config.trl_fields import TRL_GRPO_FIELDS

    assert TRL_GRPO_FIELDS == {f.name for f in dataclasses.fields(trl.GRPOConfig)}


def test_misspelt_command_line_options_get_the_nearest_name():
    """As a misspelt YAML key does: --learning_rte, --grop.beta, --resum and --algorithm grop name what was meant."""
    for args, meant in ((["--learning_rte", "1e-5"], "--learning_rate"), (["--grop.beta", "0.1"], "--grpo.beta"),
                        (["--resum", "runs/x"], "--resume"), (["--algorithm", "grop"], "grpo")):
        with pytest.raises(ValueError, match=f"did you mean '{meant}'"):
            Config.from_dict(apply_overrides({}, args))


def test_the_config_reference_page_has_every_field_help_all_lists():
    """The site's config page rendered each section as one paragraph, no field on it: it is now generated from the
    dataclasses (docs/hooks/config_reference.py puts `rl.config.reference` into docs/reference/config.md). Every
    option `train --help-all` lists is on it with its type, default and help, and so are the drop-ins' keywords."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    import yaml

    from branchreplay.rl.config.reference import MARKER
    from branchreplay.trl.options import DropInOptions

    root = Path(__file__).resolve().parents[1]
    assert "docs/hooks/config_reference.py" in yaml.safe_load((root / "mkdocs.yml").read_text())["hooks"]
    spec = importlib.util.spec_from_file_location("config_reference_hook", root / "docs/hooks/config_reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    source = (root / "docs/reference/config.md").read_text()
    assert MARKER in source
    page = hook.on_page_markdown(source, None, None, None)
    options = [line.split()[0] for line in full_help("train").splitlines() if line.startswith("--") and "." in
               line.split()[0]]
    assert len(options) > 100
    missing = [o for o in options if f"`{o}`" not in page]
    assert not missing, f"on --help-all, not on the config page: {missing}"
    for f in dataclasses.fields(DropInOptions):
        assert f"| `{f.name}` |" in page
    row = next(line for line in page.splitlines() if line.startswith("| `--grpo.learning_rate` |"))
    assert "float; default `1e-06`" in row and "`learning_rate`" in row and "AdamW" in row
    row = next(line for line in page.splitlines() if line.startswith("| `--engine.memory_budget` |"))
    assert "default `None`" in row and "bytes" in row
