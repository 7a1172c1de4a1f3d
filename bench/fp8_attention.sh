#!/usr/bin/env bash
# FP8 prefill attention on one H200: the CUDA tests, then `cpmoe bench` prefill at 16K and
# 128K for bf16, FP8 weights, and FP8 weights + FP8 attention (--kv-cache-dtype fp8_e4m3),
# Qwen3-30B-A3B shape, in one run; then what FP8 K/V and FP8 attention cost in accuracy:
# `cpmoe check` of FP8 K/V against 16-bit K/V on the same (random, FP8) weights at 4K and
# 16K (the 16K prompts in two 8K chunks: the second attends its cached prefix in FP8).
# Needs nvidia-cudnn-frontend (wheels in .whl).
# Usage: bench/fp8_attention.sh OUT_DIR
set -uo pipefail
out=${1:?out dir}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -c "import cudnn, torch; print('cudnn backend', cudnn.backend_version(), 'torch', torch.__version__)"
python3 -m pytest -q -s -rs tests/gpu/test_fp8_attention_cuda.py 2>&1 | tee "$out/fp8-attention-tests.log"
lengths=${LENGTHS:-16384,131072}
for v in bf16 fp8 fp8attn; do
  case $v in
    bf16) flags=() ;;
    fp8) flags=(--quantization fp8) ;;
    fp8attn) flags=(--quantization fp8 --kv-cache-dtype fp8_e4m3) ;;
  esac
  python3 -m cpmoe.cli bench --shape qwen3-30b-a3b --lengths "$lengths" --layouts tp=1 \
    --iters 2 "${flags[@]}" --out "$out/prefill-$v.json" 2>&1 | tail -n 8
done
model=$(mktemp -d)
python3 -c "import json, sys; from cpmoe.bench.spec import SHAPES
open(sys.argv[1] + '/config.json', 'w').write(json.dumps(SHAPES['qwen3-30b-a3b']))" "$model"
python3 -m cpmoe.cli check --model "$model" --load-format dummy --quantization fp8 \
  --kv-cache-dtype fp8_e4m3 --reference-kv-cache-dtype auto --lengths "${CHECK_LENGTHS:-4096,16384}" \
  --prompts 4 --decode-steps 8 2>&1 | tee "$out/fp8-accuracy.log" | tail -n 12
