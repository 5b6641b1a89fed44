"""``loopserve``: progressive reselection from the last n_d decoded queries.

LoopServe Sec 5.3, Algorithm 3. Each layer keeps the queries of the last ``nd``
decoded tokens in a ring ``[nd, Hq, D]``. At decode step ``first_select_step`` (16)
and every ``nd`` steps after, each layer scores the history by the attention those
queries pay it (``score_history``: causal softmax per query over the full history,
summed over the queries and the query heads of each KV head's group; Eq. 7) in one
batched pass over the layer's keys, and each KV head keeps its top ``budget``
positions outside the sink and the recent window.

The current step's query is in the ring when it selects (Algorithm 3 observes
``X_i[|X_i| - n_d : |X_i|]``, the current token included). A selection fixes
``recent_start = seq_len - window``; tokens generated after it are in the window
until the next selection, so the attended set never exceeds
``sink + budget + window + nd - 1``. ``--spec-window 1`` is Algorithm 3 verbatim (the
window starts at the current token). Before the first selection, and whenever
``use_exact`` holds at a selection step, decode is dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .params import use_exact
from .policy import RequestState, SelectionPolicy
from .scoring import score_history, select_topk
from .subset import Subset, dense_subset


@dataclass
class LoopServeState(RequestState):
    dense: bool = True
    reselect: bool = False  # this step selects (set by step(), read by decode_layer)
    recent_start: int = 0
    ring: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [nd, Hq, D]
    ring_pos: list[int] = field(default_factory=list)  # [nd] position of each ring slot
    sel: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hkv, n] int64


class LoopServePolicy(SelectionPolicy):
    name = "loopserve"

    def new_state(self, prompt_len: int) -> LoopServeState:
        return LoopServeState(prompt_len, prompt_len, ring_pos=[0] * self.params.nd)

    def is_selection_step(self, step: int) -> bool:
        p = self.params
        return step >= p.first_select_step and (step - p.first_select_step) % p.nd == 0

    def _on_step(self, st: LoopServeState) -> bool:
        p = self.params
        st.ring_pos[st.step % p.nd] = st.seq_len - 1
        st.reselect = False
        if self.is_selection_step(st.step):
            st.dense = use_exact(st.seq_len, p)
            if not st.dense:
                st.recent_start = st.seq_len - p.window
                st.reselect = True
        return st.reselect

    def attends_layers(self, rid: str) -> bool:
        """Sparse now, selecting now, or this step's query may still be in the ring
        at a sparse selection: one within the next nd - 1 steps, when the history
        will have grown by as much (``use_exact`` only turns False as it grows)."""
        st: LoopServeState = self.states.get(rid)
        p = self.params
        return not st.dense or st.reselect or not use_exact(st.seq_len + p.nd - 1, p)

    def decode_layer(
        self,
        rid: str,
        layer: int,
        q: torch.Tensor,  # [Hq, D]
        k: torch.Tensor | None = None,  # [seq_len, Hkv, D] when step() returned True
    ) -> Subset:
        st: LoopServeState = self.states.get(rid)
        p, shape = self.params, self.shape
        if st.step < 0:
            raise RuntimeError(f"request {rid!r}: decode_layer() before step()")
        ring = st.ring.get(layer)
        if ring is None:
            ring = st.ring[layer] = q.new_zeros(p.nd, shape.num_q_heads, shape.head_dim)
        ring[st.step % p.nd] = q
        if st.reselect:
            if k is None or k.shape[0] != st.seq_len:
                raise ValueError(
                    f"request {rid!r} reselects at step {st.step}: needs k "
                    f"[{st.seq_len}, Hkv, D], got {None if k is None else tuple(k.shape)}"
                )
            filled = min(st.step + 1, p.nd)  # slots 0..filled-1 hold queries
            q_pos = torch.tensor(st.ring_pos[:filled], device=k.device)
            scores = score_history(ring[:filled], k, shape.sm_scale, q_pos)  # [Hkv, N]
            sink_end = min(p.sink, st.seq_len)
            st.sel[layer] = select_topk(scores, p.budget, sink_end, st.recent_start)
        if st.dense:
            return dense_subset(shape.num_kv_heads, q.device)
        return Subset(st.sel[layer], st.recent_start)
