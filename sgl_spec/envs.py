"""Every environment variable sgl_spec reads, in one place.

The prefix is ``SGLSPEC_``, not ``SGL_SPEC_``: sglang reads every ``SGL_*`` variable
as a deprecated alias of ``SGLANG_*`` (and ``SGLANG_SPEC_*`` is its speculative
decoding namespace).

Kept free of heavy imports: ``sgl_spec.boot`` uses it at interpreter start.
"""

from __future__ import annotations

import os

# "auto" (detect an NVIDIA driver), "cpu" or "cuda": forces the platform choice.
SGLSPEC_PLATFORM = "SGLSPEC_PLATFORM"
# JSON of sgl_spec.config.SpecConfig, written by sgl_spec.launch_server so that
# sglang's spawned scheduler processes see the user's --spec-* flags.
SGLSPEC_CONFIG = "SGLSPEC_CONFIG"
# "auto" (build the C++ CPU kernels on first use, fall back to torch ops where that
# fails), "0" (never: the torch paths) or "1" (a failed build raises).
SGLSPEC_CPU_KERNELS = "SGLSPEC_CPU_KERNELS"
# Where prepared models live (default: $XDG_CACHE_HOME/sgl_spec or ~/.cache/sgl_spec).
SGLSPEC_CACHE_DIR = "SGLSPEC_CACHE_DIR"
# Fault injection for tests: N flips one stored byte of each of the first N nodes Krul
# compresses, after its checksum is taken (the load must be refused and the tokens
# recomputed).
SGLSPEC_KRUL_CORRUPT = "SGLSPEC_KRUL_CORRUPT"
# sglang's own: a core group per CPU rank ("0|1"). The launcher sets it where the user
# did not and ranks outnumber NUMA nodes (sgl_spec.integration.cpu.threads).
SGLANG_CPU_OMP_THREADS_BIND = "SGLANG_CPU_OMP_THREADS_BIND"
# sglang's own: check the KV pool's accounting after every scheduler step. The launcher
# sets it with --spec-check-invariants, whose checks run beside sglang's.
SGLANG_STRICT_BUSY_CHECK = "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"


def _choice(name: str, valid: tuple[str, ...]) -> str:
    """The variable's value (default: the first valid one); ValueError lists the valid ones."""
    value = os.environ.get(name, valid[0]).strip().lower()
    if value not in valid:
        raise ValueError(f"{name}={value!r} is invalid; valid values: {', '.join(valid)}")
    return value


def platform_override() -> str:
    return _choice(SGLSPEC_PLATFORM, ("auto", "cpu", "cuda"))


def cpu_kernels() -> str:
    return _choice(SGLSPEC_CPU_KERNELS, ("auto", "0", "1"))


def krul_corrupt() -> int:
    """How many of the first compressed nodes get a flipped byte (test-only)."""
    value = os.environ.get(SGLSPEC_KRUL_CORRUPT, "0").strip()
    if not value.isdigit():
        raise ValueError(f"{SGLSPEC_KRUL_CORRUPT}={value!r} is invalid; valid values: a "
                         "count of nodes, 0 or more")
    return int(value)


def spec_config_json() -> str | None:
    return os.environ.get(SGLSPEC_CONFIG)


def cache_dir() -> str:
    explicit = os.environ.get(SGLSPEC_CACHE_DIR)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return os.path.join(base, "sgl_spec")


def keyed_path(kind: str, model_path: str, key: list, tag: str = "", suffix: str = "",
               root: str | None = None) -> str:
    """Where something measured or trained once per ``key`` (a JSON-able list that
    names the model and every setting it depends on) is kept: ``<cache dir>/<kind>/
    <model dir name><tag>-<digest of key><suffix>``."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = f"{os.path.basename(os.path.abspath(model_path).rstrip('/'))}{tag}-{digest}{suffix}"
    return os.path.join(root or cache_dir(), kind, name)
