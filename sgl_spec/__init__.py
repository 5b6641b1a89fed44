"""sgl_spec: turn-aware caching and sparse attention for SGLang (pinned 0.5.23).

This package is imported at interpreter start by ``sgl_spec_cpu.pth`` (see
``sgl_spec.boot``), so this module must stay free of heavy imports.
"""

__version__ = "0.1.0"

SGLANG_VERSION = "0.5.23"

# The name sgl_spec registers for --attention-backend and --radix-cache-backend.
BACKEND_NAME = "sgl_spec"
