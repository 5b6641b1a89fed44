"""Krul's host arena: logical slots over rows shared by every layer."""

from __future__ import annotations

import pytest
import torch

from sgl_spec.tiers.arena import UNSTORED, Arena
from sgl_spec.krul.merge import MergeParams
from sgl_spec.krul.select import Strategy

L, H, D = 6, 2, 8


def _filled(n=10, slots=40, rows=None, dtype=torch.float32, seed=0, codec="full"):
    """An arena with n tokens backed up; poisoned (NaN, or int8 scales) so unwritten
    rows show."""
    a = Arena(slots, L, rows or slots * L, H, D, dtype, codec=codec)
    if codec == "full":
        a.k.fill_(float("nan"))
        a.v.fill_(float("nan"))
    else:
        a.store.k_scale.fill_(float("nan"))
        a.store.v_scale.fill_(float("nan"))
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, H, D, generator=g)
    k = torch.stack([base * (1 + 0.1 * l) + 0.05 * torch.randn(n, H, D, generator=g)
                     for l in range(L)]).to(dtype)                        # similar layers
    v = torch.randn(L, n, H, D, generator=g).to(dtype)
    s = a.alloc(n)
    for l in range(L):
        a.write(l, s, k[l], v[l])
    return a, s, k, v


def test_backup_reads_back_exactly():
    a, s, k, v = _filled()
    for l in range(L):
        kk, vv, stored = a.read(l, s)
        assert torch.equal(kk, k[l]) and torch.equal(vv, v[l]) and stored.all()
    assert a.stored_bytes(s) == a.full_bytes(10)


def test_alloc_reserves_rows_for_every_layer_and_free_returns_them():
    a = Arena(8, L, 8 * L, H, D, torch.float32)
    s = a.alloc(5)
    assert a.available() == 3 and a.alloc(4) is None
    a.free(s)
    assert a.available() == 8
    with pytest.raises(RuntimeError, match="double free"):
        a.free(s)


def test_compress_frees_rows_at_once_and_capacity_grows():
    """With every layer paired (r_l = 1) and nothing retained, half the rows come back:
    more tokens fit at the same byte budget (the point of Krul's host pool)."""
    a, s, k, v = _filled(n=10, slots=40, rows=10 * L)
    assert a.available() == 0
    strat = Strategy(L, ((0, 1), (2, 3), (4, 5)))
    c = a.compress(s, strat, [0] * L, MergeParams(retain=0.0))
    assert c.rows_freed == 30 and c.tokens_merged == 30
    assert a.available() == 5
    # half the rows, plus a magnitude per head, K and V, for each merged (token, layer)
    assert a.stored_bytes(s) == a.full_bytes(10) // 2 + 10 * L * 2 * H * 4
    for l in range(L):
        kk, vv, stored = a.read(l, s)
        assert stored.all() and not kk.isnan().any()
        # magnitudes are kept exactly (up to the dtype)
        torch.testing.assert_close(kk.norm(dim=-1), k[l].norm(dim=-1))
        torch.testing.assert_close(vv.norm(dim=-1), v[l].norm(dim=-1))


def test_unstored_prefix_and_retained_tokens():
    a, s, k, v = _filled(n=20)
    strat = Strategy(L, ((1, 4),), (0,))
    U = [6, 4, 4, 2, 0, 0]
    c = a.compress(s, strat, U, MergeParams(retain=0.25))
    for l in range(L):
        kk, vv, stored = a.read(l, s)
        assert (~stored).sum() == U[l] and not stored[U[l]:].logical_not().any()
        assert torch.equal(kk[~stored], torch.zeros_like(kk[~stored]))
        if l not in (1, 4):   # unpaired layers keep their stored rows exactly
            assert torch.equal(kk[U[l]:], k[l][U[l]:])
    # pair (1, 4) merges the 16 tokens both store, keeping ceil(0.25 * 16) = 4 apart
    assert c.tokens_merged == 12 and c.tokens_retained == 4
    assert (a.map[1, s][4:] >= 0).sum() == 4 and (a.map[1, s] == UNSTORED).sum() == 4


def test_free_after_compress_returns_everything():
    a, s, _, _ = _filled(n=10, slots=20)
    before = a.rows.count + a.map[:, s].ge(0).sum().item()
    a.compress(s, Strategy(L, ((0, 1), (2, 5))), [3, 3, 2, 1, 0, 0])
    a.free(s)
    assert a.rows.count == before and a.mags.count == a.mag.shape[0]
    assert a.available() == 20


