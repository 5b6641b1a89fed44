"""Lines of earlier extends, kept for the next turn's selection (LoopServe §5.2 reuse).

A turn's sparse extend selects vertical/slash lines per layer. When the next turn
(or the next chunk of a chunked prefill) of the same conversation arrives, its
cached prefix *is* that turn's sequence: the radix cache hands the new request the
very KV slots the earlier turn wrote. The store therefore keys an entry by the
sequence it was selected on, identified by

* the KV-pool slot ids of its tokens ``0 .. end-1`` (what the radix cache shares), and
* the bytes of the last ``check_tokens`` rows of one layer's key cache
  (``fingerprint_layer``), so that a freed and reallocated slot sequence holding a
  different text does not match: a key row depends on the token and its position.

A lookup for a request with ``prefix_len`` cached tokens returns the entry with
the longest ``end <= prefix_len`` whose fingerprint equals that of the request's
own first ``end`` slots. Entries are bucketed by their first slot id, so a lookup
hashes at most ``max_probe`` candidate prefixes. A stale match would only cost
selection quality, never correctness: seeds are candidates that must still pass
the selection's mass filter (``sgl_spec.kernels.vslash.select``).

Not thread-safe: the scheduler thread that runs the forward pass makes every call.
Bounded: at most ``capacity`` entries, least recently used dropped first; nothing
is kept per request, so finished requests need no release.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import NamedTuple

import torch

from sgl_spec.kernels.vslash import LineSet

# The layer whose key rows check a fingerprint; written before any other layer runs.
FINGERPRINT_LAYER = 0


class Fingerprint(NamedTuple):
    first_slot: int  # bucket
    end: int  # tokens covered
    digest: bytes


def fingerprint(
    slots: torch.Tensor,  # [>= end] int32/int64 KV-pool slot ids of the sequence, CPU
    end: int,
    key_cache: torch.Tensor,  # [pool_size, Hkv, D] FINGERPRINT_LAYER's key buffer
    check_tokens: int = 4,
) -> Fingerprint:
    """The identity of the sequence's first ``end`` tokens (module docstring)."""
    if end < 1 or slots.numel() < end:
        raise ValueError(f"end ({end}) must be in [1, {slots.numel()}] (slots given)")
    head = slots[:end].to(torch.int64).cpu().contiguous()
    h = hashlib.blake2b(head.numpy().tobytes(), digest_size=16)
    rows = key_cache[head[max(0, end - check_tokens) :].to(key_cache.device)]
    h.update(rows.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return Fingerprint(int(head[0]), end, h.digest())


class LineStore:
    """Fingerprint -> per-layer :class:`LineSet` of one extend; bounded LRU."""

    def __init__(self, capacity: int = 256, max_probe: int = 8):
        if capacity < 1 or max_probe < 1:
            raise ValueError(f"capacity ({capacity}) and max_probe ({max_probe}) must be >= 1")
        self.capacity = capacity
        self.max_probe = max_probe
        self._entries: OrderedDict[Fingerprint, dict[int, LineSet]] = OrderedDict()
        self._buckets: dict[int, list[Fingerprint]] = {}  # first slot -> entries, newest last
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        """Bytes held by the stored line tensors."""
        return sum(
            t.numel() * t.element_size()
            for layers in self._entries.values()
            for ls in layers.values()
            for t in (*ls.vertical, *ls.slash)
        )

    def put(self, fp: Fingerprint, layers: dict[int, LineSet]) -> None:
        """Keep ``layers`` (layer id -> lines; the store owns them) under ``fp``."""
        if fp in self._entries:
            self._entries.move_to_end(fp)
        else:
            self._buckets.setdefault(fp.first_slot, []).append(fp)
        self._entries[fp] = layers
        while len(self._entries) > self.capacity:
            old, _ = self._entries.popitem(last=False)
            self._unbucket(old)

    def lookup(
        self,
        slots: torch.Tensor,  # [>= prefix_len] slot ids of the request's sequence, CPU
        prefix_len: int,
        key_cache: torch.Tensor,  # FINGERPRINT_LAYER's key buffer
    ) -> dict[int, LineSet] | None:
        """The lines of the longest stored sequence that the request's prefix extends."""
        if prefix_len < 1:
            return None
        bucket = self._buckets.get(int(slots[0]), [])
        candidates = sorted((fp for fp in bucket if fp.end <= prefix_len),
                            key=lambda fp: fp.end, reverse=True)[: self.max_probe]
        checked: dict[int, bytes] = {}
        for fp in candidates:
            if fp.end not in checked:
                checked[fp.end] = fingerprint(slots, fp.end, key_cache).digest
            if checked[fp.end] == fp.digest:
                self._entries.move_to_end(fp)
                self.hits += 1
                return self._entries[fp]
        self.misses += 1
        return None

    def clear(self) -> None:
        self._entries.clear()
        self._buckets.clear()

    def _unbucket(self, fp: Fingerprint) -> None:
        bucket = self._buckets.get(fp.first_slot)
        if bucket is not None:
            bucket.remove(fp)
            if not bucket:
                del self._buckets[fp.first_slot]
