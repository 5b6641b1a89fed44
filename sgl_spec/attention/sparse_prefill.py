"""LoopServe online prefill sparsification in the serving backend (LoopServe §5.2).

``--spec-prefill loopserve``: an extend of a request with at least ``min_tokens``
new tokens (a new turn, or a chunk of one) selects vertical/slash lines per layer
and KV head from a sample of its own queries (``select_lines``, Algorithm 2) and
attends only those lines (``vslash_attention``, torch impl). Shorter extends take
the exact path unchanged. The backend calls, per forward pass:

    begin_pass(extend_lens)                    once, before the layers
    wants(q_len) -> bool                       per request and layer
    extend(layer, i, slots, q, k, v, ...)      instead of the dense SDPA call

Reuse across turns: with ``reuse`` on, a request's per-layer lines are stored at
the end of its extend (after its last layer) in a :class:`LineStore`, keyed by
the KV slots of the sequence it was selected on; a later extend whose cached
prefix is that sequence (the next turn of the chat, the next chunk of a chunked
prefill) passes them as ``seeds`` to the selection.

Stats: per layer the selected density (cells / causal cells) and the selection
and attention time; recovered mass needs full attention and is not computed here
(``sgl_spec.bench.prefill_mass`` measures it offline).

Not thread-safe: the scheduler thread that runs the forward pass makes every call.
Tensors passed in are read, never kept; the store keeps the selected lines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sgl_spec.attention.line_store import FINGERPRINT_LAYER, Fingerprint, LineStore, fingerprint
from sgl_spec.kernels.vslash import LineSet, SelectConfig, density, select_lines, vslash_attention
from sgl_spec.kernels.vslash.torch_impl import dense_attention_torch

logger = logging.getLogger(__name__)

# Two per-layer thresholds on the selected density (cells / causal cells):
# * MAX_DENSITY: a layer whose lines cover more makes the dense call this extend;
# * SKIP_DENSITY: a layer whose lines cover more skips its selection in the next
#   extends and makes the dense call, re-selecting every REPROBE_EVERY-th extend.
# Speed alone would allow more: ``kernels.vslash.bench --qk FILE --crossover 4096
# --history 1024 --per-layer --max-density 1 --skip-density 1`` (and 2048 over 4096,
# 4096 fresh) on the default model's 6k prompt puts the C++ slash kernel's break-evens
# near 0.6 (vslash / dense 0.3-0.55 at density 0.2-0.4, 0.7-1.1 at 0.8) and, selection
# included, 0.4 ((select + vslash) / dense 0.5-0.7 at 0.2-0.3, 0.65-0.95 at 0.3-0.4).
# But with 0.6 / 0.4 the harness (sparse-prefill.toml) lost two of 18 questions at the
# beginning at every alpha, 0.98 included: the layers selecting 0.2-0.6 of their cells
# are the diffuse ones, where the uncovered mass is spread over many cells. With 0.3 /
# 0.2 they attend densely, which kept accuracy (README). The torch-ops line path's own
# break-evens are 0.3 and 0.2 as well.
MAX_DENSITY = 0.3
SKIP_DENSITY = 0.2
REPROBE_EVERY = 8


def _dense(q, k, v, history_len: int, scale, exact: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A too-dense layer's attention: exact mode's call for a fresh prompt (SDPA with
    ``is_causal``, already the fused kernel); over a cached prefix, the fused
    history + causal split (``dense_attention_torch``), since exact mode's call
    then needs an offset causal mask and runs SDPA's unfused path on a CPU."""
    if history_len == 0 or q.device.type != "cpu":
        return exact()
    return dense_attention_torch(q, k, v, history_len, scale)


class Metrics(Protocol):
    """What the prefill reports to (``sgl_spec.attention.metrics.PrefillMetrics``)."""

    def observe_pass(self, sparse: int, exact: int) -> None: ...
    def observe_extend(self, density: float, select_s: float, seeded: bool) -> None: ...


@dataclass
class LayerStats:
    """Cumulative over this layer's sparse request-extends."""

    extends: int = 0
    density: float = 0.0  # summed mean-over-heads density
    select_s: float = 0.0
    attend_s: float = 0.0
    seeded: int = 0  # extends whose selection had seeds
    dense: int = 0  # extends that made the dense call (too dense: selected, or skipped)

    def as_dict(self) -> dict:
        n = max(self.extends, 1)
        return {"extends": self.extends, "density": self.density / n,
                "select_ms": 1e3 * self.select_s / n, "attend_ms": 1e3 * self.attend_s / n,
                "seeded": self.seeded, "dense": self.dense}


@dataclass
class PrefillStats:
    sparse_extends: int = 0  # request-extends (one request in one pass), all layers
    exact_extends: int = 0
    layers: dict[int, LayerStats] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"sparse_extends": self.sparse_extends, "exact_extends": self.exact_extends,
                "layers": {k: v.as_dict() for k, v in sorted(self.layers.items())}}


class _Turn:
    """One request's sparse extend in the current pass."""

    def __init__(self, seeds: dict[int, LineSet] | None, key: Fingerprint | None):
        self.seeds = seeds  # layer -> lines of the stored earlier extend
        self.key = key  # where this extend's lines are stored (None: not stored)
        self.lines: dict[int, LineSet] = {}
        self.density = 0.0
        self.select_s = 0.0


