"""The first-selection probe's parts without a model: the value's token positions and the
kept share on hand-made queries and keys (the look-ahead score: tests/test_scoring.py)."""

from __future__ import annotations

import torch

from sgl_spec.bench import first_selection as fs
from sgl_spec.bench.qk_capture import LayerQK
from sgl_spec.config import DecodeConfig
from sgl_spec.sparse.scoring import look_ahead


def test_value_positions_are_the_value_tokens_inside_the_planted_sentence(hf_tok):
    text = "The code is 7. More prose. The code of the red box is 4411. The end."
    pos = fs.value_positions(hf_tok, text, "The code of the red box is 4411.", "4411")
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert pos and "4411" in hf_tok.decode([ids[i] for i in pos])
    assert "7" not in hf_tok.decode([ids[i] for i in pos])


def test_kept_share_follows_where_the_ring_looks():
    """One layer, one KV head: the ring's queries favour key 10 and then the earliest
    keys, so mass keeps 10 and 1-4 and loses 14, which a look-ahead of 4 keeps (10-14)."""
    cfg = DecodeConfig(mode="loopserve", budget=5, sink=1, window=2, nd=2,
                       first_select_step=2)
    prompt, d = 20, 8
    k = torch.zeros(prompt + 3, 1, d)
    k[:, 0, 0] = -0.1 * torch.arange(prompt + 3)
    k[10, 0, 0] = 8.0
    q = torch.zeros(prompt + 3, 1, d)
    q[:, 0, 0] = 1.0
    layer = LayerQK(q, k, k)
    scores = {"mass": fs.SCORES["mass"], "ahead-4": lambda m, lo: look_ahead(m, 4, lo)}
    share = fs.kept_share([layer], prompt, [14], cfg, 1.0, scores)
    assert share == {"mass": 0.0, "ahead-4": 1.0}
    assert fs.kept_share([layer], prompt, [10, 4], cfg, 1.0, scores)["mass"] == 1.0
    assert set(fs.SCORES) >= {"mass", "ahead-32"}
