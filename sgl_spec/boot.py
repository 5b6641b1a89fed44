"""Interpreter-start entry point (imported by ``sgl_spec_cpu.pth``).

Must stay cheap: it runs in every Python process of the environment. It imports
neither torch nor sglang (nor importlib.metadata): it installs a gate on
``sys.meta_path`` that, the first time ``sglang``, ``sgl_kernel`` or ``torchvision``
is imported, loads ``sgl_spec.integration.cpu.hooks`` (checking the pinned sglang
version) and hands the import over to its finder, which supplies ``sgl_kernel`` on
CPU hosts and patches sglang modules as they load. Processes that never import those
pay one dictionary look-up per import.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

from sgl_spec import envs

WATCHED = frozenset({"sglang", "sgl_kernel", "torchvision"})


def cuda_host() -> bool:
    """True when an NVIDIA driver is present (or SGLSPEC_PLATFORM=cuda)."""
    choice = envs.platform_override()
    if choice != "auto":
        return choice == "cuda"
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


class _Gate(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0] not in WATCHED:
            return None
        sys.meta_path.remove(self)  # once: the hooks' own finder takes over
        try:
            from sgl_spec.integration.cpu import hooks

            return hooks.install(cpu=not cuda_host()).find_spec(fullname, path, target)
        except Exception as exc:  # never break an import: sglang then runs without us
            print(f"sgl_spec: platform support not installed: {exc}", file=sys.stderr)
            return None


def install() -> None:
    """Put the gate first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _Gate) for f in sys.meta_path):
        if os.environ.get("SGLANG_USE_CPU_ENGINE") is None and not cuda_host():
            # sglang's CPU rotary-embedding path needs this, else: No module named 'vllm'.
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        sys.meta_path.insert(0, _Gate())


try:
    install()
except Exception as exc:  # never break interpreter start-up
    print(f"sgl_spec: platform support not installed: {exc}", file=sys.stderr)
