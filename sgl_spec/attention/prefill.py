"""LoopServe online prefill sparsification in the serving backend (LoopServe §5.2).

``--spec-prefill loopserve``: an extend of a request with at least ``min_tokens``
new tokens (a new turn, or a chunk of one) selects vertical/slash lines per layer
and KV head from a sample of its own queries (``select_lines``, Algorithm 2) and
attends only those lines (``vslash_attention``, torch impl). Shorter extends take
the exact path unchanged.

Positions below ``min_tokens`` always attend densely, in a sparse extend too (its
first rows take the exact path): the radix cache shares a prefix's KV with every
later request that matches it, and a prompt shorter than ``min_tokens`` is served
exactly, so the KV it can match must be what dense attention writes. (A long request
that was first to prefill the chat template's system prompt otherwise left the
line kernel's KV for it in the tree, and a short question over it flipped a near
tie: issue 48.) Per forward pass:

    turns = prefill.plan(batch)                once, before the layers
    prefill.extend(turns[i], layer, q, k, v, history_len, scale, exact)
                                               per sparse request and layer

Reuse across turns (``reuse``): at the end of its extend (after its last layer) a
request offers its per-layer lines to the request hub (``sgl_spec.requests``); the radix cache keeps
them as a payload of the tree node ending at the extend's last token, and hands them
back as seeds to a later extend whose cached prefix holds that node (the next turn of
the chat, the next chunk of a chunked prefill).

Stats (what the tests read; the served figures are ``PrefillMetrics``): per layer the
selected density (cells / causal cells), seeded and dense extends; recovered mass needs
full attention and is not computed here (``sgl_spec.bench.prefill_mass`` measures it).

Not thread-safe: the scheduler thread that runs the forward pass makes every call.
Tensors passed in are read, never kept; the lines offered are the cache's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sgl_spec.config import PrefillConfig
from sgl_spec.kernels.vslash import LineSet, SelectConfig, density, select_lines, vslash_attention
from sgl_spec.requests import Lines, RequestHub

from .batch import BatchView
from .extend import exact_extend

logger = logging.getLogger(__name__)

# A layer whose selection came out denser than PrefillConfig.skip_density skips its
# selection in the next extends and makes the dense call, re-selecting every
# REPROBE_EVERY-th extend; one denser than max_density makes the dense call at once.
# Speed alone would allow higher thresholds (the C++ line kernel breaks even near 0.6,
# selection included near 0.4: ``python -m sgl_spec.bench.vslash --crossover``), but
# with 0.6 / 0.4 the harness lost two of 18 questions at the beginning at every alpha:
# the layers selecting 0.2-0.6 of their cells are the diffuse ones (docs/sparse-prefill.md).
REPROBE_EVERY = 8


class Metrics(Protocol):
    """What the prefill reports to (``sgl_spec.attention.metrics.PrefillMetrics``)."""

    def observe_pass(self, sparse: int, exact: int) -> None: ...
    def observe_extend(self, density: float, select_s: float, seeded: bool) -> None: ...


@dataclass
class LayerStats:
    """Cumulative over this layer's sparse request-extends."""

    extends: int = 0
    density: float = 0.0  # summed mean-over-heads density
    seeded: int = 0  # extends whose selection had seeds
    dense: int = 0  # extends that made the dense call (too dense: selected, or skipped)


@dataclass
class PrefillStats:
    sparse_extends: int = 0  # request-extends (one request in one pass), all layers
    exact_extends: int = 0
    layers: dict[int, LayerStats] = field(default_factory=dict)


class Turn:
    """One request's sparse extend in the current pass."""

    def __init__(self, rid: str, end: int, seeds: dict[int, LineSet] | None, keep: bool):
        self.rid = rid
        self.end = end  # the sequence length after the extend
        self.seeds = seeds  # layer -> lines of the cached turn it continues
        self.keep = keep  # offer the lines to the cache at the end
        self.lines: dict[int, LineSet] = {}
        self.density = 0.0
        self.select_s = 0.0


