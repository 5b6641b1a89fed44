"""What a benchmark figure was measured on: machine, load, versions and commit.

Every benchmark's results.json starts with ``run_meta`` (``cli.start_meta``), so a
figure can be traced to the machine state, the installed versions and the commit.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib import metadata

from sgl_spec import cpu as host_cpu


def _cpu_model() -> str:
    return host_cpu.model_name() or platform.processor() or "unknown"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def git_label(g: dict | list | None) -> str:
    """A ``git()`` record (or a list of them, pooled runs) as a table shows it."""
    if isinstance(g, list):
        return ", ".join(dict.fromkeys(git_label(x) for x in g)) or "?"
    if isinstance(g, str):
        return g
    g = g or {}
    return f"{str(g.get('commit') or '?')[:7]}{' (dirty)' if g.get('dirty') else ''}"


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict:
    import psutil

    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_matmul_flags": host_cpu.matmul_flags(),
        "memory_bytes": psutil.virtual_memory().total,
        "python": sys.version.split()[0],
        "versions": {d: _version(d) for d in ("sglang", "torch", "transformers", "sgl_spec")},
    }


def git() -> dict:
    """The commit; ``dirty``: whether tracked files differ from it; ``untracked``: paths
    git does not track (a run's own output folder in the repo is one, so it does not
    count as dirty; new source files would, and are listed)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    untracked = _git("ls-files", "--others", "--exclude-standard", "--directory")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "untracked": untracked.splitlines()[:20] if untracked else [],
    }


def run_meta(model: str, **extra) -> dict:
    """What every benchmark run records first: start time, model, load, machine, git."""
    return {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "model": model, **extra,
            "load_average_before": load_average(), "machine": machine(), "git": git()}
