"""The retrieval head's shape, read from (or written to) an EAGLE-3 ``config.json``.

SpeContext (Sec 4.3) cuts its retrieval head out of a one-layer EAGLE-3 draft model
(``LlamaForCausalLMEagle3``): the draft's input at position j is its own embedding
of token j and ``fc`` of the target's hidden states at position j - 1 captured at
three layers (``aux_layers``: the residual stream entering those target layers, as
sglang's ``set_eagle3_layers_to_capture`` takes it). The head keeps the embedding,
``fc``, the two input norms, the q/k projections and RoPE; the draft's v/o
projections, MLP and LM head are not read.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

ARCHITECTURE = "LlamaForCausalLMEagle3"
ROPE_TYPES = ("default", "linear", "yarn")


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int  # H: the draft's width (its embedding's and fc's output)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_hidden_size: int  # Ht: width of each captured target hidden state
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    # {"rope_type": "linear" | "yarn", "factor": f, "original_max_position_embeddings": n}
    rope_scaling: tuple[tuple[str, float | int | str], ...] = ()
    # Target layers whose *input* residual stream is captured, low to high; () means
    # EAGLE-3's default for the target at hand: (2, L // 2, L - 3).
    aux_layers: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)  # other config.json keys

    def __post_init__(self):
        for name in ("hidden_size", "num_q_heads", "num_kv_heads", "head_dim", "vocab_size",
                     "target_hidden_size", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"head config: {name} must be an integer >= 1, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"head config: num_attention_heads {self.num_q_heads} is not a "
                             f"multiple of num_key_value_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head config: head_dim {self.head_dim} must be even (RoPE)")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"head config: rope_scaling type {self.rope_type!r} is not "
                             f"supported; valid: {', '.join(ROPE_TYPES)}")
        if self.rope_type != "default" and float(self.scaling.get("factor", 0)) <= 0:
            raise ValueError(f"head config: rope_scaling {self.scaling} needs a factor > 0")
        if any(i < 0 for i in self.aux_layers):
            raise ValueError(f"head config: aux layers {self.aux_layers} must be >= 0")

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def scaling(self) -> dict:
        return dict(self.rope_scaling)

    @property
    def rope_type(self) -> str:
        s = self.scaling
        return str(s.get("rope_type", s.get("type", "default"))) if s else "default"

    def resolve_aux_layers(self, target_layers: int) -> tuple[int, ...]:
        """The captured layers for a target of ``target_layers`` layers."""
        layers = self.aux_layers or (2, target_layers // 2, target_layers - 3)
        if any(i >= target_layers for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"head aux layers {layers} do not fit a target of "
                             f"{target_layers} layers (distinct, each < {target_layers})")
        return tuple(layers)

    # ------------------------------------------------------------ config.json

    @classmethod
    def from_json_dict(cls, d: dict) -> HeadConfig:
        """From an EAGLE-3 draft's ``config.json``; ValueError names what is missing."""
        arch = d.get("architectures") or []
        if ARCHITECTURE not in arch:
            raise ValueError(f"config.json architectures {arch} is not an EAGLE-3 draft; "
                             f"expected [{ARCHITECTURE!r}]")
        missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"config.json lacks {missing}")
        heads = d["num_attention_heads"]
        eagle = d.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        known = {"architectures", "hidden_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size", "target_hidden_size", "rope_theta", "rms_norm_eps",
                 "max_position_embeddings", "rope_scaling", "eagle_config"}
        return cls(
            hidden_size=d["hidden_size"], num_q_heads=heads,
            num_kv_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            vocab_size=d["vocab_size"],
            target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rope_scaling=tuple(sorted((d.get("rope_scaling") or {}).items())),
            # EAGLE-3 names the layers whose *output* it captures; sglang captures the
            # input of the next one (set_eagle3_layers_to_capture: val + 1).
            aux_layers=tuple(i + 1 for i in ids) if ids else (),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_json_dict(self) -> dict:
        d = asdict(self)
        out = {
            "architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": d["hidden_size"], "num_attention_heads": d["num_q_heads"],
            "num_key_value_heads": d["num_kv_heads"], "head_dim": d["head_dim"],
            "vocab_size": d["vocab_size"], "target_hidden_size": d["target_hidden_size"],
            "rope_theta": d["rope_theta"], "rms_norm_eps": d["rms_norm_eps"],
            "max_position_embeddings": d["max_position_embeddings"],
            "rope_scaling": self.scaling or None, "num_hidden_layers": 1,
        }
        if self.aux_layers:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids":
                                   [i - 1 for i in self.aux_layers]}
        return {**self.extra, **out}

    @classmethod
    def load(cls, path: str) -> HeadConfig:
        f = os.path.join(path, "config.json")
        if not os.path.isfile(f):
            raise ValueError(f"{path} has no config.json: not an EAGLE-3 draft checkpoint")
        with open(f) as fh:
            return cls.from_json_dict(json.load(fh))
