"""The MiniCache merge of a layer pair against its plain reference."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.krul.merge import MergeParams, merge, pair_retained, restore, retained_tokens
from sgl_spec.krul.merge_ref import merge_restore_ref


def _pair(n=24, h=3, d=16, noise=0.3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    xi = torch.randn(n, h, d, generator=g) * (1 + torch.rand(n, h, 1, generator=g))
    xj = xi * 1.5 + noise * torch.randn(n, h, d, generator=g)
    return xi.to(dtype), xj.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t", [0.0, 0.6, 1.0], ids=["t0", "t0.6", "t1"])
def test_merge_matches_the_reference(dtype, t):
    xi, xj = _pair(dtype=dtype)
    m = merge(xi, xj, MergeParams(t=t, retain=0.1))
    oi, oj = restore(m)
    ri, rj = merge_restore_ref(xi, xj, t, m.retained)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(oi.double(), ri, **tol)
    torch.testing.assert_close(oj.double(), rj, **tol)
    assert oi.dtype == dtype and m.kept_j.shape == (int(m.retained.sum()), 3, 16)


def test_magnitudes_are_kept_and_retained_tokens_are_exact():
    xi, xj = _pair()
    m = merge(xi, xj, MergeParams(retain=0.25))
    oi, oj = restore(m)
    torch.testing.assert_close(oi.norm(dim=-1), xi.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(oj.norm(dim=-1), xj.norm(dim=-1), rtol=1e-5, atol=1e-5)
    assert int(m.retained.sum()) == 6
    assert torch.equal(oi[m.retained], xi[m.retained])
    assert torch.equal(oj[m.retained], xj[m.retained])


def test_retained_tokens_are_the_most_distinct():
    xi, xj = _pair(n=10, noise=0.01)
    xj[3] = -xi[3]                   # opposite directions: the most distinct token
    assert retained_tokens(xi, xj, 0.1).nonzero().flatten().tolist() == [3]
    vi, vj = _pair(n=10, noise=0.01, seed=5)
    vj[7] = -vi[7]
    assert pair_retained(xi, xj, vi, vj, 0.2).nonzero().flatten().tolist() == [3, 7]


def test_reconstruction_error_falls_with_layer_similarity():
    """Relative L2 error of the merged layers: identical directions reconstruct exactly;
    error grows with how far apart the pair is (the reason Algorithm 1 ranks pairs)."""
    errs = []
    for noise in (0.0, 0.1, 0.5, 2.0):
        xi, xj = _pair(n=256, noise=noise)
        oi, oj = restore(merge(xi, xj, MergeParams(retain=0.0)))
        err = float(((oi - xi).norm() + (oj - xj).norm()) / (xi.norm() + xj.norm()))
        errs.append(err)
    assert errs[0] < 1e-5
    assert errs == sorted(errs) and errs[-1] > 0.3


def test_bad_params_and_shapes_are_refused():
    with pytest.raises(ValueError, match=r"t must be in \[0, 1\]"):
        MergeParams(t=1.5)
    with pytest.raises(ValueError, match="pair tensors differ"):
        merge(torch.zeros(4, 2, 8), torch.zeros(5, 2, 8))
