"""``specontext``: a retrieval head selects each decode step's KV before the model runs.

SpeContext (Sec 4-5). Before every decode pass the retrieval head
(``sgl_spec.head``; attached with ``attach``) scores each sparse row's history with
the query of the token about to be decoded and keeps the top ``budget`` positions per
KV head outside the sink and the recent window; that one selection serves every
layer (``select_pass``). Unlike LoopServe there is no dense warm-up and no
observation window: the selection is renewed at every step, so it follows a long
generation as it moves.

Rows attend sink + selection + window. The K/V of those positions are kept in a
compact staging buffer per request and layer, updated elastically: only the
positions that entered the set since the last step are copied (``elastic``, Sec
5.4), planned once per pass for all layers so the copies can be prefetched while
earlier layers compute (``sgl_spec.attention.prefetch``). Histories that
``use_exact`` keeps dense decode exactly.

Counters (``stats``): steps, head time, rows loaded, overlap of consecutive
selections (|S_now & S_last| / B per KV head, for rows whose previous step was sparse).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .elastic import ElasticKV, ElasticPass
from .policy import EXACT_STEP, Kind, RequestState, RowStep, SelectionPolicy
from .slots import BufferSpec


@dataclass
class SpeContextStats:
    selections: int = 0  # request-steps selected by the head
    rows_loaded: int = 0  # staged positions copied, summed over request-steps and KV heads
    full_loads: int = 0  # request-steps whose staging was empty (first sparse step)
    overlap_sum: float = 0.0  # sum of per-(request-step, KV head) overlaps
    overlap_n: int = 0

    @property
    def mean_overlap(self) -> float | None:
        return self.overlap_sum / self.overlap_n if self.overlap_n else None


@dataclass
class SpeContextState(RequestState):
    sparse_before: bool = False  # the previous step attended a selection


class SpeContextPolicy(SelectionPolicy):
    name = "specontext"
    selects_per_pass = True
    stages_kv = True

    def __init__(self, cfg, shape, device="cpu"):
        self.elastic = ElasticKV(cfg.sink, cfg.budget, cfg.window, shape.num_kv_heads)
        super().__init__(cfg, shape, device)
        self.runtime = None  # sgl_spec.head.runtime.HeadRuntime, see attach()
        self.metrics = None  # sgl_spec.attention.metrics.SpeContextMetrics
        self.stats = SpeContextStats()

    def attach(self, runtime) -> None:
        """The server's retrieval head (``HeadRuntime``): needed before the first step."""
        if runtime.head.cfg.num_kv_heads != self.shape.num_kv_heads:
            raise ValueError(f"the retrieval head has {runtime.head.cfg.num_kv_heads} KV "
                             f"heads, the target {self.shape.num_kv_heads}: one selection per "
                             "target KV head needs them equal")
        self.runtime = runtime

    def buffers(self) -> dict[str, BufferSpec]:
        s, rows = self.shape, self.elastic.rows
        stage = BufferSpec((rows, s.num_kv_heads, s.head_dim), s.kv_dtype)
        return {"sel": BufferSpec((s.num_kv_heads, self.width), torch.int64, layers=1),
                "staged": BufferSpec((s.num_kv_heads, rows), torch.int64, fill=-1, layers=1),
                "k_stage": stage, "v_stage": stage}

    def new_state(self, prompt_len: int, slot: int) -> SpeContextState:
        self.slots.clear("staged", slot)  # a reused slot's rows hold another request's KV
        return SpeContextState(prompt_len, slot, seq_len=prompt_len)

    def _on_step(self, st: SpeContextState) -> RowStep:
        if self.cfg.use_exact(st.seq_len):
            st.sparse_before = False
            return EXACT_STEP
        return RowStep(Kind.SPARSE, st.seq_len - self.cfg.window)

    def select_pass(self, batch, rows: list[int]) -> torch.Tensor:
        if self.runtime is None:
            raise RuntimeError("specontext has no retrieval head attached")
        t0 = time.perf_counter()
        sel = self.runtime.select(batch, rows, self.cfg.budget, self.cfg.sink, self.cfg.window)
        head_s = time.perf_counter() - t0
        sts = [self.states[batch.rids[b]] for b in rows]
        slots = torch.tensor([s.slot for s in sts], dtype=torch.int64, device=sel.device)
        again = [i for i, s in enumerate(sts) if s.sparse_before]
        if again:
            i = torch.tensor(again, dtype=torch.int64, device=sel.device)
            last = self.slots.rows("sel", 0, slots.index_select(0, i))
            overlap = _overlap(sel.index_select(0, i), last)  # [A, Hkv]
            self.stats.overlap_sum += float(overlap.sum())
            self.stats.overlap_n += overlap.numel()
            if self.metrics is not None:
                self.metrics.observe_overlap(overlap.flatten().tolist())
        for s in sts:
            s.sparse_before = True
        self.slots.write("sel", 0, slots, sel)
        self.stats.selections += len(rows)
        if self.metrics is not None:
            self.metrics.observe_head(head_s)
        return sel

    def stage(self, batch, rows: list[int], sel: torch.Tensor) -> ElasticPass:
        """Plan the pass's elastic loads for the sparse ``rows`` (after ``select_pass``)."""
        dev = sel.device
        idx = torch.tensor(rows, dtype=torch.int64, device=dev)
        slots = torch.tensor([self.states[batch.rids[b]].slot for b in rows],
                             dtype=torch.int64, device=dev)
        ep = self.elastic.plan(self.slots.buffer("staged")[0], slots, sel,
                               batch.seq_lens_t.index_select(0, idx), batch.req_to_token,
                               batch.rows.index_select(0, idx), idx)
        self.stats.rows_loaded += ep.loaded
        self.stats.full_loads += ep.first
        if self.metrics is not None:
            self.metrics.observe_loads(ep.loaded / (len(rows) * self.shape.num_kv_heads))
        return ep

    def stage_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's staging K and V as pools of ``capacity * S`` slots."""
        s = self.shape
        return tuple(self.slots.buffer(n)[layer].view(-1, s.num_kv_heads, s.head_dim)
                     for n in ("k_stage", "v_stage"))


def _overlap(now: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """``[R, Hkv]`` fp32: |now & last| / width per row and KV head (both sorted rows)."""
    at = torch.searchsorted(last, now).clamp(max=last.shape[-1] - 1)
    return (last.gather(-1, at) == now).float().mean(-1)
