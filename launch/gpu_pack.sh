#!/usr/bin/env bash
# Packs FlashInfer for a lent GPU machine, which reaches no package index: sglang's pin
# (flashinfer-python, a JIT package of ~65 MB) cut to what its paged decode and prefill
# kernels compile from (Python files, headers, the batch_decode/batch_prefill sources),
# xz-compressed (~12 MB), beside the apache-tvm-ffi wheel it loads kernels through, for
# the machine's Python 3.12. Run here (it downloads); then name .gpu in the run's carry
# and run PARTS=flashinfer bash launch/gpu_check.sh there.
#
#     bash launch/gpu_pack.sh            # writes .gpu/fi/
set -euo pipefail
cd "$(dirname "$0")/.."
# sglang's pins, read from the project's environment (launch/setup_env.sh)
PY=${PYTHON:-.venv/bin/python}
pin() { "$PY" -c "import importlib.metadata as m, re, sys
for r in m.requires('sglang'):
    x = re.fullmatch(r'(\S+?)(\[[^]]*\])?==([\d.]+)', r.split(';')[0].strip())
    if x and x[1].replace('-', '_') == sys.argv[1].replace('-', '_'): print(x[3])" "$1"; }
FI_VER=${FI_VER:-$(pin flashinfer_python)}
TVM_VER=${TVM_VER:-$(pin apache-tvm-ffi)}
dest=.gpu/fi
rm -rf "$dest" && mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$tmp" "flashinfer_python==$FI_VER" "apache-tvm-ffi==$TVM_VER"
mv "$tmp"/apache_tvm_ffi-*.whl "$dest/"
(cd "$tmp" && python3 -m zipfile -e flashinfer_python-*.whl whl)
python3 - "$tmp/whl" "$tmp/trim" <<'PY'
import re, shutil, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
csrc = re.compile(r"(batch_decode|batch_prefill|single_decode)[^/]*|[^/]*\.(h|cuh)")
skip = re.compile(r"mla|sm90|fp8")
for p in src.rglob("*"):
    if not p.is_file():
        continue
    rel = p.relative_to(src)
    parts = rel.parts
    if parts[:2] == ("flashinfer", "data"):
        if len(parts) == 4 and parts[2] == "csrc":  # csrc's top level: decode/prefill only
            keep = bool(csrc.fullmatch(parts[3])) and not skip.search(parts[3])
        else:  # the header trees the JIT build includes
            keep = len(parts) > 3 and parts[2] in ("include", "spdlog", "cccl", "cutlass")
    else:
        keep = p.suffix == ".py" or parts[0].endswith(".dist-info") or p.name == "py.typed"
    if keep:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dst / rel)
PY
tar cJf "$dest/flashinfer.tar.xz" -C "$tmp/trim" .
echo "$FI_VER" >"$dest/VERSION"
du -sh "$dest"/*
