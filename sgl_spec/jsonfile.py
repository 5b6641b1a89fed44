"""JSON files that sgl_spec measures once and reads back (a profile, statistics): written
atomically, read with a format check that names the file and what is wrong."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def write_atomic(path: str, obj) -> None:
    """``obj`` as JSON at ``path`` (its folder made if missing), via a temporary file, so a
    reader never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def read_versioned(path: str, fmt: int, what: str, parse: Callable[[dict], T]) -> T:
    """``parse`` of the JSON at ``path`` whose ``format`` is ``fmt``; ValueError naming
    ``what`` and ``path`` where the file is missing, of another format, or ``parse``
    fails (ValueError or KeyError)."""
    try:
        with open(path) as f:
            d = json.load(f)
        if d.get("format") != fmt:
            raise ValueError(f"format {d.get('format')!r}, expected {fmt}")
        return parse(d)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{what} {path!r} cannot be read: {exc}") from exc
