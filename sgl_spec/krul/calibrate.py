"""Attention statistics of a model on local text, for a strategy before any traffic.

Algorithm 1 chooses layer pairs from a conversation's own attention. Until the
per-conversation estimator observes the served turns (issue 17, step 3), a server
uses the statistics of the model on the head's local training text (the paper's
"Krul (Fix)": one strategy for every conversation), measured once per model with the
target in transformers (float32) and kept in the cache dir, like the retrieval head.

    python -m sgl_spec.calibrate strategy [--model-path DIR]   # ~2 min, default model
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from sgl_spec import envs, jsonfile

from .similarity import Similarity

logger = logging.getLogger(__name__)

_FORMAT = 1


@dataclass(frozen=True)
class CalibrationConfig:
    sequences: int = 8
    min_tokens: int = 2048
    max_tokens: int = 3072
    last_rows: int = 32         # query positions per sequence: the last ones (decode-like)
    random_rows: int = 32       # ... and random ones in the last half
    seed: int = 0

    @classmethod
    def quick(cls) -> CalibrationConfig:
        """Two short sequences: seconds, for tests."""
        return cls(sequences=2, min_tokens=1024, max_tokens=1536, last_rows=8, random_rows=8)


def stats_path(model_path: str, cc: CalibrationConfig = CalibrationConfig()) -> str:
    key = [_FORMAT, os.path.abspath(model_path), dataclasses.asdict(cc)]
    return envs.keyed_path("krul", model_path, key, suffix=".json")


def query_rows(n: int, cc: CalibrationConfig, gen: torch.Generator) -> torch.Tensor:
    """Sorted distinct positions: the last ``last_rows`` and ``random_rows`` drawn from
    the second half before them. [m] int64."""
    last = torch.arange(max(0, n - cc.last_rows), n)
    lo, hi = n // 2, max(n // 2, n - cc.last_rows)
    pool = torch.arange(lo, hi)
    pick = pool[torch.randperm(len(pool), generator=gen)[: cc.random_rows]]
    return torch.cat([pick, last]).unique(sorted=True)


def measure(model_path: str, cc: CalibrationConfig = CalibrationConfig(),
            progress: bool = True) -> Similarity:
    """The model's Similarity over the calibration text (group-mean attention rows per
    KV head, as the head's training targets)."""
    from tqdm import tqdm

    from sgl_spec.head import data
    from sgl_spec.head.train import load_target

    model, tok, rec = load_target(model_path)
    sim = Similarity(model.config.num_hidden_layers)
    gen = torch.Generator().manual_seed(cc.seed)
    seqs = data.samples(tok, cc.sequences, (cc.min_tokens, cc.max_tokens), seed=cc.seed)
    for s in tqdm(seqs, desc="krul: attention statistics", unit="seq", disable=not progress):
        rows = query_rows(len(s.ids), cc, gen)
        rec.start(rows, per_layer=True)
        with torch.no_grad():
            model(input_ids=torch.tensor([s.ids]), use_cache=False)
        with sim.step() as step:
            for layer, p in enumerate(rec.per_layer):               # [Hkv, R, T]
                step.add(layer, p.permute(1, 0, 2), rows)
        rec.per_layer = rec.rows = None
    return sim


def prepare(model_path: str, cc: CalibrationConfig = CalibrationConfig(),
            force: bool = False, out: str | None = None) -> str:
    """Measure (once) and return the path of the model's statistics (JSON)."""
    path = out or stats_path(model_path, cc)
    if os.path.exists(path) and not force:
        return path
    sim = measure(model_path, cc)
    jsonfile.write_atomic(path, {"format": _FORMAT, "model": os.path.abspath(model_path),
                                 "config": dataclasses.asdict(cc), "stats": sim.to_dict()})
    logger.info("krul: attention statistics of %s saved to %s", model_path, path)
    return path


def load(path: str) -> Similarity:
    """The statistics ``prepare`` wrote; ValueError names what is wrong."""
    return jsonfile.read_versioned(path, _FORMAT, "Krul statistics",
                                   lambda d: Similarity.from_dict(d["stats"]))
