"""Sparse decode in the serving backend: per-request policy states and batched kernel calls.

One ``SparseDecoder`` per attention backend owns a selection policy
(``sgl_spec.sparse``) and the states of the requests it serves. It knows nothing of
sglang: the backend hands it plain lists and the KV pool's tensors. Per forward pass:

    plan_decode(rids, seq_lens, pool_rows)     once, before the layers (step())
    decode_layer(layer, q, k_buf, ...) -> rows per layer: writes the sparse rows of
                                               ``out``, returns the exact rows
or, for an extend pass (SnapKV only does work here):
    plan_extend(rids, seq_lens, extend_lens, pool_rows, final)
    prefill_layer(layer, q, k_buf, req_to_token) per layer, after its K/V are written

A row is exact (the caller runs its dense path) when the request has no state or
the policy returns a dense subset for it: history < ``min_context``, budget + sink +
window cover it, or the policy has not selected yet (LoopServe before step 16).
On a CPU, a dense row at a history the policy could sparsify (not ``use_exact``:
LoopServe's pre-selection steps) is attended here by ``kernels.sparse_decode.dense``:
the same full softmax through SDPA's fused kernel, ~5x faster than torch_native's
per-request call at a 7k history. The caller's exact path keeps every other dense row.
Rows whose policy says at plan time that no layer needs them
(``attends_layers``) skip ``decode_layer`` entirely, and a pass made only of such
rows is not ``planned``: the backend makes exact mode's call, at exact mode's cost.

State lifetime: a request's state is created on its first decode step (SnapKV: at
the end of its prefill, prompts >= ``min_context`` only), keyed by rid, and freed
by ``release(rid)``, which the backend wires to the radix cache's ``on_release``
(finished, aborted and retracted requests). Requests that leave without a release
(a tree cache other than sgl_spec's, a streaming session keeping its KV row) are
dropped once absent from ``stale_after`` forward passes; a dropped request that
comes back restarts its state (exact until its policy selects again). A request
whose history did not grow since its last step was re-prefilled: it restarts too.

Not thread-safe: the scheduler thread that runs the forward pass makes every call,
``release`` included. Tensors passed in are read, never kept, except ``out``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from sgl_spec.kernels.sparse_decode import IMPLS, sparse_decode
from sgl_spec.kernels.sparse_decode.dense import dense_decode
from sgl_spec.kernels.sparse_decode.torch_cached import (
    FixedKV,
    RecentIndex,
    gather_fixed,
    recent_index,
    sparse_decode_cached,
)
from sgl_spec.sparse import SelectionPolicy, Subset, pack_subsets
from sgl_spec.sparse.params import use_exact

logger = logging.getLogger(__name__)

# Forward passes a tracked request may be absent from before its state is dropped.
STALE_AFTER = 512
# "torch-cached": the sink + selection of each (request, layer) is gathered once per
# selection and kept (``kernels.sparse_decode.torch_cached``); each step reads only
# the recent window from the pool. The others run ``sparse_decode`` every step.
CACHED = "torch-cached"
DECODER_IMPLS = (CACHED, *IMPLS)


class Metrics(Protocol):
    """What the decoder reports to (``sgl_spec.attention.metrics.SparseMetrics``)."""

    def observe_step(self, exact: int, selected: Sequence[float]) -> None: ...
    def observe_reselections(self, n: int) -> None: ...
    def set_live_states(self, n: int) -> None: ...


@dataclass
class DecodeStats:
    """Cumulative counts of this decoder (a request-step: one row of one decode pass)."""

    sparse_steps: int = 0
    exact_steps: int = 0
    reselections: int = 0
    selected_tokens: float = 0.0  # attended positions summed over sparse request-steps
    stale_drops: int = 0


class _Row(NamedTuple):
    rid: str | None  # None: no policy state, decoded exactly
    seq_len: int  # history incl. the current token
    pool_row: int  # the request's req_to_token row
    reselect: bool  # decode_layer needs the layer's keys this step


class _PrefillRow(NamedTuple):
    rid: str
    seq_len: int
    pool_row: int
    q_start: int  # the observation queries: q[q_start:q_end] of the extend batch
    q_end: int


class SparseDecoder:
    def __init__(
        self,
        policy: SelectionPolicy,
        *,
        impl: str = CACHED,
        metrics: Metrics | None = None,
        stale_after: int = STALE_AFTER,
    ):
        if stale_after < 1:
            raise ValueError(f"stale_after must be >= 1, got {stale_after}")
        if impl not in DECODER_IMPLS:
            raise ValueError(f"impl {impl!r} is invalid; valid: {', '.join(DECODER_IMPLS)}")
        self.policy = policy
        self.params = policy.params
        self.impl = impl
        self.metrics = metrics
        self.stale_after = stale_after
        self.stats = DecodeStats()
        self._forward = 0  # forward passes planned
        self._last_seen: dict[str, int] = {}  # rid -> forward pass it was last in
        # impl "torch-cached": rid -> layer -> (the selection it was gathered for, K/V)
        self._fixed: dict[str, dict[int, tuple[torch.Tensor, FixedKV]]] = {}
        # (pass key, (sparse rows, their recent windows))
        self._recent: tuple[tuple, tuple[torch.Tensor, RecentIndex]] | None = None
        self._rows: list[_Row] = []
        self._attending = 0  # rows of _rows with a policy state that attends layers
        self._prefill: list[_PrefillRow] = []
        self._counted = True  # this pass's request-steps are in stats

    # ------------------------------------------------------------ lifetime

    @property
    def live_states(self) -> int:
        return len(self._last_seen)

    def release(self, rid: str) -> None:
        """Free the request's state (finished, aborted, retracted). Unknown rids are fine."""
        self._fixed.pop(rid, None)
        if self._last_seen.pop(rid, None) is not None:
            self.policy.release(rid)
            if self.metrics is not None:
                self.metrics.set_live_states(len(self._last_seen))

    def _start(self, rid: str, prompt_len: int) -> None:
        self.release(rid)
        self.policy.start(rid, prompt_len)
        self._last_seen[rid] = self._forward
        if self.metrics is not None:
            self.metrics.set_live_states(len(self._last_seen))

    def _drop_stale(self) -> None:
        if self._forward % 64:
            return  # sweeping every pass would cost O(live) for nothing
        cutoff = self._forward - self.stale_after
        stale = [rid for rid, seen in self._last_seen.items() if seen < cutoff]
        for rid in stale:
            self.release(rid)
        if stale:
            self.stats.stale_drops += len(stale)
            logger.info("sparse decode: dropped %d state(s) unseen for %d passes: %s",
                        len(stale), self.stale_after, stale[:4])

    def clear_plan(self) -> None:
        """A pass the decoder does not serve (idle, speculative): everything exact."""
        self._rows, self._prefill, self._attending = [], [], 0

    # ------------------------------------------------------------ decode

    @property
    def planned(self) -> bool:
        """Whether some decode row of the pass needs the layers (forward_decode goes
        through here); else the pass is exact mode's very call."""
        return self._attending > 0

    def plan_decode(
        self, rids: Sequence[str], seq_lens: Sequence[int], pool_rows: Sequence[int]
    ) -> None:
        """Advance every tracked request by one step; start states of new requests."""
        self._forward += 1
        self._prefill = []
        states = self.policy.states
        rows, reselections = [], 0
        for rid, n, row in zip(rids, seq_lens, pool_rows, strict=True):
            if rid in states and n <= states.get(rid).seq_len:
                self.release(rid)  # re-prefilled under the same rid: start over
            if rid not in states:
                if self.policy.needs_prefill_queries:
                    rows.append(_Row(None, n, row, False))  # its state is made at prefill
                    continue
                self._start(rid, max(1, n - 1))  # the prompt is what prefill wrote
            self._last_seen[rid] = self._forward
            reselect = self.policy.step(rid, n)
            reselections += reselect
            if not self.policy.attends_layers(rid):
                rows.append(_Row(None, n, row, False))  # dense, no per-layer work
                continue
            rows.append(_Row(rid, n, row, reselect))
        self._rows = rows
        self._attending = sum(r.rid is not None for r in rows)
        self._counted = self._attending == 0
        if self._counted:  # decode_layer will not run: count the pass here
            self._count(list(range(len(rows))), [], [])
        if reselections:
            self.stats.reselections += reselections
            if self.metrics is not None:
                self.metrics.observe_reselections(reselections)
        self._drop_stale()

    def decode_layer(
        self,
        layer: int,
        q: torch.Tensor,  # [B, Hq, D] this layer's queries, one row per planned request
        k_buf: torch.Tensor,  # [num_slots, Hkv, D] this layer's K pool (current token written)
        v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
        req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
        req_pool_indices: torch.Tensor,  # [B] int64, on q's device
        seq_lens: torch.Tensor,  # [B] int64, on q's device
        out: torch.Tensor,  # [B, Hq, Dv], q.dtype: its sparse rows are written
        scale: float,
    ) -> list[int]:  # ascending rows the caller must decode exactly
        """Sparse attention for the rows whose subset is sparse, in one batched call."""
        if q.shape[0] != len(self._rows):
            raise RuntimeError(
                f"decode batch of {q.shape[0]} rows does not match the plan of "
                f"{len(self._rows)}; was plan_decode() called for this pass?"
            )
        exact, full, sparse, subsets = [], [], [], []
        for b, r in enumerate(self._rows):
            if r.rid is None:
                exact.append(b)
                continue
            keys = None
            if r.reselect:
                slots = req_to_token[r.pool_row, : r.seq_len].long()
                keys = k_buf.index_select(0, slots)  # [seq_len, Hkv, D]
            sub = self.policy.decode_layer(r.rid, layer, q[b], keys)
            if sub.dense and self._dense_here(r, q):
                out[b] = dense_decode(q[b], k_buf, v_buf, req_to_token[r.pool_row, : r.seq_len],
                                      scale=scale)
                full.append(b)
            elif sub.dense:
                exact.append(b)
            else:
                sparse.append(b)
                subsets.append(sub)
        if sparse:
            if self.impl == CACHED:
                fixed = [self._fixed_kv(layer, b, sub, k_buf, v_buf, req_to_token)
                         for b, sub in zip(sparse, subsets)]
                idx, recent = self._recent_index(sparse, subsets, fixed, req_to_token,
                                                 req_pool_indices, seq_lens, k_buf.shape[1])
                out[idx] = sparse_decode_cached(q[idx], fixed, k_buf, v_buf, recent,
                                                scale=scale)
            else:
                idx = torch.tensor(sparse, device=q.device)
                packed = pack_subsets(subsets, k_buf.shape[1], q.device)
                out[idx] = sparse_decode(
                    q[idx], k_buf, v_buf, req_to_token, req_pool_indices[idx], seq_lens[idx],
                    *packed, sink=self.params.sink, scale=scale, impl=self.impl,
                )
        if not self._counted:  # the pass's first layer speaks for the request-step
            self._counted = True
            self._count(sorted(exact + full), sparse, subsets)
        return exact

    def _dense_here(self, r: _Row, q: torch.Tensor) -> bool:
        """Whether a dense row of a tracked request runs ``dense_decode`` here rather
        than the caller's exact path: on a CPU (where torch_native's per-request decode
        is SDPA's unfused path) and at a history the policy could sparsify. A row that
        ``use_exact`` keeps dense (below ``min_context``, or covered by budget + sink +
        window) keeps exact mode's call, its cost and its bits."""
        return q.device.type == "cpu" and not use_exact(r.seq_len, self.params)

    def _fixed_kv(self, layer: int, b: int, sub: Subset, k_buf, v_buf, req_to_token) -> FixedKV:
        """Row b's sink + selection in this layer, gathered again only when the policy
        hands out a new selection (a policy returns the same tensor until it reselects)."""
        r = self._rows[b]
        sink_end = min(self.params.sink, r.seq_len)
        per_layer = self._fixed.setdefault(r.rid, {})
        hit = per_layer.get(layer)
        if hit is None or hit[0] is not sub.sel_idx or hit[1].sink_end != sink_end:
            fixed = gather_fixed(k_buf, v_buf, req_to_token[r.pool_row], sub.sel_idx, None,
                                 sink_end)
            hit = per_layer[layer] = (sub.sel_idx, fixed)
        return hit[1]

    def _recent_index(self, sparse, subsets, fixed, req_to_token, req_pool_indices, seq_lens,
                      num_kv_heads) -> tuple[torch.Tensor, RecentIndex]:
        """The sparse rows' index and their recent windows, built at the pass's first
        sparse layer and reused by the others (the same rows with the same windows,
        which is the rule)."""
        key = (self._forward, tuple(sparse), tuple(s.recent_start for s in subsets),
               tuple(f.sink_end for f in fixed))
        if self._recent is None or self._recent[0] != key:
            dev = req_pool_indices.device
            idx = torch.tensor(sparse, device=dev)
            index = recent_index(
                req_to_token, req_pool_indices[idx], seq_lens[idx],
                torch.tensor(key[2], device=dev), torch.tensor(key[3], device=dev),
                num_kv_heads,
            )
            self._recent = (key, (idx, index))
        return self._recent[1]

    def _count(self, exact: list[int], sparse: list[int], subsets: list[Subset]) -> None:
        selected = []
        for b, sub in zip(sparse, subsets):
            n = self._rows[b].seq_len
            sink_end = min(self.params.sink, n)
            recent = n - max(sub.recent_start, sink_end)
            selected.append(sink_end + sub.sel_idx.shape[1] + recent)
        self.stats.exact_steps += len(exact)
        self.stats.sparse_steps += len(sparse)
        self.stats.selected_tokens += sum(selected)
        if self.metrics is not None:
            self.metrics.observe_step(len(exact), selected)

    # ------------------------------------------------------------ prefill (SnapKV)

    @property
    def prefill_planned(self) -> bool:
        return bool(self._prefill)

    def plan_extend(
        self,
        rids: Sequence[str],
        seq_lens: Sequence[int],  # prefix + this pass's tokens
        extend_lens: Sequence[int],  # this pass's tokens per request
        pool_rows: Sequence[int],
        final: bool = True,  # some request's prompt ends in this pass
    ) -> None:
        """Start the states of policies that score the prompt (SnapKV).

        A chunked prompt is scored at each chunk of a pass that ends some prompt; the
        last chunk's scoring wins (sglang does not say which request's prompt ends).
        Rows of a mixed batch that are decoding (one token, state already stepping)
        keep their state and attend exactly in this pass.
        """
        self._forward += 1
        self._rows, self._prefill, self._attending = [], [], 0
        states = self.policy.states
        q_end = 0
        for rid, n, e, row in zip(rids, seq_lens, extend_lens, pool_rows, strict=True):
            q_start, q_end = q_end, q_end + e
            if rid in states:
                self._last_seen[rid] = self._forward
                if e == 1 and states.get(rid).step >= 0:
                    continue  # a decoding row of a mixed batch
            if (
                final
                and self.policy.needs_prefill_queries
                and n >= self.params.min_context
            ):
                self._start(rid, n)
                w = min(e, self.params.window)
                self._prefill.append(_PrefillRow(rid, n, row, q_end - w, q_end))
        self._drop_stale()

    def prefill_layer(
        self,
        layer: int,
        q: torch.Tensor,  # [num_tokens, Hq, D] this pass's queries of the layer
        k_buf: torch.Tensor,  # [num_slots, Hkv, D] this layer's K pool (pass written)
        req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    ) -> None:
        for r in self._prefill:
            keys = k_buf.index_select(0, req_to_token[r.pool_row, : r.seq_len].long())
            self.policy.prefill_layer(r.rid, layer, q[r.q_start : r.q_end], keys)
