#!/usr/bin/env bash
# One device call: install carried wheels, run the CUDA tests, the kernel benches and the engine checks.
# Usage (repo root, on the GPU machine): bash scripts/gpu_check.sh STAGE...   (stages: tests kernels tiny d27 spec27 hf27)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nb() { python3 scripts/nb.py "$@"; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests)   python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_engine.py tests/test_kernels_qlinear.py \
               tests/test_kernels_attention.py tests/test_kernels_gdn.py tests/test_kernels_gdn_triton.py \
               tests/test_kernels_fused.py 2>&1 | tail -25 ;;
    kernels) python3 scripts/bench_qlinear.py --quick 2>&1 | tail -40
             python3 scripts/bench_attention.py 2>&1 | tail -20
             [ -f scripts/bench_fused.py ] && python3 scripts/bench_fused.py 2>&1 | tail -20 ;;
    tiny)    nb decode --model tiny -n 256 --repeats 2 --json "$OUT/tiny_v3.json" 2>&1 | tail -22 ;;
    d27)     nb decode --model qwen3.8-27b --synthetic -n 128 --repeats 3 --json "$OUT/d27_v3_none.json" 2>&1 | tail -22 ;;
    spec27)  for s in "mtp -k 3" "dflash2 -k 7"; do
               nb decode --model qwen3.8-27b --synthetic -n 128 --repeats 2 --spec $s \
                 --json "$OUT/d27_v3_$(echo $s | tr -d ' -').json" 2>&1 | tail -22; done ;;
    hf27)    nb decode --model qwen3.8-27b --synthetic --engine hf -n 32 --repeats 1 --warmup 0 \
               --json "$OUT/d27_hf.json" 2>&1 | tail -22 ;;
  esac
done
echo "=== done $(date +%T)"