class SparsePrefill:
    def __init__(
        self,
        cfg: PrefillConfig,
        num_layers: int,
        *,
        metrics: Metrics | None = None,
        hub: RequestHub | None = None,  # the core's (None: a hub of its own)
        select: SelectConfig | None = None,  # None: SelectConfig's defaults, cfg's alpha
    ):
        if num_layers < 1:
            raise ValueError(f"num_layers ({num_layers}) must be >= 1")
        self.cfg = cfg
        self.select = select if select is not None else SelectConfig(alpha=cfg.alpha)
        self.num_layers = num_layers
        self.metrics = metrics
        self.hub = hub if hub is not None else RequestHub()
        self.stats = PrefillStats()
        # layer -> consecutive extends whose selection came out denser than skip_density
        self._over: dict[int, int] = {}

    def wants(self, q_len: int) -> bool:
        return q_len >= self.cfg.min_tokens

    def dense_rows(self, history_len: int, n: int) -> int:
        """How many of an extend's ``n`` rows (after ``history_len`` cached tokens) sit
        at positions below ``min_tokens``, which attend densely."""
        return min(max(self.cfg.min_tokens - history_len, 0), n)

    def plan(self, batch: BatchView) -> dict[int, Turn]:
        """The pass's sparse extends (an extend pass), by batch index."""
        turns = {}
        for i, (rid, n, e) in enumerate(zip(batch.rids, batch.seq_lens, batch.extend_lens)):
            if self.wants(e) and self.dense_rows(n - e, e) < e:
                seeds = self.hub.seeds(rid, n - e) if self.cfg.reuse else None
                turns[i] = Turn(rid, n, seeds.layers if seeds else None, self.cfg.reuse)
        sparse = len(turns)
        self.stats.sparse_extends += sparse
        self.stats.exact_extends += batch.size - sparse
        if self.metrics is not None:
            self.metrics.observe_pass(sparse, batch.size - sparse)
        return turns

    def extend(
        self,
        turn: Turn,
        layer: int,
        q: torch.Tensor,  # [n, Hq, D]
        k: torch.Tensor,  # [N+n, Hkv, D], history then new keys
        v: torch.Tensor,  # [N+n, Hkv, D]
        history_len: int,  # N, cached prefix
        scale: float | None,
        exact: Callable[[], torch.Tensor],  # the row's dense call (exact mode's), [n, Hq, D]
    ) -> torch.Tensor:  # [n, Hq, D], q.dtype
        """Select this layer's lines and attend them (LoopServe Alg. 2 + §5.2), or
        make the dense call where the lines would be too dense to pay. Rows at
        positions below ``min_tokens`` attend densely either way."""
        st = self.stats.layers.setdefault(layer, LayerStats())
        over = self._over.get(layer, 0)
        head = self.dense_rows(history_len, q.shape[0])
        if head == q.shape[0]:  # every row below min_tokens: nothing to select
            st.dense += 1
            out = exact()
            self._maybe_finish(turn, layer)
            return out
        if over % REPROBE_EVERY:
            # Too dense last time: skip the selection, re-select every REPROBE_EVERY.
            self._over[layer] = over + 1
            st.dense += 1
            out = exact()
            self._maybe_finish(turn, layer)
            return out
        seeds = turn.seeds.get(layer) if turn.seeds else None
        # The sparse rows: the extend's rows from position max(min_tokens, N) on.
        sq, hist = q[head:], history_len + head
        t0 = time.perf_counter()
        lines = select_lines(sq, k, hist, self.select, scale, seeds=seeds)
        t1 = time.perf_counter()
        dens = float(density(lines, sq.shape[0], hist).mean())
        skip = dens > self.cfg.skip_density
        self._over[layer] = over + 1 if skip else 0
        if dens > self.cfg.max_density:
            st.dense += 1
            out = exact()
        else:
            out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
            out[head:] = vslash_attention(sq, k, v, lines, hist, scale, impl="torch")
            if head:
                out[:head] = exact_extend(q[:head], k[:hist], v[:hist], history_len, scale)
        st.extends += 1
        st.density += dens
        st.seeded += seeds is not None
        turn.density += dens
        turn.select_s += t1 - t0
        if turn.keep:
            turn.lines[layer] = lines
        self._maybe_finish(turn, layer)
        return out

    def _maybe_finish(self, turn: Turn, layer: int) -> None:
        if layer != self.num_layers - 1:
            return
        if turn.keep and turn.lines:  # layers that skipped selection: no seeds
            self.hub.offer_lines(turn.rid, Lines(turn.end, dict(turn.lines)))
        if self.metrics is not None:
            self.metrics.observe_extend(turn.density / self.num_layers, turn.select_s,
                                        turn.seeds is not None)