class SparsePrefill:
    def __init__(
        self,
        select: SelectConfig,
        min_tokens: int,
        num_layers: int,
        *,
        store: LineStore | None = None,  # None: no reuse across turns
        metrics: Metrics | None = None,
        max_density: float = MAX_DENSITY,
        skip_density: float = SKIP_DENSITY,
    ):
        if min_tokens < 1 or num_layers < 1:
            raise ValueError(
                f"min_tokens ({min_tokens}) and num_layers ({num_layers}) must be >= 1"
            )
        self.select = select
        self.min_tokens = min_tokens
        self.num_layers = num_layers
        self.store = store
        self.metrics = metrics
        if not 0 < max_density <= 1:
            raise ValueError(f"max_density must be in (0, 1], got {max_density}")
        self.max_density = max_density
        if not 0 < skip_density <= 1:
            raise ValueError(f"skip_density must be in (0, 1], got {skip_density}")
        self.skip_density = skip_density
        self.stats = PrefillStats()
        self._turns: dict[int, _Turn] = {}  # batch index -> state, this pass
        # layer -> consecutive extends whose selection came out denser than skip_density
        self._over: dict[int, int] = {}

    def begin_pass(self, extend_lens: Sequence[int] | None) -> None:
        """A new forward pass; ``extend_lens`` per request (None: not an extend)."""
        self._turns.clear()
        if not extend_lens:
            return
        sparse = sum(1 for n in extend_lens if self.wants(n))
        self.stats.sparse_extends += sparse
        self.stats.exact_extends += len(extend_lens) - sparse
        if self.metrics is not None:
            self.metrics.observe_pass(sparse, len(extend_lens) - sparse)

    def wants(self, q_len: int) -> bool:
        return q_len >= self.min_tokens

    def extend(
        self,
        layer: int,
        index: int,  # the request's position in the batch
        slots: torch.Tensor,  # [N+n] int32 KV-pool slots of the request's sequence
        q: torch.Tensor,  # [n, Hq, D]
        k: torch.Tensor,  # [N+n, Hkv, D], history then new keys
        v: torch.Tensor,  # [N+n, Hkv, D]
        history_len: int,  # N, cached prefix
        scale: float | None,
        key_cache: torch.Tensor,  # [pool_size, Hkv, D] this layer's key buffer
        exact: Callable[[], torch.Tensor] | None = None,  # the row's dense call, [n, Hq, D]
    ) -> torch.Tensor:  # [n, Hq, D], q.dtype
        """Select this layer's lines and attend them (LoopServe Alg. 2 + §5.2), or
        make the dense call where the lines would be too dense to pay."""
        turn = self._turns.get(index)
        if turn is None:
            turn = self._turns[index] = self._start(layer, slots, history_len, key_cache)
        st = self.stats.layers.setdefault(layer, LayerStats())
        over = self._over.get(layer, 0)
        if exact is not None and over % REPROBE_EVERY:
            # Too dense last time: skip the selection, re-select every REPROBE_EVERY.
            self._over[layer] = over + 1
            st.dense += 1
            out = _dense(q, k, v, history_len, scale, exact)
            if layer == self.num_layers - 1:  # the extend still ends here
                self._finish(turn)
            return out
        seeds = turn.seeds.get(layer) if turn.seeds else None
        t0 = time.perf_counter()
        lines = select_lines(q, k, history_len, self.select, scale, seeds=seeds)
        t1 = time.perf_counter()
        dens = float(density(lines, q.shape[0], history_len).mean())
        self._over[layer] = over + 1 if exact is not None and dens > self.skip_density else 0
        if exact is not None and dens > self.max_density:
            st.dense += 1
            out = _dense(q, k, v, history_len, scale, exact)
        else:
            out = vslash_attention(q, k, v, lines, history_len, scale, impl="torch")
        t2 = time.perf_counter()
        st.extends += 1
        st.density += dens
        st.select_s += t1 - t0
        st.attend_s += t2 - t1
        st.seeded += seeds is not None
        turn.density += dens
        turn.select_s += t1 - t0
        if turn.key is not None:
            turn.lines[layer] = lines
        if layer == self.num_layers - 1:
            self._finish(turn)
        return out

    def _start(self, layer: int, slots: torch.Tensor, history_len: int,
               key_cache: torch.Tensor) -> _Turn:
        # The fingerprint reads FINGERPRINT_LAYER's keys: only there can a turn
        # be looked up and stored (layers run in order, so that is the first call).
        if self.store is None or layer != FINGERPRINT_LAYER:
            return _Turn(None, None)
        seeds = self.store.lookup(slots, history_len, key_cache)
        return _Turn(seeds, fingerprint(slots, slots.numel(), key_cache))

    def _finish(self, turn: _Turn) -> None:
        if turn.key is not None and turn.lines:  # layers that skipped selection: no seeds
            self.store.put(turn.key, turn.lines)
        if self.metrics is not None:
            self.metrics.observe_extend(turn.density / self.num_layers, turn.select_s,
                                        turn.seeds is not None)
