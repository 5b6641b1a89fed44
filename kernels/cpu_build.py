"""Build-on-first-use for sgl_spec's C++ CPU kernels (``*/csrc/*.cpp``).

``torch.utils.cpp_extension.load`` compiles a kernel once (g++ and ninja, minutes)
and caches it under torch's extension directory (``TORCH_EXTENSIONS_DIR``), in a
directory of its own per source digest (the ``.cpp``, the shared headers, the flags, the
torch version) and CPU vector capability (the sources are compiled with
``-march=native``): two checkouts with different sources keep two builds instead of
rebuilding each other's. A finished build is stamped (``built.ok``) and later loads
import its module directly: torch's ``load`` would rebuild whenever the environment's
path differs (its include paths are in ``build.ninja``), so every fresh clone with its own
``.venv`` paid the whole build again.

Builds are serialised across processes by an ``flock`` on ``<dir>.flock``, which the
kernel drops when its holder dies. torch's own lock file (``<dir>/lock``, which a build
killed midway leaves behind, and every later build then waits on forever) is therefore
stale whenever it is found by a holder of the flock, and is removed with a warning.

Where a kernel cannot be built the caller's torch path runs instead (one warning);
``SGLSPEC_CPU_KERNELS=0`` turns every C++ kernel off, ``=1`` makes a failed build raise.
Thread-safe; a module is built at most once per process.
"""

from __future__ import annotations

import fcntl
import hashlib
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


def build_dir(name: str, source: Path, cap: str) -> Path:
    """Where ``name`` built from ``source`` for CPU capability ``cap`` lives."""
    from torch.utils.cpp_extension import get_default_build_root

    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(INCLUDE.glob("*.h")):
        digest.update(header.read_bytes())
    digest.update(" ".join(FLAGS).encode())
    import torch

    digest.update(torch.__version__.encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / "sgl_spec" / f"{name}_{cap}_{digest.hexdigest()[:12]}"


def clear_stale_lock(directory: Path) -> bool:
    """Remove torch's lock file in ``directory``; call only while holding the flock.
    True if one was there (a build killed midway left it)."""
    stale = directory / "lock"
    if not stale.exists():
        return False
    logger.warning("removing %s, left by a kernel build that was killed midway", stale)
    stale.unlink(missing_ok=True)
    return True


STAMP = "built.ok"  # written once a build in the directory has finished


def import_built(module_name: str, directory: Path) -> ModuleType | None:
    """The module a finished build left in ``directory``; None if there is none or it
    does not import (then it is built again)."""
    import importlib.util

    so = directory / f"{module_name}.so"
    if not (directory / STAMP).exists() or not so.exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(module_name, so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (ImportError, OSError) as e:
        logger.warning("rebuilding %s: its earlier build does not import (%s)", so, e)
        return None


def _build(name: str, source: Path) -> ModuleType:
    import torch
    from torch.utils.cpp_extension import load

    # torch finds ninja on PATH; the environment's own (the ``ninja`` wheel) is in the
    # interpreter's bin directory, not on PATH unless the environment is activated.
    env_bin = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and shutil.which("ninja", path=env_bin):
        os.environ["PATH"] = env_bin + os.pathsep + os.environ.get("PATH", "")
    cap = torch.backends.cpu.get_cpu_capability().lower()
    directory = build_dir(name, source, cap)
    directory.mkdir(parents=True, exist_ok=True)
    with open(f"{directory}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released on close, or when this process dies
        clear_stale_lock(directory)
        module_name = f"sgl_spec_{name}_{cap}"
        built = import_built(module_name, directory)
        if built is not None:
            return built
        (directory / STAMP).unlink(missing_ok=True)
        logger.info("building the C++ CPU kernel %s (once; it takes a while)", source.name)
        module = load(name=module_name, sources=[str(source)],
                      extra_cflags=FLAGS, extra_include_paths=[str(INCLUDE)],
                      extra_ldflags=["-fopenmp"], build_directory=str(directory),
                      verbose=False)
        (directory / STAMP).touch()
        return module


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
                _built[name] = _build(name, source)
            except Exception as e:  # no compiler, no ninja, unsupported platform
                if mode == "1":
                    raise
                logger.warning("C++ CPU kernel %s unavailable (%s: %s); the torch path runs "
                               "instead", source.name, type(e).__name__, e)
                _built[name] = None
        return _built[name]
