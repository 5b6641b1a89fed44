"""What this CPU computes natively, read from /proc/cpuinfo (no torch import): the
launcher's choice of a CPU server's dtype.

Without AVX512-BF16 or AMX a CPU computes bfloat16 GEMMs and attention by converting to
float32 and back, which costs more than computing in float32 outright; there a CPU server
serves float32 unless ``--dtype`` is given (``python -m sgl_spec.bench.dtype`` measures
both on a host: docs/cpu.md).
"""

from __future__ import annotations

from functools import lru_cache

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# The flags that decide how fast a CPU multiplies matrices (what a benchmark's machine
# record names: hosts of one model name can differ in them, and prefill speed with them).
MATMUL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                "amx_int8")


@lru_cache(maxsize=1)
def flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def model_name() -> str:
    """The CPU's model name ("" where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def matmul_flags() -> list[str]:
    """Which of ``MATMUL_FLAGS`` this CPU has, in that order."""
    f = flags()
    return [x for x in MATMUL_FLAGS if x in f]


def native_bf16() -> bool:
    """Whether the CPU computes bfloat16 natively (AVX512-BF16 or AMX); True where its
    flags cannot be read (sglang's choice then stands)."""
    f = flags()
    return not f or bool(f & NATIVE_BF16_FLAGS)


def default_dtype() -> str | None:
    """The ``--dtype`` a CPU server gets where none is given: float32 without native
    bfloat16, else None (sglang's auto: the model's own dtype)."""
    return None if native_bf16() else "float32"
