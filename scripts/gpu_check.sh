#!/usr/bin/env bash
# The GPU checks of issue 11 in one short run (docs/gpu.md, "How it ran"; the figures are on that page): the CUDA
# tests, `verify` on CUDA in float32 for the families that take split prefix attention (CUDA's default since the
# split stage measured it), in bfloat16 mixed precision for two of them and for the PPO, RLOO and DPO objectives on
# one, then (issue 27) two GRPO steps of the demo under `torchrun --nproc_per_node 1` in both FSDP2 modes (nccl for
# CUDA tensors, gloo for the CPU ones) and, on a machine with more than one GPU, the same with 2 ranks, then the
# shared-prompt benchmark at GPU scale (64 rollouts sharing a 32k prompt), then (issue 31) the in-process sampler's
# tokens/s on the demo's batch against the GPU's decoding roofline, in float32 and bfloat16, and (stage split)
# branchreplay's step with split prefix attention against the masked SDPA path, on the bench grid and at the 32k
# headline size, to decide CUDA's default.
# Every stage rewrites $OUT/gpu_check.json (OUT defaults to ./gpu_check), so a run cut short still returns what it
# measured. Each stage has its own timeout; together at most 9 minutes, about 5 expected (STAGES picks some).
#
# The GPU machines here reach no package index, and the tree they receive is at most 64 MiB, so the script takes
# what is missing from a folder prepared on this machine (GPU_CARRY, default .gpu, ignored by git): whl/ (wheels for
# Python 3.12, installed into /tmp/site: transformers 5.24, newer than the image's, reasoning-gym and their needs)
# and smollm2/ (SmolLM2-135M's config and tokenizer, no weights: the demo's model shape with random weights, made
# there; its tokens are noise, its cost that of the real model). Prepare it once (scripts/gpu_carry.sh), then, on
# the GPU machine, with `.gpu` carried:
#
#   PYTHON=python3 bash scripts/gpu_check.sh     # a Python with CUDA torch, transformers and pytest
#
# It runs from the source tree (PYTHONPATH=src).
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # the comment above, as usage
    echo "usage: bash scripts/$(basename "$0")  (no arguments; settings from the environment)"
    sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0
fi
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu_check}
STAGES=${STAGES:-"cuda verify torchrun bench split sampler"}
GPU_CARRY=${GPU_CARRY:-.gpu}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
mkdir -p "$OUT"
VERIFY=$(mktemp -d)  # one JSON per verify or torchrun run, gathered into gpu_check.json (the device returns at most
                     # 8 files)
