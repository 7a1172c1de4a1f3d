#!/usr/bin/env bash
# Every figure of BENCHMARKS.md, in device calls of under 10 minutes each, on an
# nvidia-h200-x2 machine:
#   bash bench/h200_suite.sh scaling  OUT_DIR   # 2-GPU layouts vs 1 GPU
#   bash bench/h200_suite.sh profile  OUT_DIR   # CUDA tests, CP attention, expert load, phases, check
#   bash bench/h200_suite.sh peers    OUT_DIR   # 1 GPU vs HF, cpmoe check on CUDA
#   bash bench/h200_suite.sh dispatch OUT_DIR   # dispatch + combine vs NCCL all_to_all
set -euo pipefail
part=$1
out=${2:-bench/results}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stamp=$(date +%Y%m%d)
case "$part" in
  scaling)
    ep="tp=2,cp=2,ep=2"
    python3 -m cpmoe.cli bench --shape qwen3-30b-a3b --lengths 16384,65536,131072 \
      --layouts "tp=1;$ep;$ep,backend=alltoall_padded;tp=2,cp=2,ep=1;tp=2,cp=2,dp=2" \
      --iters 2 --warmup 1 --plot --out "$out/qwen3-30b-a3b-2gpu-$stamp.json"
    ;;
  profile)
    python3 -m pytest -q tests/gpu
    python3 bench/attention_cp.py --out "$out/attention_cp-$stamp.json"
    python3 bench/expert_load.py --lengths 16384,65536 --ep 2
    for length in 65536 131072; do
      python3 bench/phase_times.py --layout "tp=2,cp=2,ep=2;tp=2,cp=2,dp=2" --length $length \
        --layers 4 --timeline 2
    done
    echo "== cpmoe check --tp-size 2 --attn-cp-size 2 --ep-size 2 --dtype bfloat16"
    python3 -m cpmoe.cli check --tp-size 2 --attn-cp-size 2 --ep-size 2 --device cuda \
      --dtype bfloat16 --prompts 40 --lengths 17,300,2049 || true
    ;;
  peers)
    python3 -m cpmoe.cli bench --shape qwen3-30b-a3b --lengths 4096,16384,32768,65536,131072 \
      --layouts "tp=1" --compare-hf --iters 2 --warmup 1 --plot \
      --out "$out/qwen3-30b-a3b-1gpu-$stamp.json"
    for layout in "--tp-size 2 --attn-cp-size 2 --ep-size 2" \
                  "--tp-size 2 --attn-cp-size 2 --ep-size 2 --moe-a2a-backend alltoall_padded" \
                  "--tp-size 2 --attn-cp-size 2 --moe-dp-size 2"; do
      echo "== cpmoe check $layout --dtype bfloat16"
      python3 -m cpmoe.cli check $layout --device cuda --dtype bfloat16 --prompts 40 \
        --lengths 17,300,2049 || true
    done
    echo "== cpmoe check --tp-size 2 --attn-cp-size 2 --ep-size 2 --dtype float32"
    python3 -m cpmoe.cli check --tp-size 2 --attn-cp-size 2 --ep-size 2 --device cuda \
      --dtype float32 --prompts 40 --lengths 17,300,2049 || true
    ;;
  dispatch)
    python3 bench/dispatch.py --out "$out/dispatch-$stamp.json"
    ;;
  *) echo "usage: bench/h200_suite.sh scaling|profile|peers|dispatch [OUT_DIR]" >&2; exit 2 ;;
esac
