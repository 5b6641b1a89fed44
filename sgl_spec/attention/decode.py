"""Decode attention as plan/run: one plan per forward pass, one kernel call per layer.

``Decoder.plan(batch)`` runs once per pass, before the layers. It steps each request's
selection policy (host side, ``sgl_spec.sparse``) and packs the pass into device index
tensors: the ``DecodeSubsets`` every layer attends (exact rows: their whole history;
sparse rows: sink + selection + recent window), and the rows whose queries the policy
keeps or whose selection it renews. ``Decoder.run(plan, layer, ...)`` per layer makes
at most three batched policy calls (observe, reselect, selection) and one kernel call
for all rows: no Python loop over requests in the layers.

Exact mode is a decoder without a policy: every row attends its whole history through
the same kernel (the C++ CPU kernel where it builds, else SDPA's fused kernel).

State lifetime: a request's policy state is created on its first decode step (SnapKV:
at the end of its prefill, prompts >= ``min_context`` only), keyed by rid, and freed by
``release(rid)``, which the integration wires to the radix cache's releases (finished,
aborted and retracted requests). Requests that leave without a release (a tree cache
other than sgl_spec's, a streaming session keeping its KV row) are dropped once absent
from ``stale_after`` forward passes; a dropped request that comes back restarts its
state. A request whose history did not grow since its last step was re-prefilled: it
restarts too.

Not thread-safe: the scheduler thread that runs the forward pass makes every call.
Tensors passed in are read, never kept, except ``out``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from sgl_spec.kernels.sparse_decode import (
    IMPLS,
    DecodeSubsets,
    default_impl,
    dense_subsets,
    sparse_decode,
    take_rows,
)
from sgl_spec.sparse.policy import (
    EXACT_STEP,
    AttnShape,
    Kind,
    ReselectBatch,
    RowStep,
    SelectionPolicy,
)

from sgl_spec.sparse.elastic import ElasticPass
from sgl_spec.sparse.scoring import Scratch

from .batch import BatchView
from .prefetch import get_prefetcher

# The sparse-decode kernel of a staging policy (SpeContext) on CUDA: the server's
# (integration.attention.create_backend) and calibrate decode's on a GPU.
CUDA_DECODE_IMPL = "triton"
# layer -> (K pool, V pool) of that layer, [num_slots, Hkv, D]
PoolLayers = Callable[[int], tuple[torch.Tensor, torch.Tensor]]

logger = logging.getLogger(__name__)

# Forward passes a tracked request may be absent from before its state is dropped.
STALE_AFTER = 512


class Metrics(Protocol):
    """What the decoder reports to (``sgl_spec.attention.metrics.SparseMetrics``)."""

    def observe_step(self, exact: int, selected: Sequence[float]) -> None: ...
    def observe_reselections(self, n: int) -> None: ...
    def set_live_states(self, n: int) -> None: ...


class PassClock(Protocol):
    """Where the decoder reports each decode pass's wall time (``metrics.PassMetrics``)."""

    def observe_pass(self, path: str, seconds: float) -> None: ...


@dataclass
class DecodeStats:
    """Cumulative counts of this decoder (a request-step: one row of one decode pass)."""

    sparse_steps: int = 0
    exact_steps: int = 0
    reselections: int = 0
    stale_drops: int = 0


class Group(NamedTuple):
    """Rows of the pass a per-layer policy call serves."""

    idx: torch.Tensor  # [R] int64 rows of the batch
    slots: torch.Tensor  # [R] int64 their policy slots


class ScoreRow(NamedTuple):
    """A prompt a policy scores at the end of its prefill (SnapKV)."""

    rid: str
    seq_len: int
    index: int  # its position in the batch
    q_start: int  # its observation queries: q[q_start:q_end] of the extend pass
    q_end: int


class Staged(NamedTuple):
    """A pass whose sparse rows attend their elastic staging rows (SpeContext)."""

    elastic: ElasticPass
    rest: tuple[torch.Tensor, DecodeSubsets] | None  # the other rows: [R'] idx, subsets


class DecodePlan(NamedTuple):
    subsets: DecodeSubsets  # all rows; sel_idx is filled per layer when `sparse` is set
    sparse: Group | None = None  # rows attending a selection read per layer (policy width > 0)
    observe: tuple[Group, torch.Tensor] | None = None  # rows whose queries are kept, ring idx
    # + the rows' key slots: [R, N], or a slice of the pool for one row on contiguous slots
    reselect: tuple[Group, ReselectBatch, torch.Tensor | slice] | None = None
    staged: Staged | None = None
    dense: DecodeSubsets | None = None  # every row's whole history: --spec-dense-layers