def test_checksum_sees_one_flipped_byte_and_ignores_placement():
    a, s, k, v = _filled(n=10)
    a.compress(s, Strategy(L, ((0, 1),)), [2, 1, 0, 0, 0, 0])
    before = a.checksum(s)
    row = a.map[3, s[5]]
    a.k[row].view(torch.uint8)[0, 0] ^= 1
    assert a.checksum(s) != before
    a.k[row].view(torch.uint8)[0, 0] ^= 1
    assert a.checksum(s) == before
    # the same content written elsewhere in another arena sums the same
    b = Arena(40, L, 40 * L, H, D, torch.float32)
    b.alloc(7)
    t = b.alloc(10)
    for l in range(L):
        b.write(l, t, k[l], v[l])
    b.compress(t, Strategy(L, ((0, 1),)), [2, 1, 0, 0, 0, 0])
    assert b.checksum(t) == before


@pytest.mark.parametrize("codec", ["full", "int8", "k8v4"])
@pytest.mark.parametrize("layout", ["runs", "fragmented"])
def test_checksum_in_place_equals_the_gathered_reference(codec, layout):
    """Hashing runs of rows in place gives the digest of the gathered rows, whether the
    rows are consecutive (a fresh alloc) or scattered (a fragmented free list), with
    merged pairs, retained tokens and unstored prefixes among them."""
    a = Arena(64, L, 64 * L, H, D, torch.float32, codec=codec)
    if layout == "fragmented":  # free every other token's rows, so later allocs interleave
        held = a.alloc(60)
        a.free(held[::2])
    g = torch.Generator().manual_seed(3)
    s = a.alloc(20)
    for l in range(L):
        a.write(l, s, torch.randn(20, H, D, generator=g), torch.randn(20, H, D, generator=g))
    rows = a.map[:, s]
    gaps = int((rows[:, 1:] - rows[:, :-1] != 1).sum())
    assert (gaps > 20) == (layout == "fragmented")
    assert a.checksum(s) == a.checksum_ref(s)
    a.compress(s, Strategy(L, ((1, 4), (2, 3))), [3, 2, 2, 1, 0, 0], MergeParams(retain=0.25))
    assert a.checksum(s) == a.checksum_ref(s)
    assert a.checksum(s[5:12]) == a.checksum_ref(s[5:12])   # a split node's part
    row = int(a.map[5, s[7]])
    a.store.byte_views()[0][row, 0] ^= 1
    assert a.checksum(s) == a.checksum_ref(s)


@pytest.mark.parametrize("rows", [[*range(0, 40), *range(50, 90)], [7], [9, 8, 7, 3],
                                  [5, 5, 6, 6], [*range(30), 31, 33, *range(40, 70)]],
                         ids=["two-runs", "one", "descending", "repeats", "runs-and-gaps"])
def test_hashing_rows_in_place_equals_hashing_their_gather(rows):
    import numpy as np
    import xxhash

    from sgl_spec.tiers.arena import _hash_rows

    g = np.random.default_rng(0)
    bufs = [g.integers(0, 256, (100, w), dtype=np.uint8) for w in (16, 4, 8)]
    idx = np.array(rows)
    h, ref = xxhash.xxh3_64(), xxhash.xxh3_64()
    _hash_rows(h, bufs, idx)
    for b in bufs:
        ref.update(b[idx].tobytes())
    assert h.intdigest() == ref.intdigest()


