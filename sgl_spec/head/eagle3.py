"""Read a retrieval head out of an EAGLE-3 draft checkpoint; write one in that layout.

An EAGLE-3 draft (``LlamaForCausalLMEagle3``, as sglang's
``--speculative-draft-model-path`` takes it) is a directory with ``config.json`` and
safetensors (one file, or shards with ``model.safetensors.index.json``) or
``pytorch_model.bin``. Its tensors: ``fc.weight`` [H, 3 Ht], ``midlayer.*`` (one
decoder layer whose q/k/v projections read 2H: the normed embedding and the normed
``fc`` output), ``norm.weight``, ``lm_head.weight`` over the draft vocabulary,
``d2t``/``t2d`` and, in some checkpoints, ``embed_tokens.weight``; a ``model.`` prefix
is accepted. The head reads ``fc``, ``midlayer.input_layernorm``,
``midlayer.hidden_norm`` and ``midlayer.self_attn.{q,k}_proj`` (and the embedding
when present); nothing else is loaded.

``save`` writes exactly those tensors under the same names with an EAGLE-3
``config.json`` (``sgl_spec_head_only: true``): the head ``train_head`` makes is a
retrieval head, not a speculative-decoding draft (it has no LM head).
"""

from __future__ import annotations

import glob
import json
import os

import torch

from .config import HeadConfig
from .model import HeadWeights

# HeadWeights field -> checkpoint tensor name
NAMES = {
    "fc": "fc.weight",
    "hidden_norm": "midlayer.hidden_norm.weight",
    "input_norm": "midlayer.input_layernorm.weight",
    "q_proj": "midlayer.self_attn.q_proj.weight",
    "k_proj": "midlayer.self_attn.k_proj.weight",
    "embed": "embed_tokens.weight",
}
OPTIONAL = ("embed",)
WEIGHTS_FILE = "model.safetensors"


def _tensor_files(path: str) -> list[str]:
    st = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    return st or sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))


def _read(path: str, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The ``wanted`` tensors (names without a ``model.`` prefix) found in ``path``."""
    files = _tensor_files(path)
    if not files:
        raise ValueError(f"{path} has no *.safetensors or pytorch_model*.bin: not a "
                         "draft checkpoint")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if f.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(f, framework="pt") as st:
                for key in st.keys():
                    name = key.removeprefix("model.")
                    if name in wanted:
                        out[name] = st.get_tensor(key)
        else:
            state = torch.load(f, map_location="cpu", weights_only=True)
            out.update({k.removeprefix("model."): v for k, v in state.items()
                        if k.removeprefix("model.") in wanted})
    return out


def load(path: str) -> tuple[HeadConfig, HeadWeights, int]:
    """``(config, weights, number of aux layers)`` of the draft at ``path``.

    ValueError (naming the path and what is wrong) for a directory that is not an
    EAGLE-3 draft: no config, another architecture, a missing tensor, a shape that
    does not fit the config.
    """
    if not os.path.isdir(path):
        raise ValueError(f"--spec-draft-path {path!r} is not a directory")
    try:
        cfg = HeadConfig.load(path)
        found = _read(path, set(NAMES.values()))
        missing = [n for f, n in NAMES.items() if f not in OPTIONAL and n not in found]
        if missing:
            raise ValueError(f"missing tensors {missing}")
        fc = found[NAMES["fc"]]
        n_aux, rest = divmod(fc.shape[1], cfg.target_hidden_size) if fc.dim() == 2 else (0, 1)
        if rest or n_aux < 1:
            raise ValueError(f"fc.weight {tuple(fc.shape)} does not read whole target "
                             f"hidden states of {cfg.target_hidden_size}")
        if cfg.aux_layers and len(cfg.aux_layers) != n_aux:
            raise ValueError(f"fc.weight reads {n_aux} hidden states but eagle_config "
                             f"names {len(cfg.aux_layers)} layers")
        w = HeadWeights(**{f: found.get(n) for f, n in NAMES.items()})
        w.check(cfg, n_aux)
    except ValueError as exc:
        raise ValueError(f"EAGLE-3 draft {path}: {exc}") from None
    return cfg, w, n_aux


def save(path: str, cfg: HeadConfig, weights: HeadWeights, metadata: dict | None = None) -> str:
    """Write the head as an EAGLE-3-layout checkpoint (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    n_aux = weights.fc.shape[1] // cfg.target_hidden_size
    weights.check(cfg, n_aux)
    os.makedirs(path, exist_ok=True)
    tensors = {n: getattr(weights, f).detach().to("cpu", torch.float32).contiguous()
               for f, n in NAMES.items() if getattr(weights, f) is not None}
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    config = {**cfg.to_json_dict(), "sgl_spec_head_only": True}
    if metadata:
        config["sgl_spec_training"] = metadata
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return path
