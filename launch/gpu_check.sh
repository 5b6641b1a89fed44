#!/usr/bin/env bash
# The GPU checks, for a lent CUDA machine that has torch and triton but not sglang
# (no package index there): the Triton kernels, the CUDA-stream prefetch and the tiered
# pool's round blocks against their torch references (pytest, marker gpu and the triton tests), then the kernel
# micro-benchmarks on the GPU, then Krul's restore calibration (recompute vs load, per
# tier, and a restore at a forced recompute share of $PIPE_SHARE, serial against
# pipelined) for the models whose config.json is under $MODELS (default
# .gpu/models/<name>/: the weights are not needed, the time of a forward does not depend
# on them), and SpeContext's decode step as a GPU server runs it against the same
# server's exact step, and with its last $SC_OFFLOAD layers in pinned host memory as
# --spec-offload places them (python -m sgl_spec.calibrate decode --device cuda
# --offload-layers) for those of them with a head under $HEADS (default
# .gpu/heads/<name>/, EAGLE-3 layout). Writes
# its logs and results under $OUT (default results/gpu-check). Each part has its own
# time limit, so one that hangs leaves the others' output; PARTS picks parts.
#
#     OUT=results/gpu-check bash launch/gpu_check.sh
#     PARTS=restore OUT=results/gpu-restore bash launch/gpu_check.sh
#     PARTS=specontext OUT=results/gpu-sc bash launch/gpu_check.sh
#
# FlashInfer is not on those machines: `bash launch/gpu_pack.sh` here packs sglang's pin
# into .gpu/fi (carry .gpu); the part `flashinfer` installs it, builds its kernels for
# the tests' shapes in parallel (JIT, nvcc there), then runs the tests above with it.
#
#     PARTS="flashinfer tests bench" OUT=results/gpu-fi bash launch/gpu_check.sh
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

PARTS=${PARTS:-tests bench vslash restore specontext}
has() { [[ " $PARTS " == *" $1 "* ]]; }

SKIP=""
FI=${FI:-.gpu/fi}
if has flashinfer; then
  site=/tmp/sgl_spec-fi
  mkdir -p "$site"
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$site" "$FI"/*.whl \
    && tar xJf "$FI/flashinfer.tar.xz" -C "$site" && export PYTHONPATH="$site:$PYTHONPATH"
  $PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tee -a "$OUT/env.txt"
  # One JIT build per kernel variant the tests use (dtype, head_dim, GQA group; group
  # 7 takes the tensor-core kernel), all at once; a variant not built in time is
  # deselected rather than built inside pytest's time.
  # WARM_SPECS: the variants to build ("dtype head_dim group", comma-separated)
  all="float16 32 2,bfloat16 32 2,float16 64 3,bfloat16 64 3,float16 64 7,bfloat16 64 7,bfloat16 32 3"
  IFS=, read -ra specs <<<"${WARM_SPECS:-$all}"
  for spec in "${specs[@]}"; do
    timeout "${WARM_LIMIT:-240}" $PY -m sgl_spec.kernels.sparse_decode.flashinfer_impl \
      --warm $spec >"$OUT/warm-${spec// /-}.log" 2>&1 &
  done
  wait
  cat "$OUT"/warm-*.log | grep -v "^\s*$" | tail -40
  built() { for f in "$@"; do grep -q "^built" "$OUT/warm-$f.log" || return 1; done; }
  built float16-64-7 bfloat16-64-7 || SKIP="$SKIP and not gqa7"
  built float16-32-2 bfloat16-32-2 float16-64-3 bfloat16-64-3 || SKIP="$SKIP and not flashinfer"
fi

has tests && timeout "${TEST_LIMIT:-240}" $PY -m pytest -q -p no:cacheprovider -rs \
  tests/test_sparse_decode_kernels.py tests/test_vslash_kernels.py tests/test_prefetch.py \
  tests/test_specontext.py tests/test_krul_observe.py tests/test_tiers.py \
  tests/test_krul_restore_cost.py \
  -k "${TEST_K:-(triton or flashinfer or prefetch or cuda) and not interpreted and not fresh_process}$SKIP" \
  2>&1 | tee "$OUT/pytest.log"
has tests && echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.log"

has bench && timeout "${BENCH_LIMIT:-180}" $PY -m sgl_spec.bench.decode_kernels --device cuda \
  --out "$OUT/decode" --histories ${HISTORIES:-8192 32768 131072} --batches 1 8 --layers 30 \
  --repeats 10 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
has vslash && timeout "${BENCH_LIMIT:-180}" $PY -m sgl_spec.bench.vslash --device cuda --dtype bfloat16 \
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
          --tiers ${RESTORE_TIERS:-host file} --pipeline-share "${PIPE_SHARE:-0.5}" --out "$OUT/restore-$name-$codec-$n.json" 2>&1 | grep -v "it/s\]\|step/s\]" \
          | tee -a "$OUT/restore.log"
      done
    done
  done
fi

# SpeContext: ms per decode step, sparse against the same server's exact, per model
# with a head and batch size; one JSON profile (and its plot) each.
HEADS=${HEADS:-.gpu/heads}
if has specontext; then
  for dir in "$MODELS"/*/; do
    name=$(basename "$dir")
    [ -d "$HEADS/$name" ] || continue
    for b in ${SC_BATCHES:-1 8}; do
      timeout "${SC_LIMIT:-180}" $PY -m sgl_spec.calibrate decode --device cuda \
        --spec-mode specontext --spec-draft-path "$HEADS/$name" --model-path "$dir" \
        --histories ${SC_HISTORIES:-4096 8192 16384 32768} --batch "$b" \
        --offload-layers "${SC_OFFLOAD:-all}" \
        --out "$OUT/decode-$name-b$b.json" 2>&1 | grep -v "point/s" | tee -a "$OUT/specontext.log"
    done
  done
fi
