#!/usr/bin/env bash
# The GPU checks of issue 11 in one short run: the CUDA tests, `verify` of every attention family on CUDA in float32
# and in bfloat16 mixed precision, and the shared-prompt benchmark at GPU scale (64 rollouts sharing a 32k prompt).
# Writes every figure to $OUT/gpu_check.json (OUT defaults to ./gpu_check) and the logs beside it.
#
#   PYTHON=python3 bash scripts/gpu_check.sh        # a Python with CUDA torch, transformers and the test deps
#
# It installs nothing: the GPU machines here reach no package index. It runs from the source tree (PYTHONPATH=src).
# About 5 minutes on one H200 (estimated: not run yet, no GPU was available when it was written).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
ARCHS="llama qwen2 qwen3 mistral gpt2 phi3 gemma2 gemma3 qwen2-sliding mixtral qwen3_moe"

"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__,
torch.cuda.get_device_name())" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1

timeout 300 "$PYTHON" -m pytest -q -m cuda tests/test_kernels.py -p no:cacheprovider > "$OUT/cuda_tests.log" 2>&1
echo "cuda tests: exit $?" | tee -a "$OUT/summary.txt"

for arch in $ARCHS; do
    timeout 120 "$PYTHON" -m branchreplay verify --arch "$arch" --device cuda --dtype float32 --random-trees 1 \
        --json > "$OUT/verify_${arch}_float32.json" 2>> "$OUT/verify.log"
    timeout 120 "$PYTHON" -m branchreplay verify --arch "$arch" --device cuda --mixed-precision bfloat16 \
        --random-trees 1 --json > "$OUT/verify_${arch}_bf16.json" 2>> "$OUT/verify.log"
done
echo "verify: done" | tee -a "$OUT/summary.txt"

timeout 900 "$PYTHON" -m branchreplay bench --device cuda --scenario shared-prompt --prompt-tokens 32000 \
    --generations 64 --response-tokens 768 --methods naive,branchreplay --max-naive-seconds 60 --json \
    > "$OUT/bench.json" 2> "$OUT/bench.log"
echo "bench: exit $?" | tee -a "$OUT/summary.txt"

"$PYTHON" - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
report = {"verify": {os.path.basename(p)[len("verify_"):-len(".json")]: load(p)
                     for p in sorted(glob.glob(f"{out}/verify_*.json"))},
          "bench": load(f"{out}/bench.json"),
          "summary": open(f"{out}/summary.txt").read().splitlines()}
json.dump(report, open(f"{out}/gpu_check.json", "w"), indent=1)
print(f"wrote {out}/gpu_check.json")
EOF
for f in "$OUT"/verify_*.json; do rm -f "$f"; done  # kept inside gpu_check.json (the device returns few files)