class Decoder:
    def __init__(
        self,
        shape: AttnShape,
        policy: SelectionPolicy | None = None,  # None: exact mode
        *,
        impl: str | None = None,  # kernel impl; None: default_impl, fixed at the first run
        metrics: Metrics | None = None,
        stale_after: int = STALE_AFTER,
        prefetch: str = "auto",  # elastic loads (policies that stage KV): prefetch.PREFETCHERS
        pool_layers: PoolLayers | None = None,  # the KV pool by layer, for prefetchers
        track_sparse_kv: bool = False,  # keep sparse_kv_from (--spec-sparse-kv-cache drop)
        pass_metrics: PassClock | None = None,  # each decode pass's wall time, by path
    ):
        if stale_after < 1:
            raise ValueError(f"stale_after must be >= 1, got {stale_after}")
        if impl is not None and impl not in IMPLS:
            raise ValueError(f"impl {impl!r} is invalid; valid: {', '.join(IMPLS)}")
        self.shape = shape
        self.policy = policy
        self.impl = impl
        self.metrics = metrics
        self.pass_metrics = pass_metrics
        self._last_pass: tuple[float, str] | None = None  # (plan time, path) of a decode pass
        self.stale_after = stale_after
        self.stats = DecodeStats()
        self.pool_layers = pool_layers
        # layers under this attend densely whatever the policy selects (--spec-dense-layers)
        self.dense_layers = policy.cfg.dense_layers if policy is not None else 0
        if self.dense_layers >= shape.num_layers:
            raise ValueError(f"--spec-dense-layers {self.dense_layers} leaves no sparse "
                             f"layer; valid: 0-{shape.num_layers - 1} for this model's "
                             f"{shape.num_layers} layers")
        self.prefetcher = None
        if policy is not None and policy.stages_kv:
            self.prefetcher = get_prefetcher(prefetch, policy.slots.device)
            if self.prefetcher.needs_buffers and pool_layers is None:
                raise ValueError(f"--spec-prefetch {prefetch} needs the KV pool's layers "
                                 "(pool_layers); valid without them: auto, inline")
        self._forward = 0  # forward passes planned
        self._last_seen: dict[str, int] = {}  # rid -> forward pass it was last in
        # rid -> the first position whose KV a sparse step wrote (--spec-sparse-kv-cache
        # drop: the radix cache keeps none from there on); None: not tracked
        self._sparse_from: dict[str, int] | None = {} if track_sparse_kv else None
        self._checked: DecodePlan | None = None  # the plan whose kernel inputs were checked
        self._gathered = Scratch()  # the reselecting rows' keys, gathered (reused per layer)

    # ------------------------------------------------------------ lifetime

    @property
    def live_states(self) -> int:
        return len(self._last_seen)

    @property
    def tracks_sparse_kv(self) -> bool:
        return self._sparse_from is not None

    def sparse_kv_from(self, rid: str) -> int | None:
        """The first position of ``rid`` whose KV a sparse decode step wrote (the step's
        input token: its K and V past layer 0 come from sparse attention below); None if
        none did, or if not tracked."""
        return None if self._sparse_from is None else self._sparse_from.get(rid)

    def release(self, rid: str) -> None:
        """Free the request's state (finished, aborted, retracted). Unknown rids are fine."""
        if self._sparse_from is not None:
            self._sparse_from.pop(rid, None)
        if self._last_seen.pop(rid, None) is not None:
            self.policy.release(rid)
            if self.metrics is not None:
                self.metrics.set_live_states(len(self._last_seen))

    def rows(self) -> dict[str, dict]:
        """Per request with a policy state: its history, whether its steps attend a
        subset now, and why not (``GET /sgl_spec/cache``'s ``decode.rows``)."""
        if self.policy is None:
            return {}
        cfg, out = self.policy.cfg, {}
        for rid, st in self.policy.states.items():
            n = st.seq_len
            if n < cfg.min_context:
                why = f"exact: history {n} < min_context {cfg.min_context}"
            elif cfg.use_exact(n):
                why = f"exact: budget + sink + window cover the history {n}"
            elif (cfg.mode == "loopserve" and st.step < cfg.first_select_step
                  and getattr(st, "dense", False)):
                why = (f"exact until LoopServe's first selection (step "
                       f"{cfg.first_select_step}): no prompt seed")
            else:
                why = "sparse"
            out[rid] = {"history": n, "step": st.step, "path": why.split(":")[0], "why": why}
        return out

    def start(self, rid: str, prompt_len: int) -> None:
        self.release(rid)
        self.policy.start(rid, prompt_len)
        self._last_seen[rid] = self._forward
        if self.metrics is not None:
            self.metrics.set_live_states(len(self._last_seen))

    def seen(self, rid: str) -> None:
        self._last_seen[rid] = self._forward

    def next_pass(self) -> None:
        """Count a forward pass and drop states absent from the last ``stale_after``."""
        self._forward += 1
        if self.policy is None or self._forward % 64:
            return  # sweeping every pass would cost O(live) for nothing
        cutoff = self._forward - self.stale_after
        stale = [rid for rid, seen in self._last_seen.items() if seen < cutoff]
        for rid in stale:
            self.release(rid)
        if stale:
            self.stats.stale_drops += len(stale)
            logger.info("sparse decode: dropped %d state(s) unseen for %d passes: %s",
                        len(stale), self.stale_after, stale[:4])

    # ------------------------------------------------------------ plan

    def plan(self, batch: BatchView) -> DecodePlan:
        """Step every request of a decode pass and pack the pass for the layers."""
        if self.pass_metrics is None:
            return self._plan(batch)
        now = time.perf_counter()
        plan = self._plan(batch)
        if self._last_pass is not None:  # the previous decode pass ends where this starts
            self.pass_metrics.observe_pass(self._last_pass[1], now - self._last_pass[0])
        self._last_pass = (now, pass_path(plan))
        return plan

    def pass_ended(self) -> None:
        """A pass that is not a decode pass ran (an extend): the last decode pass's
        time is not known, so it is not reported."""
        self._last_pass = None

    def _plan(self, batch: BatchView) -> DecodePlan:
        self.next_pass()
        dense = dense_subsets(batch.req_to_token, batch.rows, batch.seq_lens_t,
                              self.shape.num_kv_heads)
        if self.policy is None:
            self._count(batch.size, [])
            return DecodePlan(dense)
        steps = [self._step(rid, n) for rid, n in zip(batch.rids, batch.seq_lens, strict=True)]
        sparse = [b for b, s in enumerate(steps) if s.kind == Kind.SPARSE]
        observe = [b for b, s in enumerate(steps) if s.observe >= 0]
        reselect = [b for b in sparse if steps[b].reselect]
        if self._sparse_from is not None:
            for b in sparse:  # a step of seq_len n writes the KV of position n - 1
                self._sparse_from.setdefault(batch.rids[b], batch.seq_lens[b] - 1)
        self._count(batch.size - len(sparse),
                    [self._attended(steps[b], batch.seq_lens[b]) for b in sparse])
        if not sparse and not observe:
            return DecodePlan(dense)  # exact mode's very call
        dev = batch.rows.device
        slots = [self.policy.states[rid].slot if rid in self.policy.states else -1
                 for rid in batch.rids]
        group = lambda rows: Group(_ints(rows, dev), _ints([slots[b] for b in rows], dev))  # noqa: E731
        plan = DecodePlan(dense, dense=dense if self.dense_layers else None)
        if sparse:
            plan = plan._replace(subsets=self._sparse_subsets(batch, steps),
                                 sparse=group(sparse))
            if self.policy.selects_per_pass:  # one selection, made now, for every layer
                sel = self.policy.select_pass(batch, sparse)
                plan.subsets.sel_idx.index_copy_(0, plan.sparse.idx, sel)
                staged = self._stage(batch, sparse, sel, plan.subsets) \
                    if self.policy.stages_kv else None
                plan = plan._replace(sparse=None, staged=staged)
        if observe:
            plan = plan._replace(observe=(group(observe),
                                          _ints([steps[b].observe for b in observe], dev)))
        if reselect:
            self.stats.reselections += len(reselect)
            if self.metrics is not None:
                self.metrics.observe_reselections(len(reselect))
            rb = self.policy.reselect_batch([batch.rids[b] for b in reselect], dev)
            plan = plan._replace(reselect=(group(reselect), rb, _key_slots(batch, reselect)))
        return plan

    def _step(self, rid: str, seq_len: int) -> RowStep:
        """Advance one request's policy state (starting it on its first decode step)."""
        policy = self.policy
        st = policy.states.get(rid)
        if st is not None and seq_len <= st.seq_len:
            self.release(rid)  # re-prefilled under the same rid: start over
        if rid not in policy.states:
            if policy.needs_prefill_queries:
                return EXACT_STEP  # its state is made at prefill
            self.start(rid, max(1, seq_len - 1))  # the prompt is what prefill wrote
        self.seen(rid)
        return policy.step(rid, seq_len)

    def _attended(self, step: RowStep, seq_len: int) -> int:
        """Positions a sparse row attends: sink + selection + recent window."""
        sink_end = min(self.policy.cfg.sink, seq_len)
        return sink_end + self.policy.width + seq_len - max(step.recent_start, sink_end)

    def _sparse_subsets(self, batch: BatchView, steps: list[RowStep]) -> DecodeSubsets:
        """All rows' subsets; sparse rows' selections are filled per layer (``run``)."""
        dev, width, hkv = batch.rows.device, self.policy.width, self.shape.num_kv_heads
        is_sparse = [s.kind == Kind.SPARSE for s in steps]
        sel_len = _ints([width if sp else 0 for sp in is_sparse], dev)[:, None].expand(-1, hkv)
        recent = _ints([s.recent_start if sp else 0 for s, sp in zip(steps, is_sparse)], dev)
        sel = torch.zeros(batch.size, hkv, width, dtype=torch.int64, device=dev)
        return DecodeSubsets(batch.req_to_token, batch.rows, batch.seq_lens_t, sel,
                             sel_len.contiguous(), recent, self.policy.cfg.sink)

    def _stage(self, batch: BatchView, sparse: list[int], sel: torch.Tensor,
               sub: DecodeSubsets) -> Staged:
        """Plan the elastic loads of the sparse rows and start their prefetch."""
        ep = self.policy.stage(batch, sparse, sel)
        loads = ep.ahead.join(ep.current) if self.prefetcher.copies_current else ep.ahead
        self.prefetcher.start(loads, self.shape.num_layers,
                              self._layer_buffers if self.prefetcher.needs_buffers else None)
        rest = None
        if len(sparse) < batch.size:
            kept = set(sparse)
            idx = _ints([b for b in range(batch.size) if b not in kept], batch.rows.device)
            rest = (idx, take_rows(sub, idx))
        return Staged(ep, rest)

    def _layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        return (*self.policy.stage_buffers(layer), *self.pool_layers(layer))

    def _count(self, exact: int, selected: list[int]) -> None:
        self.stats.exact_steps += exact
        self.stats.sparse_steps += len(selected)
        if self.metrics is not None:
            self.metrics.observe_step(exact, selected)

    # ------------------------------------------------------------ run

    def run(
        self,
        plan: DecodePlan,
        layer: int,
        q: torch.Tensor,  # [B, Hq, D] this layer's queries, one row per request
        k_buf: torch.Tensor,  # [num_slots, Hkv, D] this layer's K pool (current token written)
        v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
        out: torch.Tensor,  # [B, Hq, Dv], q.dtype: written
        scale: float,
    ) -> torch.Tensor:
        """One layer of the pass: the policy's batched calls, then one kernel call (two
        where staged rows and others share the pass)."""
        if self.impl is None:
            self.impl = default_impl(q, k_buf, v_buf)
        if layer < self.dense_layers and plan.dense is not None:
            # The whole history. This layer's staging rows are never read: the inline
            # prefetcher skips their loads, the thread and stream ones copy them unread.
            return sparse_decode(q, k_buf, v_buf, plan.dense, scale=scale, impl=self.impl,
                                 out=out, check=layer == 0)
        # The pass's first run checks the subsets against the pool; the others reuse them.
        check = plan is not self._checked
        self._checked = plan
        if plan.staged is not None:
            return self._run_staged(plan.staged, layer, q, k_buf, v_buf, out, scale, check)
        sub = plan.subsets
        if plan.observe is not None:
            group, ring = plan.observe
            self.policy.observe(layer, q.index_select(0, group.idx), group.slots, ring)
        if plan.reselect is not None:
            group, rb, key_slots = plan.reselect
            if isinstance(key_slots, slice):  # one row on a contiguous run of slots
                keys = k_buf[key_slots][None]  # a view: nothing gathered
            else:
                n, hkv, d = key_slots.shape[1], k_buf.shape[1], k_buf.shape[2]
                keys = self._gathered.take("keys", (key_slots.numel(), hkv, d), k_buf.dtype,
                                           k_buf.device)
                torch.index_select(k_buf, 0, key_slots.view(-1), out=keys)
                keys = keys.view(-1, n, hkv, d)
            self.policy.reselect(layer, keys, rb)
        if plan.sparse is not None and sub.sel_idx.shape[2]:
            sel = self.policy.selection(layer, plan.sparse.slots)
            sub.sel_idx.index_copy_(0, plan.sparse.idx, sel)
        return sparse_decode(q, k_buf, v_buf, sub, scale=scale, impl=self.impl, out=out,
                             check=check)

    def _run_staged(self, st: Staged, layer: int, q, k_buf, v_buf, out, scale: float,
                    check: bool) -> torch.Tensor:
        """Staged rows attend their S staging rows (the prefetched loads, then the
        decoded token's row, which this layer just wrote); the others the pool."""
        ep = st.elastic
        sk, sv = self.policy.stage_buffers(layer)
        self.prefetcher.wait(layer, (sk, sv, k_buf, v_buf))
        if not self.prefetcher.copies_current:
            ep.current.copy(sk, sv, k_buf, v_buf)
        if st.rest is None:  # every row staged
            return sparse_decode(q, sk, sv, ep.subsets, scale=scale, impl=self.impl, out=out,
                                 check=check)
        out.index_copy_(0, ep.idx, sparse_decode(q.index_select(0, ep.idx), sk, sv, ep.subsets,
                                                 scale=scale, impl=self.impl, check=check))
        idx, sub = st.rest
        out.index_copy_(0, idx, sparse_decode(q.index_select(0, idx), k_buf, v_buf, sub,
                                              scale=scale, impl=self.impl, check=check))
        return out

    # ------------------------------------------------------------ prefill (SnapKV)

    def plan_extend(self, batch: BatchView) -> list[ScoreRow]:
        """Start the states of a policy that scores the prompt (SnapKV, LoopServe's
        seed); returns the rows whose last ``prefill_window`` queries of the pass score
        their prompt.

        A chunked prompt is scored at each chunk of a pass that ends some prompt; the
        last chunk's scoring wins (sglang does not say which request's prompt ends).
        Rows of a mixed batch that are decoding (one token, state already stepping)
        keep their state and attend exactly in this pass.
        """
        self.pass_ended()
        self.next_pass()
        if self.policy is None:
            return []
        out, q_end = [], 0
        for i, (rid, n, e) in enumerate(zip(batch.rids, batch.seq_lens, batch.extend_lens,
                                            strict=True)):
            q_end += e
            st = self.policy.states.get(rid)
            if st is not None:
                self.seen(rid)
                if e == 1 and st.step >= 0:
                    continue  # a decoding row of a mixed batch
            if (batch.final_chunk and self.policy.scores_prompt()
                    and n >= self.policy.cfg.min_context):
                self.start(rid, n)
                out.append(ScoreRow(rid, n, i, q_end - min(e, self.policy.prefill_window),
                                    q_end))
        return out


def pass_path(plan: DecodePlan) -> str:
    """What a decode pass's attention does (``metrics.PASS_PATHS``)."""
    if plan.reselect is not None:
        return "reselect"
    return "sparse" if plan.sparse is not None or plan.staged is not None else "exact"


def _ints(xs: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64, device=device)


def _key_slots(batch: BatchView, rows: list[int]) -> torch.Tensor | slice:
    """[R, N] int64 pool slots of the rows' histories, padded with their last slot; for
    one row whose slots are one contiguous run (a fresh prompt's usually are), the
    slice of the pool instead, so scoring reads the keys in place."""
    dev = batch.rows.device
    seq = _ints([batch.seq_lens[b] for b in rows], dev)
    pool_rows = _ints([batch.pool_rows[b] for b in rows], dev)
    if len(rows) == 1:
        slots = batch.req_to_token[pool_rows[0], : seq[0]]
        first = int(slots[0])
        if int(slots[-1]) - first == len(slots) - 1 and bool(
                (slots[1:] - slots[:-1] == 1).all()):
            return slice(first, first + len(slots))
    pos = torch.arange(int(seq.max()), device=dev)[None, :].minimum(seq[:, None] - 1)
    return batch.req_to_token[pool_rows[:, None], pos].long()
