#!/usr/bin/env bash
# Set up (or reuse) .venv with the test dependencies, then run the test suite.
# Extra arguments go to pytest (e.g. -m "not server" for the fast subset).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup_env.sh" --test
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest "$@"
