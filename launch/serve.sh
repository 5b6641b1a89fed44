#!/usr/bin/env bash
# Set up (or reuse) .venv, then serve the default model on 127.0.0.1:30000.
# Extra arguments go to `python -m sgl_spec.launch_server` (sglang and --spec-* flags).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup_env.sh"
exec "$ROOT/.venv/bin/python" -m sgl_spec.launch_server --host 127.0.0.1 "$@"
