"""The retrieval head inside a server: its per-token state in the KV pool, per pass.

SpeContext Sec 4.3 / 5: the head runs *before* each target step and keeps a full K
cache of its own. Here that cache lives in the target's KV pool, as one extra layer
(``HeadStore``): for every token slot, the pool's K buffer of that layer holds the
head's roped key and its V buffer the hidden part ``kh`` the *next* position's key
needs. Whatever the radix cache does with a slot's KV (share it with the next turn,
free it, evict it, write it back to the host tier and load it again) it does with
the head's state too, so a follow-up turn over a cached prefix computes head keys for
its new tokens only. ``qh`` (the hidden part of the next query) is kept per
request-pool row: a row is reused only by a request that runs an extend first.

Per forward pass (``AttentionCore.plan`` calls ``begin_pass``; the integration's
layer hooks call ``capture`` with the target's residual stream entering each aux
layer, in order): after the last capture the pass's tokens get ``kh``, their keys and
each request's last ``qh``. Before a decode pass ``select`` scores the history with
the new tokens' queries and returns each sparse row's top-B positions per KV head,
one selection for every layer.

Not thread-safe: the scheduler thread that runs the forward pass owns it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from sgl_spec.attention.batch import BatchView
from sgl_spec.kernels.sparse_decode import head_logits
from sgl_spec.sparse.scoring import select_topk

from .model import RetrievalHead


class HeadStore(NamedTuple):
    """Where the head's per-token state lives (tensors of the target's KV pool)."""

    buffers: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # -> (keys, kh) [slots, Hkv, D]
    embed: torch.Tensor | None  # [V, H] the target's input embedding (head without one)


class _Pass(NamedTuple):
    ids: torch.Tensor  # [T] the pass's tokens
    positions: torch.Tensor  # [T] int64
    loc: torch.Tensor  # [T] int64 their pool slots
    first: torch.Tensor  # [B] int64 index of each request's first token in the pass
    prev_slot: torch.Tensor  # [B] int64 slot of the position before it (-1: position 0)
    last: torch.Tensor  # [B] int64 index of each request's last token
    rows: torch.Tensor  # [B] int64 request-pool rows


class HeadRuntime:
    def __init__(self, head: RetrievalHead, store: HeadStore, device: torch.device | str):
        self.head = head
        self.store = store
        self.device = torch.device(device)
        self.aux_count = head.n_aux
        self._qh: torch.Tensor | None = None  # [max_reqs, Hq*D] fp32 by request-pool row
        self._pass: _Pass | None = None
        self._acc: torch.Tensor | None = None
        self._seen = 0

    # ------------------------------------------------------------ per pass

    def begin_pass(self, batch: BatchView) -> None:
        """Record the pass's token layout (decode or extend); ``capture`` then fills it."""
        self._pass, self._acc, self._seen = None, None, 0
        if batch.mode not in ("decode", "extend") or batch.input_ids is None:
            return
        if self._qh is None:
            hq, d = self.head.cfg.num_q_heads, self.head.cfg.head_dim
            self._qh = torch.zeros(batch.req_to_token.shape[0], hq * d, device=self.device)
        new = batch.extend_lens if batch.mode == "extend" else (1,) * batch.size
        starts = [s - e for s, e in zip(batch.seq_lens, new)]
        dev = self.device
        cum = torch.tensor([0, *new], device=dev).cumsum(0)
        positions = torch.cat([torch.arange(s, s + e, device=dev) for s, e in zip(starts, new)])
        prev = torch.tensor(starts, device=dev) - 1
        prev_slot = torch.where(
            prev >= 0, batch.req_to_token[batch.rows, prev.clamp(min=0)].long(), -1)
        self._pass = _Pass(batch.input_ids, positions, batch.out_cache_loc.long(), cum[:-1],
                           prev_slot, cum[1:] - 1, batch.rows)

    def capture(self, index: int, hidden: torch.Tensor) -> None:
        """The target's residual stream entering aux layer ``index`` (0-based, in
        order): [T, Ht]. After the last one the pass's head state is written."""
        if self._pass is None or index != self._seen:
            return  # a pass begin_pass did not describe (idle, speculative, dummy)
        part = self.head.aux_part(index, hidden)
        self._acc = part if self._acc is None else self._acc + part
        self._seen += 1
        if self._seen == self.aux_count:
            self._finish()

    def _finish(self) -> None:
        p, acc = self._pass, self._acc
        self._pass, self._acc = None, None
        c = self.head.context(acc)
        kh = self.head.key_hidden(c)
        keys_buf, kh_buf = self.store.buffers()
        hkv, d = self.head.cfg.num_kv_heads, self.head.cfg.head_dim
        # Hidden part of each key: the previous token's kh (in the pass, or in the pool
        # for a request's first new token over a cached prefix; zero at position 0).
        prev = torch.zeros_like(kh)
        prev[1:] = kh[:-1]
        has = p.prev_slot >= 0
        first_prev = torch.zeros(p.first.shape[0], hkv * d, device=kh.device)
        if bool(has.any()):
            first_prev[has] = kh_buf.index_select(0, p.prev_slot[has]).view(-1, hkv * d).float()
        prev[p.first] = first_prev
        keys = self.head.keys(p.ids, p.positions, prev, self.store.embed)
        kh_buf.index_copy_(0, p.loc, kh.view(-1, hkv, d).to(kh_buf.dtype))
        keys_buf.index_copy_(0, p.loc, keys.to(keys_buf.dtype))
        self._qh.index_copy_(0, p.rows, self.head.query_hidden(c.index_select(0, p.last)))

    # ------------------------------------------------------------ selection

    def select(
        self,
        batch: BatchView,  # a decode pass
        idx: list[int],  # its rows that attend a selection
        budget: int,
        sink: int,
        window: int,
    ) -> torch.Tensor:  # [R, Hkv, budget] int64 positions, ascending
        """Score each row's history with the head's query for the token about to be
        decoded; top-``budget`` of ``[sink, seq_len - window)`` per KV head."""
        dev = self.device
        b = torch.tensor(idx, dtype=torch.int64, device=dev)
        seq = batch.seq_lens_t.index_select(0, b)  # history incl. the current token
        hist = seq - 1  # keys the head has: positions [0, hist)
        rows = batch.rows.index_select(0, b)
        q = self.head.queries(batch.input_ids.index_select(0, b), hist,
                              self._qh.index_select(0, rows), self.store.embed)
        keys_buf, _ = self.store.buffers()
        n = int(hist.max())
        # CPU: the keys are scored in place by the C++ kernel (a tiny-M bmm over gathered
        # keys costs several times as much).
        logits = head_logits(q * self.head.scale, keys_buf, batch.req_to_token, rows, hist, n)
        if logits is not None:
            scores = self.head.group_max(logits)
        else:
            pos = torch.arange(n, device=dev)[None, :].minimum(hist[:, None] - 1)
            slots = batch.req_to_token[rows[:, None], pos].long()  # [R, n]
            k = keys_buf.index_select(0, slots.view(-1)).view(len(idx), n, *keys_buf.shape[1:])
            scores = self.head.scores(q, k, hist)
        lo = torch.full_like(seq, sink)
        return select_topk(scores, budget, lo.minimum(seq), seq - window)
