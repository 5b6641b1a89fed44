"""Shared fixtures: real sglang servers started once per test session.

With ``SGLSPEC_TEST_BLOCK_SGLANG=1`` every ``import sglang...`` in this process fails
(``tests/test_no_sglang.py`` runs the sglang-free modules' tests that way).
"""

from __future__ import annotations

import importlib.abc
import os
import sys

import pytest


class _BlockSglang(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "sglang" or fullname.startswith("sglang."):
            raise ImportError(f"sglang is blocked in this test process ({fullname})")
        return None


if os.environ.get("SGLSPEC_TEST_BLOCK_SGLANG") == "1":
    sys.meta_path.insert(0, _BlockSglang())

from sgl_spec.bench import configset
from sgl_spec.bench.server import SPEC, STOCK, ServerProcess

# Flags both servers share (the benchmarks' own), so that only the sgl_spec
# components differ; idle schedulers sleep so two servers leave the 2 cores free.
COMMON_FLAGS = [*configset.COMMON_FLAGS, "--sleep-on-idle"]


@pytest.fixture(scope="session")
def tok():
    """A deterministic word-level stand-in for an HF tokenizer."""
    from _tokenizers import WordTokenizer

    return WordTokenizer()


@pytest.fixture(scope="session")
def hf_tok(model_path):
    """The default model's real tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def model_path() -> str:
    from sgl_spec.prepare_model import prepare

    return prepare()


LONG_MODEL = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="session")
def long_model_path() -> str:
    """The opt-in long-context model's directory; the test is skipped where it is not
    prepared (CI never prepares it)."""
    from sgl_spec.prepare_model import is_prepared, model_dir

    path = model_dir(model=LONG_MODEL)
    if not is_prepared(path):
        pytest.skip(f"needs python -m sgl_spec.prepare_model --model {LONG_MODEL}")
    return path


@pytest.fixture(scope="session")
def long_tok(long_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(long_model_path)


def _log_path(tmp_path_factory, name: str) -> str:
    return os.path.join(str(tmp_path_factory.mktemp("logs")), f"{name}.log")


@pytest.fixture(scope="session")
def spec_server(model_path, tmp_path_factory):
    """sgl_spec.launch_server, exact mode, with the sgl_spec defaults."""
    with ServerProcess(
        SPEC,
        ["--model-path", model_path, *COMMON_FLAGS],
        log_path=_log_path(tmp_path_factory, "spec"),
    ) as server:
        yield server


@pytest.fixture(scope="session")
def stock_server(model_path, tmp_path_factory):
    """Stock sglang.launch_server with torch_native attention (what CPU users run)."""
    with ServerProcess(
        STOCK,
        ["--model-path", model_path, *configset.LAUNCHERS["stock"].flags, *COMMON_FLAGS],
        log_path=_log_path(tmp_path_factory, "stock"),
    ) as server:
        yield server


@pytest.fixture(scope="session")
def loopserve_server(model_path, tmp_path_factory):
    """One LoopServe server for the decode and the prefill tests (a server start is
    ~40 s on 2 cores): decode budget 4096 from context 0, so every history is covered
    and decode is exact mode's token for token; sparse prefill of extends from 600
    tokens at alpha 0.98 (the paper's 0.955 loses planted facts on this 135M model), so
    shorter prompts prefill exactly."""
    flags = ["--model-path", model_path, *COMMON_FLAGS,
             "--spec-mode", "loopserve", "--spec-budget", "4096", "--spec-min-context", "0",
             "--spec-prefill", "loopserve", "--spec-prefill-min-tokens", "600",
             "--spec-prefill-alpha", "0.98"]
    with ServerProcess(SPEC, flags, log_path=_log_path(tmp_path_factory, "loopserve")) as server:
        yield server
