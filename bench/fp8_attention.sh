#!/usr/bin/env bash
# FP8 prefill attention on one H200: the CUDA tests, then `cpmoe bench` prefill at 16K and
# 128K for bf16, FP8 weights, and FP8 weights + FP8 attention (--kv-cache-dtype fp8_e4m3),
# Qwen3-30B-A3B shape, in one run. Needs nvidia-cudnn-frontend (wheels in .whl).
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
