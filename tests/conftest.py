"""Shared fixtures: real sglang servers started once per test session."""

from __future__ import annotations

import os

import pytest

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
