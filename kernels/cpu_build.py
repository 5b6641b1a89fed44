"""Build-on-first-use for sgl_spec's C++ CPU kernels (``*/csrc/*.cpp``).

``torch.utils.cpp_extension.load`` compiles a kernel once (g++ and ninja, 30-90 s)
and caches it under torch's extension directory, keyed by source, flags and the CPU's
vector capability (the sources are compiled with ``-march=native``). Where a kernel
cannot be built the caller's torch path runs instead (one warning);
``SGLSPEC_CPU_KERNELS=0`` turns every C++ kernel off, ``=1`` makes a failed build raise.

Thread-safe; a module is built at most once per process.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

from sgl_spec.envs import cpu_kernels

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp"]
INCLUDE = Path(__file__).with_name("csrc")  # vec16.h, shared by the kernels

_lock = threading.Lock()
_built: dict[str, ModuleType | None] = {}


def _build(name: str, source: Path) -> ModuleType:
    import torch
    from torch.utils.cpp_extension import load

    # torch finds ninja on PATH; the environment's own (the ``ninja`` wheel) is in the
    # interpreter's bin directory, not on PATH unless the environment is activated.
    env_bin = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and shutil.which("ninja", path=env_bin):
        os.environ["PATH"] = env_bin + os.pathsep + os.environ.get("PATH", "")
    cap = torch.backends.cpu.get_cpu_capability().lower()
    return load(name=f"sgl_spec_{name}_{cap}", sources=[str(source)], extra_cflags=FLAGS,
                extra_include_paths=[str(INCLUDE)], extra_ldflags=["-fopenmp"],
                verbose=False)


def load_cpu_kernel(name: str, source: Path) -> ModuleType | None:
    """The compiled module ``name`` of ``source``, or None where C++ kernels are off
    or this one cannot be built (warned once)."""
    mode = cpu_kernels()
    if mode == "0":
        return None
    if name in _built:  # the per-call path: no lock
        return _built[name]
    with _lock:
        if name not in _built:
            try:
                logger.info("building the C++ CPU kernel %s (once, 30-90 s)", source.name)
                _built[name] = _build(name, source)
            except Exception as e:  # no compiler, no ninja, unsupported platform
                if mode == "1":
                    raise
                logger.warning("C++ CPU kernel %s unavailable (%s: %s); the torch path runs "
                               "instead", source.name, type(e).__name__, e)
                _built[name] = None
        return _built[name]