def test_bad_calls_are_refused():
    a, s, _, _ = _filled(n=4)
    with pytest.raises(ValueError, match="non-increasing"):
        a.compress(s, Strategy(L), [0, 1, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="this arena has 6 layers"):
        a.compress(s, Strategy(5), [0] * 5)
    a.compress(s, Strategy(L, ((0, 1),)), [1, 0, 0, 0, 0, 0])
    with pytest.raises(RuntimeError, match="own a row at every layer"):
        a.compress(s, Strategy(L, ((0, 1),)), [0] * L)
    with pytest.raises(RuntimeError, match="cannot be written"):
        a.write(0, s, torch.zeros(4, H, D), torch.zeros(4, H, D))


def test_bytes_for_counts_rows_maps_and_magnitudes():
    assert Arena.bytes_for(10, 6, 60, 2, 8, 2) == 2 * 60 * 2 * 8 * 2 + 60 * 2 * 2 * 2 + \
        2 * 6 * 10 * 8 + (10 + 60 + 60) * 9


def test_a_pair_that_merges_badly_stays_exact():
    """Layers 4 and 5 hold unrelated V (random): merging them errs ~0.7, over the
    bound, so only pair (0, 1), whose K are alike... V too here, merges."""
    a, s, k, v = _filled(n=16)
    v[1] = v[0] * 1.2                         # pair (0, 1): alike
    for l in (0, 1):
        a.write(l, s, k[l], v[l])
    c = a.compress(s, Strategy(L, ((0, 1), (4, 5))), [0] * L,
                   MergeParams(retain=0.0, max_error=0.2))
    assert c.pairs_skipped == 1 and c.tokens_merged == 16
    for l in (4, 5):                          # exact, own rows
        kk, vv, _ = a.read(l, s)
        assert torch.equal(kk, k[l]) and torch.equal(vv, v[l])


# --- the quantized codecs ----------------------------------------------------------------


@pytest.mark.parametrize("codec,v_bits,v_err", [("int8", 8, 0.01), ("k8v4", 4, 0.15)])
def test_quantized_rows_are_the_reference_and_cost_what_they_say(codec, v_bits, v_err):
    from sgl_spec.krul.quant import quantize_ref, unpack4

    a, s, k, v = _filled(codec=codec)
    for l in range(L):
        rows = a.map[l, s]
        q, scale = quantize_ref(k[l])
        assert torch.equal(a.k[rows], q) and torch.equal(a.store.k_scale[rows], scale)
        q, scale = quantize_ref(v[l], v_bits)
        codes = unpack4(a.v[rows]) if v_bits == 4 else a.v[rows]
        assert torch.equal(codes, q) and torch.equal(a.store.v_scale[rows], scale)
        kk, vv, stored = a.read(l, s)
        assert stored.all() and kk.dtype == torch.float32
        assert float((kk - k[l]).norm() / k[l].norm()) < 0.01
        assert float((vv - v[l]).norm() / v[l].norm()) < v_err
    # a row: H*D int8 K, H*D*v_bits/8 bytes of V and H bf16 scales each; against
    # float32's 2*H*D*4
    assert a.row_bytes == H * D + H * D * v_bits // 8 + 4 * H
    assert a.stored_bytes(s) == 10 * L * a.row_bytes
    assert a.stored_bytes(s) / a.full_bytes(10) == pytest.approx(a.row_bytes / (2 * H * D * 4))


def test_int8_arena_holds_more_rows_in_the_same_budget():
    hh, dd = 3, 64  # the default model's KV heads and head_dim
    budget = Arena.bytes_for(40, L, 40 * L, hh, dd, 2)
    full = Arena.rows_for_budget(budget, 40, L, hh, dd, torch.bfloat16, "full")
    int8 = Arena.rows_for_budget(budget, 40, L, hh, dd, torch.bfloat16, "int8")
    k8v4 = Arena.rows_for_budget(budget, 40, L, hh, dd, torch.bfloat16, "k8v4")
    assert full == 40 * L and int8 > 1.8 * full  # the maps and free lists cost the rest
    assert k8v4 > 2.4 * full
    assert Arena.bytes_for(40, L, int8, hh, dd, 2, None, 2 * (hh * dd + 2 * hh)) <= budget
    with pytest.raises(ValueError, match="valid: full, int8, k8v4"):
        Arena(4, L, 4 * L, H, D, torch.bfloat16, codec="fp4")


def test_int8_merges_pairs_and_checksums_its_scales():
    a, s, k, v = _filled(n=16, codec="int8")
    v[1] = v[0] * 1.2
    for l in (0, 1):
        a.write(l, s, k[l], v[l])
    c = a.compress(s, Strategy(L, ((0, 1),)), [0] * L, MergeParams(retain=0.0, max_error=0.2))
    assert c.tokens_merged == 16 and c.rows_freed == 16
    kk, vv, _ = a.read(1, s)
    assert float((vv - v[1]).norm() / v[1].norm()) < 0.05
    before = a.checksum(s)
    row = a.map[3, s[5]]
    a.store.v_scale[row].view(torch.uint8)[0] ^= 1
    assert a.checksum(s) != before
    a.free(s)
    assert a.available() == 40


# --- storage pages (an L3 backend) ------------------------------------------------------


@pytest.mark.parametrize("codec", ["full", "k8v4"])
def test_a_page_round_trips_its_stored_bytes_and_catches_a_flipped_one(codec):
    a, s, k, v = _filled(n=4, codec=codec)
    page = a.export(s)
    # every layer's rows, a bit per (layer, slot) for the unstored ones, a checksum
    assert page.dtype == torch.uint8 and page.numel() == a.page_bytes(4) == 4 * L * a.row_bytes + -(-4 * L // 8) + 8
    t = a.alloc(4)
    assert a.load(t, page) and not a.damaged[t].any()
    assert a.checksum(t) == a.checksum(s)          # the same stored bytes, not re-encoded
    for l in range(L):
        assert torch.equal(a.read(l, t)[0], a.read(l, s)[0])
    page[5] ^= 1
    assert not a.load(t, page) and a.damaged[t].all()
    a.free(t)
    assert not a.damaged.any()                     # a slot's next owner starts clean
    with pytest.raises(ValueError, match="expected"):
        a.load(a.alloc(2), page)


def test_a_page_of_merged_slots_reads_back_as_their_reconstruction():
    a, s, k, v = _filled(n=8)
    a.compress(s, Strategy(L, ((0, 1),)), [0] * L, MergeParams(retain=0.0, max_error=1.0))
    page = a.export(s)
    t = a.alloc(8)
    assert a.load(t, page)
    for l in range(L):
        assert torch.equal(a.read(l, t)[0], a.read(l, s)[0])


def test_a_page_keeps_the_restore_pyramid_unstored():
    """Slots compressed with unstored leading rows (a restore recomputes them) make a page
    that loads back as the same map: the unstored rows stay unstored, their rows free."""
    a, s, k, v = _filled(n=8)
    unstored = [6, 3, 0, 0][:L] + [0] * max(0, L - 4)
    a.compress(s, Strategy(L, ((L - 2, L - 1),)), unstored,
               MergeParams(retain=0.0, max_error=1.0))
    page = a.export(s)
    free_before = a.rows.count
    t = a.alloc(8)
    assert a.load(t, page)
    assert a.rows.count == free_before - 8 * L + sum(unstored)    # unstored rows given back
    for l in range(L):
        kt, vt, stored = a.read(l, t)
        assert stored.tolist() == [i >= unstored[l] for i in range(8)]
        assert torch.equal(kt, a.read(l, s)[0]) and torch.equal(vt, a.read(l, s)[1])
    a.free(t)
    a.free(s)
    assert a.rows.count == a.k.shape[0]                           # nothing leaked


def test_an_unlike_pair_is_rejected_on_a_sample_and_a_like_one_still_merges():
    n = 300                                     # over 2 * Arena.SAMPLE: the sample decides
    a = Arena(n, L, n * L, H, D, torch.float32)
    s = a.alloc(n)
    g = torch.Generator().manual_seed(3)
    base = torch.randn(n, H, D, generator=g)
    for l in range(L):
        own = torch.randn(n, H, D, generator=g)
        kv = base * (1 + 0.1 * l) if l < 2 else own               # layers 0, 1: alike
        a.write(l, s, kv, kv)
    params = MergeParams(retain=0.0, max_error=0.2)
    unlike = a.compress(s, Strategy(L, ((2, 3),)), [0] * L, params)
    assert unlike.pairs_skipped == 1 and unlike.tokens_merged == 0
    for l in (2, 3):
        assert (a.map[l, s] >= 0).all()         # left exact
    like = a.compress(s, Strategy(L, ((0, 1),)), [0] * L, params)
    assert like.pairs_skipped == 0 and like.tokens_merged == n


def test_host_eviction_is_byte_driven():
    """A compressed node of 10 tokens frees ~4 full-size tokens: eviction goes on until
    the arena can take what was asked, and reports full-size tokens freed."""
    from sgl_spec.tiers.arena import evict_for_bytes

    free = [0]
    nodes = [10, 10, 10, 10]           # tokens per host node, each stored at 0.4x

    def evict(k):
        got = 0
        while nodes and got < k:       # sglang's: whole nodes until k tokens
            n = nodes.pop(0)
            free[0] += int(n * 0.4)
            got += n
        return got

    assert evict_for_bytes(lambda: free[0], evict, 10) == 12 and len(nodes) == 1
    assert evict_for_bytes(lambda: free[0], evict, 12) == 4   # all that is left
    assert evict_for_bytes(lambda: free[0], evict, 0) == 0


@pytest.mark.parametrize("codec", ["full", "int8", "k8v4"])
def test_read_into_writes_what_read_returns_into_the_pool_rows(codec):
    """A restore's one-pass write equals read + an indexed write: stored rows land in
    their pool slots, unstored ones (the pre-pass recomputes them) and other slots keep
    what they held; merged rows read back as their reconstruction."""
    a, s, _, _ = _filled(n=12, codec=codec, dtype=torch.bfloat16)
    pool_k = torch.full((30, H, D), 7.0, dtype=torch.bfloat16)
    pool_v = pool_k.clone()
    dst = torch.randperm(30, generator=torch.Generator().manual_seed(3))[:12]
    for l in range(L):          # every row the slot's own: the one-pass path
        stored = a.read_into(l, s, pool_k, pool_v, dst)
        k, v, want = a.read(l, s)
        assert stored.all() and want.all()
        assert torch.equal(pool_k[dst], k) and torch.equal(pool_v[dst], v)
    a.compress(s, Strategy(L, ((L - 2, L - 1),)), [3, 1] + [0] * (L - 2),
               MergeParams(retain=0.0, max_error=1.0))
    for l in (0, L - 1):        # unstored leading rows, then a merged layer
        pool_k.fill_(7.0)
        pool_v.fill_(7.0)
        stored = a.read_into(l, s, pool_k, pool_v, dst)
        k, v, want = a.read(l, s)
        assert torch.equal(stored, want)
        assert torch.equal(pool_k[dst[stored]], k[stored])
        assert torch.equal(pool_v[dst[stored]], v[stored])
        assert (pool_k[dst[~stored]] == 7).all()
