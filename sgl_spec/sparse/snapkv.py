"""``snapkv``: select once at the end of prefill from the last prompt window (SnapKV).

The last ``window`` prompt queries of each layer score every prompt position by the
attention they pay it (causal; summed over the queries and over the query heads of a
KV head's group), the scores are smoothed by a 1-D pool along positions (kernel 7,
avg by default), and each KV head keeps its top ``budget`` positions outside the sink
and the window. Decode then attends sink + that fixed selection + everything from the
prompt's last window on (the window grows with the generated tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .params import SparseParams, use_exact
from .policy import AttnShape, RequestState, SelectionPolicy
from .scoring import POOL_KINDS, pool_scores, score_history, select_topk
from .subset import Subset, dense_subset


@dataclass
class SnapKVState(RequestState):
    exact: bool = True
    recent_start: int = 0
    sel: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hkv, n] int64


class SnapKVPolicy(SelectionPolicy):
    name = "snapkv"
    needs_prefill_queries = True

    def __init__(
        self,
        params: SparseParams,
        shape: AttnShape,
        *,
        pool_kind: str = "avg",
        pool_kernel: int = 7,
    ):
        super().__init__(params, shape)
        if pool_kind not in POOL_KINDS:
            raise ValueError(f"pool_kind {pool_kind!r} is invalid; valid: {', '.join(POOL_KINDS)}")
        if pool_kernel < 1 or pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be an odd integer >= 1, got {pool_kernel}")
        self.pool_kind = pool_kind
        self.pool_kernel = pool_kernel

    def new_state(self, prompt_len: int) -> SnapKVState:
        exact = use_exact(prompt_len, self.params)
        recent = 0 if exact else prompt_len - self.params.window
        return SnapKVState(prompt_len, prompt_len, exact=exact, recent_start=recent)

    def prefill_layer(
        self,
        rid: str,
        layer: int,
        q_obs: torch.Tensor,  # [w, Hq, D] the last w prompt queries, 1 <= w <= prompt_len
        k: torch.Tensor,  # [prompt_len, Hkv, D]
    ) -> None:
        st: SnapKVState = self.states.get(rid)
        if st.exact:
            return
        n, w = st.prompt_len, q_obs.shape[0]
        if k.shape[0] != n or not 1 <= w <= n:
            raise ValueError(
                f"request {rid!r}: k {tuple(k.shape)} / q_obs {tuple(q_obs.shape)} "
                f"do not fit prompt_len {n}"
            )
        q_pos = torch.arange(n - w, n, device=k.device)
        scores = score_history(q_obs, k, self.shape.sm_scale, q_pos)  # [Hkv, N]
        # Pool over the candidate prefix only, as SnapKV pools attn[..., :-window].
        pooled = pool_scores(scores[:, : st.recent_start], self.pool_kernel, self.pool_kind)
        sink_end = min(self.params.sink, n)
        st.sel[layer] = select_topk(pooled, self.params.budget, sink_end, st.recent_start)

    def attends_layers(self, rid: str) -> bool:
        return not self.states.get(rid).exact

    def decode_layer(
        self, rid: str, layer: int, q: torch.Tensor, k: torch.Tensor | None = None
    ) -> Subset:
        st: SnapKVState = self.states.get(rid)
        if st.exact:
            return dense_subset(self.shape.num_kv_heads, q.device)
        if layer not in st.sel:
            raise RuntimeError(f"request {rid!r}: prefill_layer() was not called for layer {layer}")
        return Subset(st.sel[layer], st.recent_start)
