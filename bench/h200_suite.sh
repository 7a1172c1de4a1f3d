#!/usr/bin/env bash
# Every figure of BENCHMARKS.md, in device calls of under 10 minutes each, on an
# nvidia-h200-x2 machine:
#   bash bench/h200_suite.sh scaling  OUT_DIR   # 2-GPU layouts vs 1 GPU
#   bash bench/h200_suite.sh profile  OUT_DIR   # CUDA tests, CP attention, expert load, phases, check
#   bash bench/h200_suite.sh peers    OUT_DIR   # 1 GPU vs HF, cpmoe check on CUDA
#   bash bench/h200_suite.sh dispatch OUT_DIR   # dispatch + combine vs NCCL all_to_all
# Each step's output is saved as OUT_DIR/<step>-<date>.log; every step runs, and the part
# exits 1 if any failed (a failing test or `cpmoe check` included), listed in
# OUT_DIR/failed-<part>-<date>.txt.
# Without .git on the machine: CPMOE_GIT_COMMIT=<commit> CPMOE_GIT_DIRTY=0 bash bench/...
set -uo pipefail
part=${1:-}
out=${2:-bench/results}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
stamp=$(date +%Y%m%d)
failed_file="$out/failed-$part-$stamp.txt"
source "$(dirname "$0")/steps.sh"
checks=(--device cuda --prompts 40 --lengths 17,300,2049)
case "$part" in
  scaling|profile|peers|dispatch)
    step "provenance-$part-$stamp" sh -c \
      "python3 -m cpmoe.bench.provenance > '$out/provenance-$part-$stamp.json'" ;;
  *) echo "usage: bench/h200_suite.sh scaling|profile|peers|dispatch [OUT_DIR]" >&2; exit 2 ;;
esac
case "$part" in
  scaling)
    ep="tp=2,cp=2,ep=2"
    step "scaling-$stamp" python3 -m cpmoe.cli bench --shape qwen3-30b-a3b \
      --lengths 16384,65536,131072 \
      --layouts "tp=1;$ep;$ep,backend=alltoall_padded;tp=2,cp=2,ep=1;tp=2,cp=2,dp=2" \
      --iters 2 --warmup 1 --plot --out "$out/qwen3-30b-a3b-2gpu-$stamp.json"
    ;;
  profile)
    step "gpu-tests-$stamp" python3 -m pytest tests/gpu
    step "attention-cp-$stamp" python3 -m cpmoe.bench.attention_cp --out "$out/attention_cp-$stamp.json"
    step "expert-load-$stamp" python3 -m bench.expert_load --lengths 16384,65536 --ep 2
    for length in 65536 131072; do
      step "phase-times-$length-$stamp" python3 -m bench.phase_times \
        --layout "tp=2,cp=2,ep=2;tp=2,cp=2,dp=2" --length $length --layers 4 --timeline 2
    done
    step "check-ep2-bf16-$stamp" python3 -m cpmoe.cli check --tp-size 2 --attn-cp-size 2 \
      --ep-size 2 --dtype bfloat16 "${checks[@]}"
    ;;
  peers)
    step "peers-$stamp" python3 -m cpmoe.cli bench --shape qwen3-30b-a3b \
      --lengths 4096,16384,32768,65536,131072 --layouts "tp=1" --compare-hf --iters 2 \
      --warmup 1 --plot --out "$out/qwen3-30b-a3b-1gpu-$stamp.json"
    common=(--tp-size 2 --attn-cp-size 2)
    step "check-ep2-bf16-$stamp" python3 -m cpmoe.cli check "${common[@]}" --ep-size 2 \
      --dtype bfloat16 "${checks[@]}"
    step "check-ep2-padded-bf16-$stamp" python3 -m cpmoe.cli check "${common[@]}" --ep-size 2 \
      --moe-a2a-backend alltoall_padded --dtype bfloat16 "${checks[@]}"
    step "check-dp2-bf16-$stamp" python3 -m cpmoe.cli check "${common[@]}" --moe-dp-size 2 \
      --dtype bfloat16 "${checks[@]}"
    step "check-ep2-fp32-$stamp" python3 -m cpmoe.cli check "${common[@]}" --ep-size 2 \
      --dtype float32 "${checks[@]}"
    ;;
  dispatch)
    step "dispatch-$stamp" python3 -m cpmoe.bench.dispatch --out "$out/dispatch-$stamp.json"
    ;;
esac
finish
