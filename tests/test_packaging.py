"""pyproject.toml lists every package: a non-editable install (``pip install .``) ships
only the packages named there, so one left out imports in the repo and fails for users."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_with_an_init_is_listed():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {pkg: ROOT / path for pkg, path in tool["package-dir"].items()}

    def where(pkg: str) -> Path:
        for prefix, path in dirs.items():
            if pkg == prefix or pkg.startswith(prefix + "."):
                return path.joinpath(*pkg[len(prefix):].split(".")[1:])
        return ROOT.joinpath(*pkg.split("."))

    found = set()
    for top, name in ((ROOT / "sgl_spec", "sgl_spec"), *((p, k) for k, p in dirs.items())):
        for init in top.rglob("__init__.py"):
            rel = init.parent.relative_to(top).parts
            if not any(part in ("kernels", "agents") for part in rel) or name != "sgl_spec":
                found.add(".".join((name, *rel)))
    # Data directories (C++ sources, configs) are listed too, with their files as
    # package data, so that setuptools ships them without warning.
    data = set(tool["package-data"])
    assert set(tool["packages"]) - data == found
    assert all((where(p) / "__init__.py").is_file() for p in set(tool["packages"]) - data)
    assert all(where(p).is_dir() and not (where(p) / "__init__.py").exists() for p in data)
