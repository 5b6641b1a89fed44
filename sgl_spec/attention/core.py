"""sgl_spec's attention path, free of sglang: one plan per forward pass, one run per layer.

The integration's backend builds a ``BatchView`` in ``init_forward_metadata`` and
calls ``plan`` (once per pass, before the layers); each layer then writes its K/V and
makes one ``run`` call with the plan. The plan holds everything the layers
share: the decode subsets and policy row groups (``decode.Decoder``), the extend
spans, LoopServe's sparse extends with their seeds (``prefill.SparsePrefill``) and the
prompts a policy scores (SnapKV). A retrieval head (SpeContext) is told every pass's
token layout before the layers (``begin_pass``: the model's layer hooks then feed it)
and selects for the decoder's plan. Krul's estimator (``observe.KrulObserver``) plans
which query rows a pass observes and folds their attention into the conversation's
statistics after each layer. Round mode (``sgl_spec.rounds.runtime.RoundRuntime``, on a
layer-tiered pool) plans each pass's upper slots, selects rounds after the last lower
layer of an extend, and attends the upper layers itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_spec.requests import RequestHub

from .batch import BatchView
from .decode import DecodePlan, Decoder, ScoreRow
from .extend import Span, exact_extend, spans
from .observe import KrulObserver, ObservePlan
from .prefill import SparsePrefill, Turn


class ExtendPlan(NamedTuple):
    spans: list[Span]
    turns: dict[int, Turn]  # batch index -> its sparse prefill (LoopServe)
    scored: dict[int, ScoreRow]  # batch index -> its prompt the decode policy scores (SnapKV)


class AttentionPlan(NamedTuple):
    decode: DecodePlan | None = None
    extend: ExtendPlan | None = None
    observe: ObservePlan | None = None  # Krul's estimator: the rows this pass observes
    rounds: object | None = None  # round mode's RoundPlan (the upper layers' working sets)


class AttentionCore:
    """Not thread-safe: the scheduler thread that runs the forward pass owns it."""

    def __init__(self, decoder: Decoder, prefill: SparsePrefill | None = None, head=None,
                 observer: KrulObserver | None = None, hub: RequestHub | None = None,
                 rounds=None):
        self.decoder = decoder
        self.rounds = rounds  # sgl_spec.rounds.runtime.RoundRuntime or None
        self.prefill = prefill
        self.head = head  # sgl_spec.head.runtime.HeadRuntime or None
        self.observer = observer
        # SpeContext's layer offload (sgl_spec.integration.tiers.offload.PoolOffload),
        # set by the sglang backend with --spec-offload auto
        self.offload = None
        # what the radix cache shares with this path (sgl_spec.requests)
        self.hub = hub if hub is not None else (prefill.hub if prefill else RequestHub())

    @property
    def sparse_kv_from(self):
        """rid -> the first position a sparse decode step wrote, for the radix cache to
        cap checkpoints at (--spec-sparse-kv-cache drop); None: it keeps every output's KV."""
        return self.decoder.sparse_kv_from if self.decoder.tracks_sparse_kv else None

    def plan(self, batch: BatchView) -> AttentionPlan:
        self.hub.tick()  # unread seeds expire (requests aborted in the queue)
        if self.head is not None:
            self.head.begin_pass(batch)
        observe = self.observer.plan(batch) if self.observer is not None else None
        rounds = self.rounds.plan(batch) if self.rounds is not None else None
        if batch.mode == "decode":
            return AttentionPlan(decode=self.decoder.plan(batch), observe=observe,
                                 rounds=rounds)
        if batch.mode != "extend":
            self.decoder.pass_ended()
            return AttentionPlan()
        turns = self.prefill.plan(batch) if self.prefill is not None else {}
        scored = {r.index: r for r in self.decoder.plan_extend(batch)}
        return AttentionPlan(extend=ExtendPlan(spans(batch), turns, scored), observe=observe,
                             rounds=rounds)

    def run(
        self,
        plan: AttentionPlan,
        layer: int,
        q: torch.Tensor,  # [num_tokens, Hq, D] (decode: one token per request)
        k_buf: torch.Tensor,  # [num_slots, Hkv, D] this layer's pool, the pass's K written
        v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
        out: torch.Tensor,  # [num_tokens, Hq, Dv], written
        scale: float,
    ) -> torch.Tensor:
        """One layer of the pass the plan was made for (decode or extend)."""
        if plan.rounds is not None and self.rounds.tiers.is_upper(layer):
            return self._run_upper(plan, q, k_buf, v_buf, out, scale)
        if plan.decode is not None:
            out = self.decoder.run(plan.decode, layer, q, k_buf, v_buf, out, scale)
            if plan.observe is not None:
                self.observer.run(plan.observe, layer, q, k_buf, scale)
            return out
        ext = plan.extend
        for i, sp in enumerate(ext.spans):
            k, v = k_buf.index_select(0, sp.slots), v_buf.index_select(0, sp.slots)
            qi = q[sp.q_start : sp.q_end]
            turn = ext.turns.get(i)
            if turn is None:
                out[sp.q_start : sp.q_end] = exact_extend(qi, k, v, sp.prefix, scale)
            else:
                out[sp.q_start : sp.q_end] = self.prefill.extend(
                    turn, layer, qi, k, v, sp.prefix, scale,
                    lambda qi=qi, k=k, v=v, sp=sp: exact_extend(qi, k, v, sp.prefix, scale))
            r = ext.scored.get(i)
            if r is not None:  # the prompt a policy scores (SnapKV): the keys just gathered
                self.decoder.policy.prefill_layer(r.rid, layer, q[r.q_start : r.q_end], k)
        if plan.observe is not None:
            self.observer.run(plan.observe, layer, q, k_buf, scale,
                              lambda i: k_buf.index_select(0, ext.spans[i].slots))
        if plan.rounds is not None and plan.rounds.select_idx and \
                layer == self.rounds.select_layer:
            self.rounds.select_rounds(plan.rounds, ext.spans, q, k_buf, scale)
        return out

    def _run_upper(self, plan: AttentionPlan, q, k_buf, v_buf, out, scale) -> torch.Tensor:
        """An upper layer of a tiered pool (``k_buf``, ``v_buf``: its upper slots): every
        request attends its working set (round mode)."""
        if plan.decode is not None:
            return self.rounds.decode_upper(plan.rounds, q, k_buf, v_buf, out, scale,
                                            impl=self.decoder.impl)
        for i, sp in enumerate(plan.extend.spans):
            out[sp.q_start : sp.q_end] = self.rounds.extend_upper(
                plan.rounds, i, sp, q[sp.q_start : sp.q_end], k_buf, v_buf, scale)
        return out
