#!/usr/bin/env bash
# The GPU checks of issue 11 in one short run: the CUDA tests, `verify` on CUDA in float32 for the families that
# take split prefix attention (opted in: BRANCHREPLAY_CUDA_SPLIT_ATTENTION=1) and in bfloat16 mixed precision for
# two of them, then the shared-prompt benchmark at GPU scale (64 rollouts sharing a 32k prompt), then (issue 27)
# two GRPO steps of the demo under `torchrun --nproc_per_node 1` in both FSDP2 modes (nccl for CUDA tensors, gloo
# for the CPU ones) and, on a machine with more than one GPU, the same with 2 ranks.
# Every stage rewrites $OUT/gpu_check.json (OUT defaults to ./gpu_check), so a run cut short still returns what it
# measured. Budget (each stage has its own timeout): cuda + verify + bench at most 8.5 minutes, torchrun 1.5 minutes
# per GPU count; the device's call lasts 10 minutes, so run them as two calls:
#
#   PYTHON=python3 STAGES="cuda verify bench" bash scripts/gpu_check.sh   # a Python with CUDA torch, transformers
#   PYTHON=python3 STAGES=torchrun OUT=gpu_check_torchrun bash scripts/gpu_check.sh      # and the test deps
#
# It installs nothing: the GPU machines here reach no package index. It runs from the source tree (PYTHONPATH=src).
# Not run yet: no GPU was available when it was written.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu_check}
STAGES=${STAGES:-"cuda verify bench torchrun"}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
mkdir -p "$OUT"
VERIFY=$(mktemp -d)  # one JSON per verify or torchrun run, gathered into gpu_check.json (the device returns at most
                     # 8 files)
export PYTHONPATH=src PYTHONUNBUFFERED=1 BRANCHREPLAY_CUDA_SPLIT_ATTENTION=1
SPLIT_ARCHS="llama qwen2 qwen3 gpt2 phi3 qwen3_moe"  # full attention in every layer: the split path
MIXED_ARCHS="llama qwen3"

summarize() {
    "$PYTHON" - "$OUT" "$VERIFY" <<'EOF'
import glob, json, os, sys
out, verify = sys.argv[1], sys.argv[2]
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
report = {"verify": {os.path.basename(p)[len("verify_"):-len(".json")]: load(p)
                     for p in sorted(glob.glob(f"{verify}/verify_*.json"))},
          "bench": load(f"{out}/bench.json") if os.path.exists(f"{out}/bench.json") else None,
          "torchrun": {os.path.basename(p)[:-len(".jsonl")]: open(p).read().splitlines()[-3:]
                       for p in sorted(glob.glob(f"{verify}/torchrun_*.jsonl"))},
          "stages": open(f"{out}/stages.txt").read().splitlines() if os.path.exists(f"{out}/stages.txt") else []}
json.dump(report, open(f"{out}/gpu_check.json", "w"), indent=1)
EOF
}

"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__,
torch.cuda.get_device_name())" || exit 2

if stage cuda; then
timeout 120 "$PYTHON" -m pytest -q -m cuda tests/test_kernels.py -p no:cacheprovider > "$OUT/cuda_tests.log" 2>&1
echo "cuda tests: exit $?" >> "$OUT/stages.txt"
summarize
fi

if stage verify; then
for arch in $SPLIT_ARCHS; do
    timeout 30 "$PYTHON" -m branchreplay verify --arch "$arch" --device cuda --dtype float32 --random-trees 1 \
        --json > "$VERIFY/verify_${arch}_float32.json" 2>> "$OUT/verify.log"
done
for arch in $MIXED_ARCHS; do
    timeout 30 "$PYTHON" -m branchreplay verify --arch "$arch" --device cuda --mixed-precision bfloat16 \
        --random-trees 1 --json > "$VERIFY/verify_${arch}_bf16.json" 2>> "$OUT/verify.log"
done
echo "verify: done" >> "$OUT/stages.txt"
summarize
fi

if stage bench; then
timeout 150 "$PYTHON" -m branchreplay bench --device cuda --scenario shared-prompt --prompt-tokens 32000 \
    --generations 64 --response-tokens 768 --methods naive,branchreplay --max-naive-seconds 20 --json \
    > "$OUT/bench.json" 2> "$OUT/bench.log"
echo "bench: exit $?" >> "$OUT/stages.txt"
summarize
fi

if stage torchrun; then
# Data parallelism on CUDA (engine/distributed.py, never run on a GPU before): 2 steps of the demo, rank 0's
# metrics (dist/fsdp_mode, step seconds) kept as the last lines of its metrics.jsonl.
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
for nproc in 1 2; do
    [ "$nproc" -le "$GPUS" ] || continue
    for mode in gather-once resharded; do
        run=$(mktemp -d)
        timeout 45 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$nproc" -m branchreplay train \
            --config configs/demo.yaml --train.steps 2 --task.eval_size 4 --parallel.strategy fsdp2 \
            --parallel.fsdp_mode "$mode" --train.output_dir "$run" >> "$OUT/torchrun.log" 2>&1
        echo "torchrun $nproc rank(s) fsdp2 $mode: exit $?" >> "$OUT/stages.txt"
        cp "$run/metrics.jsonl" "$VERIFY/torchrun_${nproc}_${mode}.jsonl" 2>/dev/null
        summarize
    done
done
fi
cat "$OUT/stages.txt"
