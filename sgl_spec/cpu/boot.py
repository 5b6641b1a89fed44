"""Interpreter-start entry point (imported by ``sgl_spec_cpu.pth``).

Must stay cheap: it runs in every Python process of the environment. It imports
neither torch nor sglang; it only installs an import hook that acts when (and if)
``sgl_kernel``, ``torchvision`` or the patched sglang modules are imported.
"""

from __future__ import annotations

import os

from sgl_spec import envs


def cuda_host() -> bool:
    """True when an NVIDIA driver is present (or SGLSPEC_PLATFORM=cuda)."""
    choice = envs.platform_override()
    if choice != "auto":
        return choice == "cuda"
    return os.path.exists("/dev/nvidiactl") or os.path.exists(
        "/proc/driver/nvidia/version"
    )


def install() -> bool:
    """Install the import hooks; CPU support only on hosts without CUDA.

    Returns whether CPU support was activated.
    """
    from sgl_spec.cpu import import_hooks

    cpu = not cuda_host()
    if cpu:
        # sglang's CPU rotary-embedding path needs this, else: No module named 'vllm'.
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import_hooks.install(cpu=cpu)
    return cpu


try:
    install()
except Exception as exc:  # never break interpreter start-up
    import sys

    print(f"sgl_spec: CPU platform support not installed: {exc}", file=sys.stderr)
