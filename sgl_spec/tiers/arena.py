"""Host rows shared by every layer, with logical token slots mapped onto them.

A stock host slot holds one token's K and V at every layer, so a compressed payload
saves nothing unless slots stop owning their rows. Here a slot owns, per layer, one
of: its own row (``map >= 0``), nothing (``UNSTORED``: recomputed on restore), or a
share of a merged pair's direction row (``map = -2 - row``, with its own magnitudes).
Rows come from one arena for all layers, so a row freed at any layer serves any other.
A row is stored through a codec (``krul.codec``: the pool's dtype, or int8 with scales),
so the arena holds ``budget / codec row bytes`` rows.

``alloc(n)`` reserves n slots *and* n * L rows (a backup never fails halfway);
``available()`` is in full-size tokens, so callers that count tokens stay correct.
Not thread-safe: the host pool that owns it takes its lock. CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from sgl_spec.tiers.free_list import FreeList

from sgl_spec.krul.codec import codec_class
from sgl_spec.krul.merge import MergeParams, merge, pair_retained, reconstruction_error
from sgl_spec.krul.select import Strategy

UNSTORED = -1
_FREE = -1 << 30          # a free slot's map entries (never read)


def merged_code(row: torch.Tensor) -> torch.Tensor:
    return -2 - row


@dataclass(frozen=True)
class Compressed:
    """What ``Arena.compress`` did to a run of slots."""

    rows_freed: int
    tokens_merged: int      # (token, pair)s whose direction is shared
    tokens_retained: int    # (token, pair)s kept unmerged as too distinct
    pairs_skipped: int = 0  # pairs left exact: merging them erred over params.max_error


class Arena:
    """Rows: ``store`` (k, v [num_rows, H, D] in the codec's form); magnitudes
    [num_mags, 2 (K/V), H] in ``dtype``; maps [L, slots]."""

    def __init__(self, num_slots: int, num_layers: int, num_rows: int, num_heads: int,
                 head_dim: int, dtype: torch.dtype, num_mags: int | None = None,
                 codec: str = "full"):
        self.L, self.H, self.D, self.dtype = num_layers, num_heads, head_dim, dtype
        self.store = codec_class(codec)(num_rows, num_heads, head_dim, dtype)
        self.k, self.v = self.store.k, self.store.v  # the stored data, as encoded
        num_mags = num_rows if num_mags is None else num_mags
        self.mag = torch.empty(num_mags, 2, num_heads, dtype=dtype)
        self.map = torch.full((num_layers, num_slots), _FREE, dtype=torch.int64)
        self.mag_of = torch.full((num_layers, num_slots), -1, dtype=torch.int64)
        self.slots, self.rows, self.mags = FreeList(num_slots), FreeList(num_rows), FreeList(num_mags)
        self.damaged = torch.zeros(num_slots, dtype=torch.bool)  # a storage page failed its sum

    @staticmethod
    def bytes_for(num_slots: int, num_layers: int, num_rows: int, num_heads: int,
                  head_dim: int, itemsize: int, num_mags: int | None = None,
                  row_bytes: int | None = None) -> int:
        """Memory the arena takes (rows, magnitudes, maps and free lists); ``row_bytes``:
        the codec's bytes per row (default: the pool's dtype, ``itemsize``)."""
        num_mags = num_rows if num_mags is None else num_mags
        row_bytes = 2 * num_heads * head_dim * itemsize if row_bytes is None else row_bytes
        return (num_rows * row_bytes + num_mags * 2 * num_heads * itemsize
                + 2 * num_layers * num_slots * 8 + (num_slots + num_rows + num_mags) * 9)

    @property
    def row_bytes(self) -> int:
        """One token's K and V at one layer, as stored."""
        return self.store.row_bytes

    @classmethod
    def rows_for_budget(cls, budget: int, num_slots: int, num_layers: int, num_heads: int,
                        head_dim: int, dtype: torch.dtype, codec: str = "full") -> int:
        """The most rows whose arena (with ``num_slots`` slots) fits in ``budget`` bytes."""
        row_bytes = codec_class(codec).row_bytes_for(num_heads, head_dim, dtype)
        fixed = cls.bytes_for(num_slots, num_layers, 0, num_heads, head_dim, dtype.itemsize, 0)
        per_row = cls.bytes_for(0, 0, 1, num_heads, head_dim, dtype.itemsize, 1, row_bytes)
        return max(0, (budget - fixed) // per_row)

    def clear(self) -> None:
        """Free everything (sglang's cache reset)."""
        S, R, M = self.map.shape[1], self.k.shape[0], self.mag.shape[0]
        self.map.fill_(_FREE)
        self.mag_of.fill_(-1)
        self.damaged.fill_(False)
        self.slots, self.rows, self.mags = FreeList(S), FreeList(R), FreeList(M)

    def available(self) -> int:
        """Tokens that can still be allocated at full size."""
        return min(self.slots.count, self.rows.count // self.L)

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots, each with its own row at every layer; None if they do not fit."""
        if n > self.available():
            return None
        slots = self.slots.pop(n)
        self.map[:, slots] = self.rows.pop(n * self.L).view(self.L, n)
        self.mag_of[:, slots] = -1
        self.damaged[slots] = False
        return slots

    def free(self, slots: torch.Tensor) -> int:
        """Release the slots and every row and magnitude they hold; returns len(slots)."""
        slots = slots.cpu().long()
        if not slots.numel():
            return 0
        if not self.slots.used[slots].all():
            raise RuntimeError(f"double free of slots {slots[~self.slots.used[slots]].tolist()[:8]}")
        m = self.map[:, slots]
        own = m[m >= 0]
        direction = merged_code(m[m <= -2])
        self.rows.push(torch.cat([own, direction.unique()]))
        self.mags.push(self.mag_of[:, slots][self.mag_of[:, slots] >= 0])
        self.map[:, slots] = _FREE
        self.mag_of[:, slots] = -1
        self.damaged[slots] = False
        self.slots.push(slots)
        return slots.numel()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's K/V ([n, H, D]) in the slots' own rows (a backup)."""
        rows = self.map[layer, slots.cpu().long()]
        if (rows < 0).any():
            raise RuntimeError(f"layer {layer}: slots without their own row cannot be written")
        self.store.put(rows, k, v)

    def read(self, layer: int, slots: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's K/V of the slots: ([n, H, D], [n, H, D], stored [n] bool).
        Merged entries are direction x this layer's magnitude; unstored ones are zero
        (the restore recomputes them)."""
        m = self.map[layer, slots.cpu().long()]
        own = m >= 0
        if bool(own.all()):  # the usual restore: every row the slot's own, none merged
            k, v = self.store.get(m)
            return k, v, own
        n = m.numel()
        k = torch.zeros(n, self.H, self.D, dtype=self.dtype)
        v = torch.zeros_like(k)
        k[own], v[own] = self.store.get(m[own])
        mer = m <= -2
        if mer.any():
            dk, dv = self.store.get(merged_code(m[mer]))
            mags = self.mag[self.mag_of[layer, slots.cpu().long()][mer]]        # [r, 2, H]
            k[mer] = (dk.float() * mags[:, 0, :, None].float()).to(self.dtype)
            v[mer] = (dv.float() * mags[:, 1, :, None].float()).to(self.dtype)
        return k, v, m != UNSTORED

    def read_into(self, layer: int, slots: torch.Tensor, k_out: torch.Tensor,
                  v_out: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """``read``, written straight into the pool rows ``dst`` ([n], on k_out's device);
        unstored rows are left as they are. Returns the stored mask [n] bool."""
        m = self.map[layer, slots.cpu().long()]
        if bool((m >= 0).all()):  # the usual restore: one pass from codes to pool rows
            self.store.get_into(m, k_out, v_out, dst)
            return torch.ones(m.numel(), dtype=torch.bool)
        k, v, stored = self.read(layer, slots)
        at = stored.to(dst.device)
        k_out[dst[at]] = k[stored].to(k_out.device, k_out.dtype)
        v_out[dst[at]] = v[stored].to(v_out.device, v_out.dtype)
        return stored

    def compress(self, slots: torch.Tensor, strategy: Strategy, unstored: Sequence[int],
                 params: MergeParams = MergeParams()) -> Compressed:
        """Compress a run of uncompressed slots (in token order) in place.

        Layer l drops the rows of its first ``unstored[l]`` slots (non-increasing, the
        restore pyramid); each pair (i, j) merges the slots both layers still store,
        except the ``params.retain`` most distinct; a pair whose merge would err by
        more than ``params.max_error`` (relative L2, K or V) is left exact. Freed rows
        return to the arena at once: the full copy is never kept beside the compressed
        one."""
        slots = slots.cpu().long()
        n = slots.numel()
        if strategy.num_layers != self.L or len(unstored) != self.L:
            raise ValueError(f"strategy for {strategy.num_layers} layers and {len(unstored)} "
                             f"unstored lengths; this arena has {self.L} layers")
        if any(a < b for a, b in zip(unstored, unstored[1:])):
            raise ValueError(f"unstored lengths must be non-increasing, got {list(unstored)}")
        m = self.map[:, slots]
        if (m < 0).any():
            raise RuntimeError("compress needs slots that own a row at every layer")
        freed = merged = retained = skipped = 0
        for layer, u in enumerate(unstored):
            u = min(u, n)
            if u:
                self.rows.push(m[layer, :u].clone())
                self.map[layer, slots[:u]] = UNSTORED
                freed += u
        for i, j in strategy.pairs:
            start = min(max(unstored[i], unstored[j]), n)
            if start >= n:
                continue
            s = slots[start:]
            if not self._sample_alike(i, j, s, params):
                skipped += 1
                continue
            ri, rj = self.map[i, s], self.map[j, s]
            (ki, vi), (kj, vj) = self.store.get(ri), self.store.get(rj)
            keep = pair_retained(ki, kj, vi, vj, params.retain)
            go = ~keep
            if not go.any():
                continue
            ri, rj, sg = ri[go], rj[go], s[go]
            ki, vi, kj, vj = ki[go], vi[go], kj[go], vj[go]
            none = torch.zeros(len(ri), dtype=torch.bool)
            km, vm = merge(ki, kj, params, none), merge(vi, vj, params, none)
            err = max(reconstruction_error(km, ki, kj), reconstruction_error(vm, vi, vj))
            if err > params.max_error:   # the pair's KV are not alike: it stays exact
                skipped += 1
                continue
            mags = self.mags.pop(2 * len(ri))
            if mags is None:
                raise RuntimeError("arena out of magnitude entries")
            mi, mj = mags.view(2, -1)
            self.store.put(ri, km.direction, vm.direction)
            self.mag[mi, 0], self.mag[mi, 1] = km.mag_i, vm.mag_i
            self.mag[mj, 0], self.mag[mj, 1] = km.mag_j, vm.mag_j
            self.map[i, sg] = self.map[j, sg] = merged_code(ri)
            self.mag_of[i, sg], self.mag_of[j, sg] = mi, mj
            self.rows.push(rj)
            freed += len(rj)
            merged += len(ri)
            retained += int(keep.sum())
        return Compressed(freed, merged, retained, skipped)

    SAMPLE = 64

    def _sample_alike(self, i: int, j: int, s: torch.Tensor, params: MergeParams) -> bool:
        """Whether layers i and j merge within ``params.max_error`` on an even sample of
        ``SAMPLE`` of the tokens: unlike pairs (all of these models', design §11) are
        rejected without merging every token, off the next request's critical path."""
        if len(s) <= 2 * self.SAMPLE:
            return True
        pick = s[torch.linspace(0, len(s) - 1, self.SAMPLE).long()]
        (ki, vi), (kj, vj) = self.store.get(self.map[i, pick]), self.store.get(self.map[j, pick])
        none = torch.zeros(len(pick), dtype=torch.bool)
        km, vm = merge(ki, kj, params, none), merge(vi, vj, params, none)
        return max(reconstruction_error(km, ki, kj),
                   reconstruction_error(vm, vi, vj)) <= params.max_error

    def stored_bytes(self, slots: torch.Tensor) -> int:
        """Bytes the slots hold: own rows, each shared direction once, magnitudes."""
        m = self.map[:, slots.cpu().long()]
        rows = int((m >= 0).sum()) + merged_code(m[m <= -2]).unique().numel()
        mags = int((self.mag_of[:, slots.cpu().long()] >= 0).sum())
        return rows * self.row_bytes + mags * 2 * self.H * self.mag.element_size()

    def full_bytes(self, n: int) -> int:
        """What n tokens take in a stock host pool (every layer, K and V)."""
        return n * self.L * 2 * self.H * self.D * self.dtype.itemsize

    # --- storage pages (an L3 backend such as sglang's ``file``) ---------------------------
    def page_bytes(self, n: int) -> int:
        """A page of n slots as ``export`` writes it: every layer's rows, a bitmask of the
        unstored ones, then a checksum."""
        return n * self.L * self.row_bytes + -(-n * self.L // 8) + 8

    def export(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots' rows at every layer (layer-major) as stored, merged entries re-encoded
        whole and unstored ones zero, the bitmask of the unstored, then an xxh3_64 of
        those bytes: a fixed-size flat uint8 page."""
        slots = slots.cpu().long()
        m = self.map[:, slots]
        gone = m == UNSTORED
        if bool((m >= 0).all()):
            body = self.store.row_bytes_of(m.reshape(-1))
        else:
            parts = []
            for layer in range(self.L):
                if bool((m[layer] >= 0).all()):
                    parts.append(self.store.row_bytes_of(m[layer]))
                    continue
                k, v, _ = self.read(layer, slots)
                scratch = type(self.store)(len(slots), self.H, self.D, self.dtype)
                idx = torch.arange(len(slots))
                scratch.put(idx, k, v)
                rows = scratch.row_bytes_of(idx)
                rows[gone[layer]] = 0
                parts.append(rows)
            body = torch.cat(parts)
        mask = torch.from_numpy(np.packbits(gone.reshape(-1).numpy()))
        body = torch.cat([body.reshape(-1), mask])
        digest = xxhash.xxh3_64_digest(body.numpy().tobytes())
        return torch.cat([body, torch.frombuffer(bytearray(digest), dtype=torch.uint8)])

    def load(self, slots: torch.Tensor, page: torch.Tensor) -> bool:
        """Inverse of ``export`` into freshly allocated slots (the rows of unstored
        entries go back to the arena); False (and the slots marked ``damaged``, so a
        load refuses them) when the checksum fails."""
        slots = slots.cpu().long()
        page = page.reshape(-1).view(torch.uint8)
        n = len(slots)
        if page.numel() != self.page_bytes(n):
            raise ValueError(f"a page of {page.numel()} bytes for {n} slots; "
                             f"expected {self.page_bytes(n)}")
        body = page[:-8]
        ok = xxhash.xxh3_64_digest(body.numpy().tobytes()) == page[-8:].numpy().tobytes()
        rows_end = n * self.L * self.row_bytes
        m = self.map[:, slots]
        self.store.put_row_bytes(m.reshape(-1), body[:rows_end].view(-1, self.row_bytes))
        bits = np.unpackbits(body[rows_end:].numpy(), count=n * self.L)
        gone = torch.from_numpy(bits.astype(bool)).view(self.L, n)
        if ok and bool(gone.any()):
            self.rows.push(m[gone].clone())
            layer_idx, tok = gone.nonzero(as_tuple=True)
            self.map[layer_idx, slots[tok]] = UNSTORED
        self.damaged[slots] = not ok
        return ok

    def checksum(self, slots: torch.Tensor) -> int:
        """xxh3_64 of what the slots store, in token and layer order (row numbers do
        not enter it: the same content anywhere in the arena sums the same).

        A restore verifies this before it loads, so it must cost little next to the
        load: runs of consecutive rows (what ``alloc`` hands out) are hashed in place,
        without the gather and copy a fragmented set needs (``checksum_ref``)."""
        slots = slots.cpu().long()
        m, mag_of = self.map[:, slots].numpy(), self.mag_of[:, slots].numpy()
        bufs, mags = self.store.byte_views(), self.mag.view(torch.uint8).numpy()
        h = xxhash.xxh3_64()
        for layer in range(self.L):
            ml = m[layer]
            h.update(np.where(ml >= 0, 0, np.where(ml == UNSTORED, 1, 2)).astype(np.int8))
            _hash_rows(h, bufs, ml[ml >= 0])
            mer = ml <= -2
            if mer.any():
                _hash_rows(h, bufs, -2 - ml[mer])
                h.update(mags[mag_of[layer][mer]])
        return h.intdigest()

    def checksum_ref(self, slots: torch.Tensor) -> int:
        """``checksum`` by gathering every row first (its reference in the tests)."""
        slots = slots.cpu().long()
        h = xxhash.xxh3_64()
        for layer in range(self.L):
            m = self.map[layer, slots]
            kind = torch.where(m >= 0, 0, torch.where(m == UNSTORED, 1, 2)).to(torch.int8)
            h.update(kind.numpy().tobytes())
            for t in self.store.raw(m[m >= 0]):
                h.update(t.view(torch.uint8).numpy().tobytes())
            mer = m <= -2
            if mer.any():
                for t in self.store.raw(merged_code(m[mer])):
                    h.update(t.view(torch.uint8).numpy().tobytes())
                h.update(self.mag[self.mag_of[layer, slots][mer]].view(torch.uint8).numpy().tobytes())
        return h.intdigest()


def _hash_rows(h, bufs: Sequence[np.ndarray], rows: np.ndarray) -> None:
    """``h.update`` with each buffer's bytes of ``rows`` in order (buffer by buffer);
    consecutive rows are read in place, a fragmented set through one gather."""
    if rows.size == 0:
        return
    cut = np.flatnonzero(np.diff(rows) != 1) + 1
    if cut.size > rows.size // 16:  # many short runs: one gather per buffer costs less
        for b in bufs:
            h.update(b[rows])
        return
    first = rows[np.concatenate(([0], cut))]
    end = rows[np.concatenate((cut - 1, [rows.size - 1]))] + 1
    runs = list(zip(first.tolist(), end.tolist()))
    for b in bufs:
        for lo, hi in runs:
            h.update(b[lo:hi])


def evict_for_bytes(available, evict, need: int, max_rounds: int = 64) -> int:
    """Evict host nodes until ``need`` more full-size tokens are free (byte-driven).

    sglang's ``evict_host(n)`` counts the tokens of the nodes it evicts; a compressed node
    frees fewer bytes than its tokens take at full size, so one call can report ``n``
    evicted while the arena still cannot take n tokens. ``available()`` is the arena's
    free room in full-size tokens, ``evict(k)`` sglang's eviction (tokens evicted; 0 when
    nothing is left). Returns the full-size tokens freed."""
    before = available()
    want = before + need
    for _ in range(max_rounds):
        short = want - available()
        if short <= 0 or evict(short) == 0:
            break
    return available() - before
