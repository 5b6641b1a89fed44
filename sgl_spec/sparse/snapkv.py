"""``snapkv``: select once at the end of prefill from the last prompt window (SnapKV).

The last ``window`` prompt queries of each layer score every prompt position by the
attention they pay it (causal; summed over the queries and over the query heads of a
KV head's group), the scores are smoothed by a 1-D pool along positions (kernel 7,
avg by default), and each KV head keeps its top ``budget`` positions outside the sink
and the window. Decode then attends sink + that fixed selection + everything from the
prompt's last window on (the window grows with the generated tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .policy import EXACT_STEP, Kind, RequestState, RowStep, SelectionPolicy
from .scoring import POOL_KINDS, Scratch, pool_scores, score_history, select_topk


@dataclass
class SnapKVState(RequestState):
    exact: bool = True
    recent_start: int = 0
    scored: int = 0  # layers whose selection prefill_layer() stored


class SnapKVPolicy(SelectionPolicy):
    name = "snapkv"
    needs_prefill_queries = True

    def __init__(self, cfg, shape, device="cpu", *, pool_kind: str = "avg",
                 pool_kernel: int = 7):
        super().__init__(cfg, shape, device)
        if pool_kind not in POOL_KINDS:
            raise ValueError(f"pool_kind {pool_kind!r} is invalid; valid: {', '.join(POOL_KINDS)}")
        if pool_kernel < 1 or pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be an odd integer >= 1, got {pool_kernel}")
        self.pool_kind = pool_kind
        self.pool_kernel = pool_kernel
        self.scratch = Scratch()  # scoring's buffers, reused (scheduler thread)

    def new_state(self, prompt_len: int, slot: int) -> SnapKVState:
        exact = self.cfg.use_exact(prompt_len)
        recent = 0 if exact else prompt_len - self.cfg.window
        return SnapKVState(prompt_len, slot, seq_len=prompt_len, exact=exact,
                           recent_start=recent)

    def prefill_layer(self, rid, layer, q_obs, k) -> None:
        st: SnapKVState = self.state(rid)
        if st.exact:
            return
        n, w = st.prompt_len, q_obs.shape[0]
        if k.shape[0] != n or not 1 <= w <= n:
            raise ValueError(f"request {rid!r}: k {tuple(k.shape)} / q_obs {tuple(q_obs.shape)} "
                             f"do not fit prompt_len {n}")
        q_pos = torch.arange(n - w, n, device=k.device)
        scores = score_history(q_obs[None], k[None], self.shape.sm_scale, q_pos[None],
                               scratch=self.scratch)
        # Pool over the candidate prefix only, as SnapKV pools attn[..., :-window].
        pooled = pool_scores(scores[..., : st.recent_start], self.pool_kernel, self.pool_kind)
        t = lambda x: torch.tensor([x], dtype=torch.int64, device=k.device)  # noqa: E731
        sel = select_topk(pooled, self.cfg.budget, t(min(self.cfg.sink, n)), t(st.recent_start))
        self.slots.write("sel", layer, t(st.slot), sel)
        st.scored += 1

    def _on_step(self, st: SnapKVState) -> RowStep:
        if st.exact:
            return EXACT_STEP
        if st.scored < self.shape.num_layers:
            raise RuntimeError(f"snapkv: prefill_layer() scored {st.scored} of "
                               f"{self.shape.num_layers} layers before decode")
        return RowStep(Kind.SPARSE, st.recent_start)
