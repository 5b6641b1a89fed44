"""Krul's strategy selection (Algorithm 1) and the similarity statistics it reads."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.krul.select import Strategy, select_pairs
from sgl_spec.krul.similarity import (Similarity, attention_rows, ir_mass,
                                      reference_distances)

# A hand-worked 6-layer example: layer 0 is input-sensitive (0.2 < gamma 0.5), and
# although it is closest to everything it is never paired.
IR = torch.tensor([0.2, 0.9, 0.8, 0.95, 0.7, 0.85])
_D = {(1, 2): 0.3, (1, 3): 0.1, (1, 4): 0.5, (1, 5): 0.6, (2, 3): 0.2, (2, 4): 0.4,
      (2, 5): 0.25, (3, 4): 0.7, (3, 5): 0.8, (4, 5): 0.9}


def _dist() -> torch.Tensor:
    d = torch.full((6, 6), 0.01)
    d.fill_diagonal_(0)
    for (i, j), v in _D.items():
        d[i, j] = d[j, i] = v
    return d


@pytest.mark.parametrize("ratio, pairs", [
    # (1,3) 0.1 taken; (2,3) 0.2 skipped (3 is shared); (2,5) 0.25 taken; |S| = 4 >= 3: stop
    (0.5, ((1, 3), (2, 5))),
    # |S| = 2 >= 1.8 after the first pair
    (0.3, ((1, 3),)),
    # every remaining pair reuses a layer: layer 4 stays alone
    (1.0, ((1, 3), (2, 5))),
    (0.0, ()),
], ids=["ratio-0.5", "ratio-0.3", "ratio-1", "ratio-0"])
def test_algorithm_1_hand_worked(ratio, pairs):
    s = select_pairs(IR, _dist(), gamma=0.5, ratio=ratio)
    assert s.pairs == pairs
    assert s.input_sensitive == (0,)
    assert 0 not in s.shared


def test_all_layers_input_sensitive_shares_nothing():
    s = select_pairs(IR, _dist(), gamma=0.99, ratio=1.0)
    assert s.pairs == () and s.input_sensitive == tuple(range(6))


def test_ties_break_by_layer_index():
    d = torch.ones(4, 4)
    s = select_pairs(torch.ones(4), d, gamma=0.5, ratio=1.0)
    assert s.pairs == ((0, 1), (2, 3))


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\]"):
        select_pairs(IR, _dist(), gamma=0.5, ratio=1.5)
    with pytest.raises(ValueError, match=r"dist must be \[6, 6\]"):
        select_pairs(IR, torch.zeros(5, 5), gamma=0.5, ratio=0.5)
    with pytest.raises(ValueError, match="already in another pair"):
        Strategy(4, ((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="cannot be shared"):
        Strategy(4, ((0, 1),), (1,))


def test_strategy_round_trips_json():
    s = select_pairs(IR, _dist(), gamma=0.5, ratio=0.5)
    assert Strategy.from_json(s.to_json()) == s
    assert s.partner(3) == 1 and s.partner(4) is None


def test_attention_rows_match_a_dense_causal_softmax():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, 8, generator=g)
    k = torch.randn(10, 2, 8, generator=g)
    pos = torch.tensor([4, 7, 9])
    rows = attention_rows(q, k, pos)
    for r, p in enumerate(pos.tolist()):
        for h in range(6):
            s = (k[: p + 1, h // 3] @ q[r, h]) * 8 ** -0.5
            torch.testing.assert_close(rows[r, h, : p + 1], torch.softmax(s, 0))
            assert rows[r, h, p + 1:].abs().sum() == 0


def test_ir_mass_counts_the_first_and_last_tenth_the_row_sees():
    rows = torch.zeros(2, 1, 20)
    rows[0, 0, :10] = 0.1            # position 9 sees 10 keys: first 1 and last 1
    rows[1, 0, :] = 0.05             # position 19 sees 20 keys: first 2 and last 2
    assert ir_mass(rows, torch.tensor([9, 19])).squeeze(1).tolist() == pytest.approx([0.2, 0.2])


def test_streamed_gram_equals_distances_of_the_full_maps():
    """Rows folded layer by layer over two steps (prefill sample, then a decode row)
    give the cdist of the concatenated maps, and the I-R share their mean."""
    g = torch.Generator().manual_seed(1)
    L, hq, hkv, d = 5, 4, 2, 16
    sim = Similarity(L)
    maps = [[] for _ in range(L)]
    irs = [[] for _ in range(L)]
    for n, pos in ((40, torch.tensor([10, 25, 39])), (41, torch.tensor([40]))):
        k = torch.randn(L, n, hkv, d, generator=g)
        q = torch.randn(L, len(pos), hq, d, generator=g)
        with sim.step() as step:
            for layer in reversed(range(L)):           # any order
                rows = attention_rows(q[layer], k[layer], pos)
                step.add(layer, rows, pos)
                maps[layer].append(rows.reshape(-1))
                irs[layer].append(ir_mass(rows, pos))
        assert not step.kept                            # the step's rows are dropped
    flat = [torch.cat(m) for m in maps]
    ref = torch.cdist(torch.stack(flat).double(), torch.stack(flat).double()) / (4 * hq) ** 0.5
    torch.testing.assert_close(sim.distances(), ref, rtol=1e-6, atol=1e-9)
    ref_ir = torch.stack([torch.cat([x.reshape(-1) for x in ir]).double().mean() for ir in irs])
    torch.testing.assert_close(sim.ir_share(), ref_ir)
    assert sim.observed() == 4 * hq


def test_reference_distances_and_payload_round_trip():
    g = torch.Generator().manual_seed(2)
    maps = [torch.softmax(torch.randn(3, 2, 12, generator=g), -1) for _ in range(3)]
    sim = Similarity(3)
    pos = torch.full((3,), 11)
    with sim.step() as step:
        for layer, m in enumerate(maps):
            step.add(layer, m, pos)
    torch.testing.assert_close(sim.distances(), reference_distances(maps))
    again = Similarity.from_dict(sim.to_dict())
    torch.testing.assert_close(again.gram, sim.gram)
    again.merge(sim)
    torch.testing.assert_close(again.distances(), sim.distances())   # scale-free


def test_misaligned_rows_are_refused():
    sim = Similarity(2)
    step = sim.step()
    step.add(0, torch.rand(2, 2, 8), torch.tensor([7, 7]))
    with pytest.raises(ValueError, match="do not align"):
        step.add(1, torch.rand(1, 2, 8), torch.tensor([7]))
    with pytest.raises(ValueError, match="already added"):
        step.add(0, torch.rand(2, 2, 8), torch.tensor([7, 7]))
