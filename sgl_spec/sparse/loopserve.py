"""``loopserve``: progressive reselection from the last n_d decoded queries.

LoopServe Sec 5.3, Algorithm 3. Each layer keeps the queries of the last ``nd``
decoded tokens in a ring ``[nd, Hq, D]`` (a slot-table row per request and layer).
At decode step ``first_select_step`` (16) and every ``nd`` steps after, each layer
scores the history by the attention those queries pay it (``score_history``: causal
softmax per query over the full history, summed over the queries and the query heads
of each KV head's group; Eq. 7), batched over the rows that reselect, and each KV
head keeps its top ``budget`` positions outside the sink and the recent window.
``--spec-lookahead W`` (16 by default; 0 is the paper's score) adds to each position's mass
the largest mass of the W before it (``scoring.look_ahead``): what follows an attended
token is kept before the decode reads it (a value after the subject the answer restates;
issue 47). Its equal scores go to the earlier position, so a row selects alike in any
batch.

With ``prompt_seed`` (``--spec-prompt-seed``, off by default) a prompt of ``min_context``
tokens or more is scored at the end of its prefill by its last ``window`` queries, as a
decode selection scores the ring (``prefill_layer``; SnapKV's observation window): the
steps before the first selection attend that seed's selection, as the paper's decode
starts from what its prefill selected (Sec 5.3), instead of attending densely.

The current step's query is in the ring when it selects (Algorithm 3 observes
``X_i[|X_i| - n_d : |X_i|]``, the current token included). A selection fixes
``recent_start = seq_len - window``; tokens generated after it are in the window
until the next selection, so the attended set never exceeds
``sink + budget + window + nd - 1``. ``--spec-window 1`` is Algorithm 3 verbatim (the
window starts at the current token). Before the first selection, and whenever
``use_exact`` holds at a selection step, decode is dense (unseeded requests); the steps
whose queries a coming selection will score are ``OBSERVE`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .policy import Kind, ReselectBatch, RequestState, RowStep, SelectionPolicy
from .scoring import Scratch, score_history, select
from .slots import BufferSpec


@dataclass
class LoopServeState(RequestState):
    dense: bool = True
    recent_start: int = 0
    ring_pos: list[int] = field(default_factory=list)  # [nd] position of each ring entry
    seeded: int = 0  # layers the prompt's queries selected for at prefill


class LoopServePolicy(SelectionPolicy):
    name = "loopserve"

    def buffers(self) -> dict[str, BufferSpec]:
        s = self.shape
        # fp32 whatever the model's dtype: scoring converts the queries to fp32 anyway
        # (1.1 MB per request on the default model's 30 layers).
        return {**super().buffers(),
                "ring": BufferSpec((self.cfg.nd, s.num_q_heads, s.head_dim), torch.float32)}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scratch = Scratch()  # the reselection's buffers, reused (scheduler thread)

    def new_state(self, prompt_len: int, slot: int) -> LoopServeState:
        return LoopServeState(prompt_len, slot, seq_len=prompt_len,
                              ring_pos=[-1] * self.cfg.nd)

    def scores_prompt(self) -> bool:
        return self.cfg.prompt_seed

    def prefill_layer(self, rid, layer, q_obs, k) -> None:
        """Seed: the selection the prompt's last ``window`` queries make, scored as
        ``reselect`` scores the ring, before the first decode step."""
        st: LoopServeState = self.state(rid)
        n, w = st.prompt_len, q_obs.shape[0]
        if k.shape[0] != n or not 1 <= w <= n:
            raise ValueError(f"request {rid!r}: k {tuple(k.shape)} / q_obs {tuple(q_obs.shape)} "
                             f"do not fit prompt_len {n}")
        if self.cfg.use_exact(n):
            return
        st.recent_start = n - self.cfg.window
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=k.device)
        batch = ReselectBatch(slots=t([st.slot]), seq_lens=t([n]),
                              lo=t([min(self.cfg.sink, n)]), hi=t([st.recent_start]),
                              q_pos=t([list(range(n - w, n))]))
        self._select(layer, q_obs[None], k[None], batch)
        st.seeded += 1
        st.dense = st.seeded < self.shape.num_layers

    def is_selection_step(self, step: int) -> bool:
        c = self.cfg
        return step >= c.first_select_step and (step - c.first_select_step) % c.nd == 0

    def _on_step(self, st: LoopServeState) -> RowStep:
        c = self.cfg
        ring = st.step % c.nd
        reselect = False
        if self.is_selection_step(st.step):
            st.dense = c.use_exact(st.seq_len)
            if not st.dense:
                st.recent_start = st.seq_len - c.window
                reselect = True
        if not st.dense:
            kind = Kind.SPARSE
        elif c.use_exact(st.seq_len + c.nd - 1):
            # No selection within the next nd - 1 steps will be sparse (use_exact only
            # turns False as the history grows): this query will never be scored.
            return RowStep(Kind.EXACT)
        else:
            kind = Kind.OBSERVE
        st.ring_pos[ring] = st.seq_len - 1
        return RowStep(kind, st.recent_start, reselect, ring)

    def observe(self, layer, q, slots, ring) -> None:
        buf = self.slots.buffer("ring")[layer]  # [cap, nd, Hq, D]
        buf[slots, ring] = q.to(buf.dtype)

    def reselect_batch(self, rids, device) -> ReselectBatch:
        batch = super().reselect_batch(rids, device)
        pos = torch.tensor([self.state(r).ring_pos for r in rids], dtype=torch.int64,
                           device=device)
        return batch._replace(q_pos=pos)

    def reselect(self, layer, keys, batch: ReselectBatch) -> None:
        ring = self.slots.rows("ring", layer, batch.slots)  # [R, nd, Hq, D]
        self._select(layer, ring, keys, batch)

    def _select(self, layer, q, keys, batch: ReselectBatch) -> None:
        """Score the rows' histories by the attention of ``q`` [R, n, Hq, D] at
        ``batch.q_pos`` and store each KV head's top B (Eq. 7, with the look-ahead)."""
        scores = score_history(q, keys, self.shape.sm_scale, batch.q_pos,
                               batch.seq_lens, self.scratch)  # [R, Hkv, N]
        sel = select(scores, self.cfg.budget, batch.lo, batch.hi, self.cfg.lookahead)
        self.slots.write("sel", layer, batch.slots, sel)
