#!/usr/bin/env bash
# The GPU checks, for a lent CUDA machine that has torch and triton but not sglang
# (no package index there): the Triton kernels and the CUDA-stream prefetch against
# their torch references (pytest, marker gpu and the triton tests), then the kernel
# micro-benchmarks on the GPU, then Krul's restore calibration (recompute vs load, per
# tier) for the models whose config.json is under $MODELS (default .gpu/models/<name>/:
# the weights are not needed, the time of a forward does not depend on them). Writes
# its logs and results under $OUT (default results/gpu-check). Each part has its own
# time limit, so one that hangs leaves the others' output; PARTS picks parts.
#
#     OUT=results/gpu-check bash launch/gpu_check.sh
#     PARTS=restore OUT=results/gpu-restore bash launch/gpu_check.sh
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

PARTS=${PARTS:-tests bench restore}
has() { [[ " $PARTS " == *" $1 "* ]]; }

has tests && timeout "${TEST_LIMIT:-240}" $PY -m pytest -q -p no:cacheprovider -rs \
  tests/test_sparse_decode_kernels.py tests/test_vslash_kernels.py tests/test_prefetch.py \
  -k "(triton or flashinfer or prefetch or cuda) and not interpreted and not fresh_process" \
  2>&1 | tee "$OUT/pytest.log"
has tests && echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.log"

has bench && timeout "${BENCH_LIMIT:-180}" $PY -m sgl_spec.bench.decode_kernels --device cuda \
  --out "$OUT/decode" --histories 8192 32768 131072 --batches 1 8 --layers 30 \
  --repeats 10 2>&1 | tee "$OUT/bench.log"
has bench && timeout "${BENCH_LIMIT:-180}" $PY -m sgl_spec.bench.vslash --device cuda --dtype bfloat16 \
  --n 16384 --history 16384 --density 0.02 0.05 0.1 --vertical-share 0.5 --repeats 5 \
  --out "$OUT/vslash.jsonl" 2>&1 | tee -a "$OUT/bench.log"

# Krul: what a restore costs here (python -m sgl_spec.calibrate restore), per model,
# codec and history length; one JSON profile each.
MODELS=${MODELS:-.gpu/models}
if has restore; then
  for dir in "$MODELS"/*/; do
    name=$(basename "$dir")
    for codec in ${CODECS:-k8v4 full}; do
      for n in ${TOKENS:-4096 16384}; do
        timeout "${RESTORE_LIMIT:-150}" $PY -m sgl_spec.calibrate restore --model-path "$dir" \
          --random-weights --device cuda --tokens "$n" --spec-krul-codec "$codec" \
          --out "$OUT/restore-$name-$codec-$n.json" 2>&1 | grep -v "it/s\]\|step/s\]" \
          | tee -a "$OUT/restore.log"
      done
    done
  done
fi