SITE=/tmp/site
if ls "$GPU_CARRY"/whl/*.whl > /dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        "$GPU_CARRY"/whl/*.whl \
        > "$VERIFY/setup.log" 2>&1 || echo "setup: wheels failed" >> "$OUT/stages.txt"
fi
export PYTHONPATH=src:$SITE PYTHONUNBUFFERED=1
MODEL=/tmp/smollm2-random  # SmolLM2-135M's shape and tokenizer, random weights (float32)
if [ -f "$GPU_CARRY/smollm2/config.json" ]; then
    cp -r "$GPU_CARRY/smollm2" "$MODEL" && "$PYTHON" -c "
import sys, torch, transformers
torch.manual_seed(0)
config = transformers.AutoConfig.from_pretrained(sys.argv[1])
transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(sys.argv[1])" "$MODEL" \
        >> "$VERIFY/setup.log" 2>&1 || echo "setup: random SmolLM2 failed" >> "$OUT/stages.txt"
fi
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
          "split": {os.path.basename(p)[len("split_"):-len(".json")]:
                    [{k: row.get(k) for k in ("scenario", "label", "method", "seconds", "speedup", "peak_bytes",
                                              "max_rel_grad_err", "estimated")} for row in load(p).get("rows", [])]
                    or load(p) for p in sorted(glob.glob(f"{verify}/split_*.json"))},
          "sampler": {os.path.basename(p)[len("sampler_"):-len(".txt")]: open(p).read().splitlines()[-10:]
                      for p in sorted(glob.glob(f"{verify}/sampler_*.txt"))},
          "setup": open(f"{verify}/setup.log").read().splitlines()[-10:] if os.path.exists(f"{verify}/setup.log")
                   else [],
          "stages": open(f"{out}/stages.txt").read().splitlines() if os.path.exists(f"{out}/stages.txt") else []}
json.dump(report, open(f"{out}/gpu_check.json", "w"), indent=1)
EOF
}

"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__,
torch.cuda.get_device_name())" || exit 2

if stage cuda; then
timeout 90 "$PYTHON" -m pytest -q -m cuda tests/test_engine_kernels.py tests/test_decode_loop.py -p no:cacheprovider \
    > "$OUT/cuda_tests.log" 2>&1
echo "cuda tests: exit $?" >> "$OUT/stages.txt"
summarize
fi

if stage verify; then
for arch in $SPLIT_ARCHS; do  # side by side: each is mostly Python start-up and small kernels
    timeout 60 "$PYTHON" -m branchreplay verify --arch "$arch" --device cuda --dtype float32 --random-trees 1 \
        --json > "$VERIFY/verify_${arch}_float32.json" 2> "$VERIFY/${arch}_float32.log" &
done
for arch in $MIXED_ARCHS; do
    timeout 60 "$PYTHON" -m branchreplay verify --arch "$arch" --device cuda --mixed-precision bfloat16 \
        --random-trees 1 --json > "$VERIFY/verify_${arch}_bf16.json" 2> "$VERIFY/${arch}_bf16.log" &
done
for loss in ppo rloo dpo; do  # the other objectives, on one family
    timeout 60 "$PYTHON" -m branchreplay verify --arch llama --device cuda --dtype float32 --loss "$loss" \
        --random-trees 1 --json > "$VERIFY/verify_llama_${loss}.json" 2> "$VERIFY/llama_${loss}.log" &
done
wait
tail -n 5 "$VERIFY"/*.log > "$OUT/verify.log" 2>&1
"$PYTHON" - "$VERIFY" >> "$OUT/stages.txt" <<'EOF2'
import glob, json, os, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/verify_*.json")):
    try:
        verdict = "passed" if json.load(open(path))["passed"] else "FAILED"
    except (OSError, ValueError, KeyError) as e:
        verdict = f"no result ({type(e).__name__})"
    print(f"verify {os.path.basename(path)[len('verify_'):-len('.json')]}: {verdict}")
EOF2
summarize
fi

if stage torchrun; then
# Data parallelism on CUDA (engine/parallel/distributed.py, never run on a GPU before): 2 steps of the demo on SmolLM2's
# shape, rank 0's metrics (dist/fsdp_mode, step seconds) kept as the last lines of its metrics.jsonl.
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
for nproc in 1 2; do
    [ "$nproc" -le "$GPUS" ] || continue
    for mode in gather-once resharded; do
        run=$(mktemp -d)
        timeout 60 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$nproc" -m branchreplay train \
            --config configs/demo.yaml --model.spec "$MODEL" --train.steps 2 --task.eval_size 4 \
            --parallel.strategy fsdp2 --parallel.fsdp_mode "$mode" --train.output_dir "$run" >> "$OUT/torchrun.log" 2>&1
        echo "torchrun $nproc rank(s) fsdp2 $mode: exit $?" >> "$OUT/stages.txt"
        cp "$run/metrics.jsonl" "$VERIFY/torchrun_${nproc}_${mode}.jsonl" 2>/dev/null
        summarize
    done
done
fi

if stage bench; then
timeout 120 "$PYTHON" -m branchreplay bench --device cuda --scenario shared-prompt --prompt-tokens 32000 \
    --generations 64 --response-tokens 768 --methods naive,branchreplay --max-naive-seconds 20 --json \
    > "$OUT/bench.json" 2> "$OUT/bench.log"
echo "bench: exit $?" >> "$OUT/stages.txt"
summarize
fi

if stage split; then
# The same steps with the split kernel (1) and with the masked SDPA path (0), one after the other.
for split in 0 1; do
    BRANCHREPLAY_CUDA_SPLIT_ATTENTION=$split timeout 90 "$PYTHON" -m branchreplay bench --device cuda --scenario all \
        --methods branchreplay --max-naive-seconds 5 --repeats 3 --json > "$VERIFY/split_grid_$split.json" \
        2>> "$OUT/split.log"
    echo "split grid $split: exit $?" >> "$OUT/stages.txt"
    BRANCHREPLAY_CUDA_SPLIT_ATTENTION=$split timeout 90 "$PYTHON" -m branchreplay bench --device cuda \
        --scenario shared-prompt --prompt-tokens 32000 --generations 64 --response-tokens 768 --methods branchreplay \
        --max-naive-seconds 5 --json > "$VERIFY/split_32k_$split.json" 2>> "$OUT/split.log"
    echo "split 32k $split: exit $?" >> "$OUT/stages.txt"
    summarize
done
fi

if stage sampler; then
# The in-process sampler on the demo's batch (4 prompts x G=8, 48 new tokens) against the GPU's roofline.
for dtype in float32 bfloat16; do
    timeout 100 "$PYTHON" scripts/sampling_time.py --model "$MODEL" --device cuda --dtype "$dtype" --repeats 2 \
        --roofline > "$VERIFY/sampler_${dtype}.txt" 2>&1
    echo "sampler $dtype: exit $?" >> "$OUT/stages.txt"
    summarize
done
fi
cat "$OUT/stages.txt"
