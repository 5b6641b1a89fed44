"""Model sources without the opt-in model: chunks assembled only when every checksum
matches, a corrupted chunk refused before anything is converted, and the CLI's choices."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from sgl_spec import model_sources, prepare_model
from sgl_spec.model_sources import ChecksumError, ModelSource, assemble


def _chunks(tmp_path, n=3, size=1000):
    paths = []
    for i in range(n):
        p = tmp_path / f"part{i}.bin"
        p.write_bytes(bytes((i * 7 + j) % 251 for j in range(size)))
        paths.append(str(p))
    sums = [hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths]
    whole = hashlib.sha256(b"".join(open(p, "rb").read() for p in paths)).hexdigest()
    return paths, sums, whole


def _flip(src: str, dst: str, at: int = 500) -> str:
    data = bytearray(open(src, "rb").read())
    data[at] ^= 0x01
    with open(dst, "wb") as f:
        f.write(data)
    return dst


def test_assemble_verifies_and_concatenates(tmp_path):
    paths, sums, whole = _chunks(tmp_path)
    out = assemble(paths, str(tmp_path / "model.gguf"), sums, 3000, whole)
    assert open(out, "rb").read() == b"".join(open(p, "rb").read() for p in paths)


def test_a_flipped_byte_is_refused_naming_the_checksum(tmp_path):
    paths, sums, whole = _chunks(tmp_path)
    paths[1] = _flip(paths[1], str(tmp_path / "bad.bin"))
    dest = tmp_path / "model.gguf"
    with pytest.raises(ChecksumError, match=rf"chunk 2 of 3 .*bad\.bin\) has sha256 [0-9a-f]{{64}}"
                                            rf", expected {sums[1]}; nothing was converted"):
        assemble(paths, str(dest), sums, 3000, whole)
    assert not dest.exists() and not (tmp_path / "model.gguf.part").exists()


def test_wrong_size_and_wrong_whole_sum_are_refused(tmp_path):
    paths, sums, whole = _chunks(tmp_path)
    with pytest.raises(ChecksumError, match="hold 3000 bytes, expected 3001"):
        assemble(paths, str(tmp_path / "m"), sums, 3001, whole)
    with pytest.raises(ChecksumError, match=f"assembled file has sha256 {whole}, expected "
                                            f"{'0' * 64}"):
        assemble(paths, str(tmp_path / "m"), sums, 3000, "0" * 64)
    assert not (tmp_path / "m").exists()


def test_prepare_converts_nothing_from_a_bad_blob(tmp_path, monkeypatch):
    paths, sums, whole = _chunks(tmp_path)
    paths[0] = _flip(paths[0], str(tmp_path / "bad.bin"))
    source = ModelSource("bad-model", "Bad-Model", "LlamaForCausalLM", tied=True,
                         origin="test", gguf=lambda work: assemble(
                             paths, os.path.join(work, "m.gguf"), sums, 3000, whole))
    monkeypatch.setitem(model_sources.SOURCES, "bad-model", source)
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError, match=f"expected {sums[0]}"):
        prepare_model.prepare(str(cache), model="bad-model")
    assert os.listdir(cache / "models") == []  # neither the model dir nor its .tmp


def test_registry_lists_valid_models():
    assert list(model_sources.SOURCES)[:2] == ["smollm2-135m", "qwen2.5-coder-0.5b"]
    with pytest.raises(ValueError, match="unknown model 'llama'; valid: smollm2-135m, "
                                         "qwen2.5-coder-0.5b"):
        model_sources.get("llama")
    with pytest.raises(ValueError, match="already registered"):
        model_sources.register(model_sources.get("smollm2-135m"))
    qwen = model_sources.get("qwen2.5-coder-0.5b")
    assert not qwen.tied and qwen.architecture == "Qwen2ForCausalLM"
    assert model_sources.QWEN_SIZE == 491_400_064 and len(model_sources.QWEN_CHUNKS) == 6


def test_cli_names_the_valid_models():
    out = subprocess.run([sys.executable, "-m", "sgl_spec.prepare_model", "--model", "llama"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "invalid choice: 'llama' (choose from smollm2-135m, qwen2.5-coder-0.5b)" in \
        out.stderr.replace("'smollm2-135m'", "smollm2-135m").replace(
            "'qwen2.5-coder-0.5b'", "qwen2.5-coder-0.5b")
    helped = subprocess.run([sys.executable, "-m", "sgl_spec.prepare_model", "--help"],
                            capture_output=True, text=True, check=True).stdout
    assert "Apache-2.0" in helped and "opt-in" in helped
