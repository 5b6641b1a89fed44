"""PEP 517 backend: setuptools, plus ``sgl_spec_cpu.pth`` at the wheel's root.

setuptools cannot place a ``.pth`` file in site-packages from an editable install,
and the CPU platform support must load in every process of the environment
(sglang spawns its scheduler and detokenizer). This wraps setuptools' backend and
adds the file to both regular and editable wheels, updating RECORD, so pip installs
it and ``pip uninstall sgl_spec`` removes it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the PEP 517 hooks)

PTH_NAME = "sgl_spec_cpu.pth"
PTH_TEXT = b"import sgl_spec.boot\n"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"{name},sha256={digest.decode()},{len(data)}\n"


def _add_pth(wheel_path: str) -> None:
    tmp = wheel_path + ".tmp"
    with zipfile.ZipFile(wheel_path) as src, zipfile.ZipFile(
        tmp, "w", zipfile.ZIP_DEFLATED
    ) as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith(".dist-info/RECORD"):
                data += _record_line(PTH_NAME, PTH_TEXT).encode()
            dst.writestr(item, data)
        dst.writestr(PTH_NAME, PTH_TEXT)
    os.replace(tmp, wheel_path)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    _add_pth(os.path.join(wheel_directory, name))
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(
        wheel_directory, config_settings, metadata_directory
    )
    _add_pth(os.path.join(wheel_directory, name))
    return name
