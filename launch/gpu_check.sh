#!/usr/bin/env bash
# The GPU checks, for a lent CUDA machine that has torch and triton but not sglang
# (no package index there): the Triton kernels and the CUDA-stream prefetch against
# their torch references (pytest, marker gpu and the triton tests), then the kernel
# micro-benchmarks on the GPU. Writes its logs and results under $OUT (default
# results/gpu-check). Each part has its own time limit, so one that hangs leaves the
# others' output.
#
#     OUT=results/gpu-check bash launch/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

# The installed layout (sgl_spec.kernels = kernels/) without installing: sglang's
# pins cannot be met there, and nothing below needs sglang.
[ -e sgl_spec/kernels ] || ln -s ../kernels sgl_spec/kernels
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  git log -1 --format='commit %h %s' 2>/dev/null || true
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

timeout "${TEST_LIMIT:-240}" $PY -m pytest -q -p no:cacheprovider -rs \
  tests/test_sparse_decode_kernels.py tests/test_vslash_kernels.py tests/test_prefetch.py \
  -k "(triton or flashinfer or prefetch or cuda) and not interpreted and not fresh_process" \
  2>&1 | tee "$OUT/pytest.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.log"

timeout "${BENCH_LIMIT:-180}" $PY -m sgl_spec.bench.decode_kernels --device cuda \
  --out "$OUT/decode" --histories 8192 32768 131072 --batches 1 8 --layers 30 \
  --repeats 10 2>&1 | tee "$OUT/bench.log"
timeout "${BENCH_LIMIT:-180}" $PY -m sgl_spec.bench.vslash --device cuda --dtype bfloat16 \
  --n 16384 --history 16384 --density 0.02 0.05 0.1 --vertical-share 0.5 --repeats 5 \
  --out "$OUT/vslash.jsonl" 2>&1 | tee -a "$OUT/bench.log"
