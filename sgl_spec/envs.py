"""Every environment variable sgl_spec reads, in one place.

Kept free of heavy imports: ``sgl_spec.cpu.boot`` uses it at interpreter start.
"""

from __future__ import annotations

import os

# "auto" (detect an NVIDIA driver), "cpu" or "cuda": forces the platform choice.
SGL_SPEC_PLATFORM = "SGL_SPEC_PLATFORM"
# JSON of sgl_spec.config.SpecConfig, written by sgl_spec.launch_server so that
# sglang's spawned scheduler processes see the user's --spec-* flags.
SGL_SPEC_CONFIG = "SGL_SPEC_CONFIG"
# Where prepared models live (default: $XDG_CACHE_HOME/sgl_spec or ~/.cache/sgl_spec).
SGL_SPEC_CACHE_DIR = "SGL_SPEC_CACHE_DIR"


def platform_override() -> str:
    value = os.environ.get(SGL_SPEC_PLATFORM, "auto").strip().lower()
    if value not in ("auto", "cpu", "cuda"):
        raise ValueError(
            f"{SGL_SPEC_PLATFORM}={value!r} is invalid; valid values: auto, cpu, cuda"
        )
    return value


def spec_config_json() -> str | None:
    return os.environ.get(SGL_SPEC_CONFIG)


def cache_dir() -> str:
    explicit = os.environ.get(SGL_SPEC_CACHE_DIR)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return os.path.join(base, "sgl_spec")
