"""Round mode on the attention path (Round Attention, Algorithm 1), free of sglang.

Per request, from the radix cache: the rounds stored on its matched path (``seed``:
a ``RoundHistory``; the cache matches no further than they reach). Per forward pass:

* ``plan``: every token the pass computes gets an upper slot (its upper-layer KV is
  written there); a decode pass builds the upper layers' subsets (``working_set.subsets``);
* at the last lower layer (L_w, 1-based), a request's first extend scores the stored
  rounds with its question's attention there (qAtt, after Eq. 1: the largest softmax
  probability of the question's last ``SCORE_QUERIES`` tokens on one of each round's keys,
  the largest over those queries, summed over heads: ``select.round_scores``),
  selects with the configured strategy (``select``), keeps round 0 (the system prompt)
  and loads the kept rounds' blocks into upper slots, one block copy per round
  (``select_rounds``); with fewer candidate rounds than ``min_rounds`` it keeps all of
  them (exact). With ``drop_after`` N > 0 (Sec. 3.4, opt-in) a round no selection kept
  for N questions in a row is dropped: its block freed, never a candidate again
  (``dropped_rounds``). Where the upper tier is full, the least important kept rounds are left
  out (of this request at its selection, of the request keeping the most tokens when a
  pass's new tokens need room), counted as ``trimmed_rounds``; only when the running
  requests' own tokens fill the tier does a pass fail (``CapacityError``);
* at the upper layers, extends and decodes attend the kept rounds and the request's own
  tokens (``extend_upper``, ``decode_upper``).

At a checkpoint sglang frees the request's slots of tokens the tree already held and points
its row at the tree's; ``rekey`` moves their upper slots along first (a freed full slot is
never left mapped, to be handed to a new token while a request reads it). Then the cache
``store``s the request's own tokens as blocks, one per round
(turn tags), and keeps the longer history on the nodes where each round ends. ``release``
(finish, abort, retraction) drops every upper slot the request holds. Not thread-safe:
the scheduler thread makes every call.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from sgl_spec.attention.batch import BatchView
from sgl_spec.attention.extend import exact_extend
from sgl_spec.kernels.sparse_decode import sparse_decode
from sgl_spec.tiers import blocks
from sgl_spec.tiers.pool import Tiers

from .history import RoundHistory, StoredRound
from .select import piece_peak, round_scores, select, strategy
from .working_set import kept_positions, subsets

logger = logging.getLogger(__name__)

SCORE_QUERIES = 64  # the question's last tokens whose attention at L_w scores the rounds
SEED_TTL = 8  # forward passes an unread seed is kept (a request aborted in the queue)
MAX_SEEDS = 4096
LAST_SELECTIONS = 32  # the newest selections GET /sgl_spec/cache shows (``last_selections``)


class CapacityError(RuntimeError):
    """The upper tier has too few free slots for a request's working set."""


@dataclass
class _Req:
    history: RoundHistory  # the stored rounds it may attend (its matched path's)
    own_start: int  # first position whose upper KV this request computes
    row: int  # its req_to_token row
    loaded: dict[int, torch.Tensor] = field(default_factory=dict)  # piece -> full slots held
    rank: list[int] = field(default_factory=list)  # kept rounds, least important first
    # its own tokens' full slots, per pass, from own_start (held too): those it wrote,
    # until a checkpoint points its row at the tree's slots of some (``rekey``)
    own: list[torch.Tensor] = field(default_factory=list)
    kept: list[int] | None = None  # indices into history.rounds (None: not selected yet)
    kept_pos: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    stored: list[StoredRound] = field(default_factory=list)  # its own rounds, stored
    rid: str = ""

    def own_full(self) -> torch.Tensor:
        """Full slots of positions own_start, own_start + 1, ... (this request's)."""
        if len(self.own) > 1:
            self.own = [torch.cat(self.own)]
        return self.own[0] if self.own else torch.empty(0, dtype=torch.int64)


class RoundPlan:
    """One pass: per batch index, its request; the upper rows its extend attends (filled
    at the first upper layer); a decode pass's subsets."""

    def __init__(self, reqs: list[_Req], select_idx: list[int], decode: bool):
        self.reqs, self.select_idx, self.decode = reqs, select_idx, decode
        self.rows: dict[int, torch.Tensor] = {}
        self.subsets = None


class RoundRuntime:
    def __init__(self, tiers: Tiers, strategy_name: str = "topk", recent: int = 1,
                 min_rounds: int = 4, drop_after: int = 0):
        self.tiers = tiers
        self.how = strategy(strategy_name)
        self.recent, self.min_rounds, self.drop_after = recent, min_rounds, drop_after
        self.select_layer = tiers.first_layer + tiers.split - 1  # L_w, 0-based
        self.states: dict[str, _Req] = {}
        self.seeds: OrderedDict[str, tuple[RoundHistory, int]] = OrderedDict()
        self._pass = 0
        self.req_to_token: torch.Tensor | None = None
        self.blocks: weakref.WeakSet = weakref.WeakSet()  # host blocks alive (tree-held)
        # what each selection saw and kept: {rid, rounds (the candidates), share (theirs;
        # None where the history had too few rounds: all kept), kept (rounds, round 0 too)}
        self.last_selections: deque[dict] = deque(maxlen=LAST_SELECTIONS)
        self.counts = {"selections": 0, "exact_selections": 0, "rounds_seen": 0,
                       "rounds_kept": 0, "tokens_seen": 0, "tokens_kept": 0,
                       "blocks_loaded": 0, "tokens_loaded": 0, "blocks_stored": 0,
                       "unstored_tokens": 0, "trimmed_rounds": 0, "dropped_rounds": 0,
                       "rekeyed_tokens": 0, "stale_slots": 0}

    # ---- from the radix cache ------------------------------------------------------
    def seed(self, rid: str, history: RoundHistory | None) -> None:
        self.seeds.pop(rid, None)
        self.seeds[rid] = (history or RoundHistory(), self._pass)
        while len(self.seeds) > MAX_SEEDS:
            self.seeds.popitem(last=False)

    def release(self, rid: str) -> None:
        self.seeds.pop(rid, None)
        st = self.states.pop(rid, None)
        if st is not None:
            for full in (*st.loaded.values(), *st.own):
                self.tiers.slots.drop(full)

    def idle(self) -> None:
        """No request runs or waits: drop the seeds of requests matched and then aborted
        in the queue (never planned, never released)."""
        self.seeds.clear()

    @property
    def live_states(self) -> int:
        return len(self.states)

    def store(self, rid: str, ids, up_to: int, fmt) -> list[tuple[int, RoundHistory]]:
        """Store the request's own tokens up to ``up_to`` as blocks, one per round of the
        turn tags (``fmt``: the served model's turn format; None: one round); returns
        ``(end, history)`` for each new round's last position, for the tree."""
        st = self.states.get(rid)
        if st is None or self.req_to_token is None:
            return []
        base = st.history.end
        lo = st.stored[-1].end if st.stored else st.own_start
        if base != st.own_start:  # a gap without upper KV: nothing to store contiguously
            self.counts["unstored_tokens"] += max(0, up_to - lo)
            return []
        if up_to <= lo or not st.own:
            return []
        own = st.own_full()
        out, hist = [], st.history.plus(st.stored)
        for rnd, s, e, turns in _pieces(ids, up_to, lo, fmt):
            full = own[s - st.own_start : e - st.own_start]
            up = self.tiers.slots.translate(full)
            if bool((up < 0).any()):  # not this request's to store (never happens)
                logger.error("round mode: positions %d-%d of %s have no upper slot", s, e, rid)
                break
            k, v = self.tiers.upper_bufs()
            block = blocks.store(k, v, up)
            self.blocks.add(block)
            piece = StoredRound(rnd, s, e, block)
            st.stored.append(piece)
            hist = hist.plus([piece])
            out.extend((t, hist) for t in turns)  # a history serves any prefix of it
            out.append((e, hist))
            self.counts["blocks_stored"] += 1
        return out

    def rekey(self, rid: str, row: torch.Tensor, up_to: int) -> None:
        """After a checkpoint of ``rid`` up to ``up_to`` (``row``: its ``req_to_token`` row
        now): where the row points at the tree's slot of a token the request computed in a
        slot of its own (which sglang freed), the token's upper slot follows the row."""
        st = self.states.get(rid)
        if st is None or not st.own:
            return
        own = st.own_full()
        n = min(own.numel(), up_to - st.own_start)
        if n <= 0:
            return
        tree = row[st.own_start : st.own_start + n].long()
        diff = torch.nonzero(own[:n] != tree).flatten()
        if diff.numel():
            self.tiers.slots.rekey(own[diff], tree[diff])
            own = own.clone()
            own[diff] = tree[diff]
            st.own = [own]
            self.counts["rekeyed_tokens"] += diff.numel()

    # ---- per pass ------------------------------------------------------------------
    def plan(self, batch: BatchView) -> RoundPlan | None:
        if batch.mode not in ("decode", "extend"):
            return None
        self._tick()
        self.req_to_token = batch.req_to_token
        decode = batch.mode == "decode"
        reqs, select_idx, at = [], [], 0
        for b, rid in enumerate(batch.rids):
            n = 1 if decode else batch.extend_lens[b]
            st = self.states.get(rid)
            if st is None:
                st = self._start(rid, batch.seq_lens[b] - n, batch.pool_rows[b])
            loc = batch.out_cache_loc[at : at + n].long().clone()  # sglang reuses its buffer
            at += n
            got = self.tiers.slots.acquire(loc)
            if got is None:
                self._make_room(n, rid)
                got = self.tiers.slots.acquire(loc)
                if got is None:  # _make_room raised otherwise
                    raise CapacityError("round mode: the upper tier's accounting is off")
            if not bool(got[1].all()):  # new tokens' slots are fresh: mapped ones are stale
                self._stale(loc[~got[1]], rid)
            st.own.append(loc)
            if st.kept is None:
                if st.history.rounds:
                    select_idx.append(b)
                else:
                    st.kept = []
            reqs.append(st)
        plan = RoundPlan(reqs, select_idx, decode)
        if decode:
            table = batch.req_to_token.index_select(0, batch.rows.cpu()).long()
            for b, st in enumerate(reqs):  # its own tokens: the slots it wrote (see _Req.own)
                own = st.own_full()
                table[b, st.own_start : st.own_start + own.numel()] = own
            plan.subsets = subsets(
                table, torch.arange(len(reqs)), batch.seq_lens_t.cpu(),
                [r.kept_pos for r in reqs],
                torch.tensor([r.own_start for r in reqs], dtype=torch.int64),
                self.tiers.slots, self.tiers.k_bufs[0].shape[1])
        return plan

    def _stale(self, full: torch.Tensor, rid: str) -> None:
        """Full slots sglang allocated to new tokens of ``rid`` that are still mapped: freed
        behind round mode's back (every known free is rekeyed first). Counted (the
        endpoint's ``stale_slots``, which the tests hold at 0) and logged; the new token
        then shares the old one's upper slot, as before ``rekey`` existed."""
        self.counts["stale_slots"] += full.numel()
        logger.error("round mode: %d new token slot(s) of %s are still mapped (a full slot "
                     "freed without a rekey)", full.numel(), rid)

    def _start(self, rid: str, prefix: int, row: int) -> _Req:
        hist, _ = self.seeds.pop(rid, (RoundHistory(), 0))
        hist = hist.upto(prefix)
        if hist.end < prefix:
            logger.warning("round mode: %s reuses %d cached tokens past its stored rounds "
                           "(%d): their upper layers are not attended", rid,
                           prefix - hist.end, hist.end)
        st = self.states[rid] = _Req(hist, prefix, row, rid=rid)
        return st

    def _tick(self) -> None:
        self._pass += 1
        cutoff = self._pass - SEED_TTL
        while self.seeds and next(iter(self.seeds.values()))[1] < cutoff:
            self.seeds.popitem(last=False)

    # ---- per layer -----------------------------------------------------------------
    def select_rounds(self, plan: RoundPlan, spans, q: torch.Tensor, k_buf: torch.Tensor,
                      scale: float) -> None:
        """At the last lower layer: choose and load the rounds of every request of the
        pass that has not selected yet (``spans``: the extend's, by batch index)."""
        for b in plan.select_idx:
            st, sp = plan.reqs[b], spans[b]
            rounds = st.history.rounds
            groups = st.history.groups()
            cands = [g for g in groups if g != 0 and not rounds[groups[g][0]].block.dropped]
            share = None
            if len(cands) < self.min_rounds:
                ranked = cands  # all of them, the oldest the least important
                self.counts["exact_selections"] += 1
            else:
                qi = q[max(sp.q_start, sp.q_end - SCORE_QUERIES) : sp.q_end]
                keys = k_buf.index_select(0, sp.slots)
                peak = piece_peak(qi, keys, [(r.start, r.end) for r in rounds], scale)
                share = round_scores(peak, [groups[g] for g in cands])
                share = share / share.sum().clamp_min(1e-30)
                picked = select(share, self.how, self.recent)
                ranked = [cands[i] for i in sorted(picked, key=lambda i: float(share[i]))]
            if self.drop_after:
                self._age(rounds, [groups[g] for g in cands], set(ranked))
            ranked = ranked + ([0] if 0 in groups else [])  # round 0 the most important
            st.rank = []
            for g in reversed(ranked):  # most important first; what does not fit is left
                if not self._load(st, {i: rounds[i] for i in groups[g]}):
                    self.counts["trimmed_rounds"] += 1
                    continue
                st.rank.insert(0, g)
            self._set_kept(st)
            self.last_selections.append({
                "rid": st.rid, "rounds": cands, "kept": sorted(st.rank),
                "share": None if share is None else [round(x, 5) for x in share.tolist()]})
            total = st.history.end
            c = self.counts
            c["selections"] += 1
            c["rounds_seen"] += len(groups)
            c["rounds_kept"] += len(st.rank)
            c["tokens_seen"] += total
            c["tokens_kept"] += st.kept_pos.numel()

    def _age(self, rounds, cands: list[list[int]], kept: set[int]) -> None:
        """Sec. 3.4: a candidate round (its pieces) this selection kept is fresh again;
        one it left ages a question, and is dropped once it reaches ``drop_after``."""
        for pieces in cands:
            group = [rounds[i].block for i in pieces]
            for block in group:
                block.unused = 0 if rounds[pieces[0]].round in kept else block.unused + 1
            if group[0].unused >= self.drop_after:
                for block in group:
                    block.drop()
                self.counts["dropped_rounds"] += 1

    def _set_kept(self, st: _Req) -> None:
        st.kept = sorted(st.loaded)
        rounds = st.history.rounds
        st.kept_pos = kept_positions([(rounds[i].start, rounds[i].end) for i in st.kept],
                                     range(len(st.kept)))

    def _make_room(self, n: int, rid: str) -> None:
        """Free ``n`` upper slots for request ``rid``'s new tokens by dropping the least
        important kept round of the running request that keeps the most tokens, round by
        round (counted: ``trimmed_rounds``); CapacityError naming the flag when the running
        requests' own tokens alone fill the tier."""
        slots = self.tiers.slots
        while slots.available() < n:
            holders = [st for st in self.states.values() if st.rank]
            if not holders:
                raise CapacityError(
                    f"round mode: {n} tokens of request {rid} need upper slots and the "
                    f"running requests' own tokens fill the upper tier ({self.tiers.upper} "
                    "slots); valid: a larger --spec-round-upper-tokens (0: the full pool's "
                    "size), or fewer concurrent requests (--max-running-requests)")
            st = max(holders, key=lambda r: r.kept_pos.numel())
            g = st.rank.pop(0)
            for i in [i for i in st.loaded if st.history.rounds[i].round == g]:
                slots.drop(st.loaded.pop(i))
            self._set_kept(st)
            self.counts["trimmed_rounds"] += 1
            logger.warning("round mode: the upper tier is full; a running request attends "
                           "one round fewer (--spec-round-upper-tokens sizes the tier)")

    def _load(self, st: _Req, pieces: dict[int, StoredRound]) -> bool:
        """Acquire and fill the upper slots of one round's pieces; False (nothing held)
        where the tier has too few free slots for them."""
        k, v = self.tiers.upper_bufs()
        fulls = {i: self.req_to_token[st.row, r.start : r.end].long() for i, r in pieces.items()}
        need = sum(int((~self.tiers.slots.mapped(f)).sum()) for f in fulls.values())
        if need > self.tiers.slots.available():
            return False
        for i, r in pieces.items():
            got = self.tiers.slots.acquire(fulls[i])
            st.loaded[i] = fulls[i]
            upper, new = got
            if bool(new.any()):  # rows another running request loaded are shared
                rows = torch.nonzero(new).flatten()
                blocks.load(r.block, k, v, upper[new], rows=rows)
                self.counts["blocks_loaded"] += 1
                self.counts["tokens_loaded"] += rows.numel()
        return True

    def extend_upper(self, plan: RoundPlan, b: int, sp, q: torch.Tensor,
                     k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float) -> torch.Tensor:
        """Request ``b``'s new queries at an upper layer: the kept rounds, then its own
        tokens (causal)."""
        rows = plan.rows.get(b)
        st = plan.reqs[b]
        if rows is None:
            full = torch.cat([self.req_to_token[st.row].index_select(0, st.kept_pos).long(),
                              st.own_full()[: sp.prefix + q.shape[0] - st.own_start]])
            rows = plan.rows[b] = self.tiers.upper_rows(full)
        k, v = k_buf.index_select(0, rows), v_buf.index_select(0, rows)
        return exact_extend(q, k, v, rows.numel() - q.shape[0], scale)

    def decode_upper(self, plan: RoundPlan, q, k_buf, v_buf, out, scale, impl=None,
                     check=False):
        return sparse_decode(q, k_buf, v_buf, plan.subsets, scale=scale, impl=impl, out=out,
                             check=check)

    # ---- reporting -----------------------------------------------------------------
    def totals(self) -> dict:
        """The pool's tiers and what round mode did, for GET /sgl_spec/cache."""
        t, s = self.tiers, self.tiers.slots
        host = sum(b.nbytes for b in list(self.blocks))
        c = self.counts
        return {
            "watershed": self.select_layer + 1, "layers": t.first_layer + t.num_layers,
            "lower_slots": t.full_rows, "upper_slots": t.upper,
            "upper_slots_used": s.used(), "working_sets": len(self.states),
            "device_bytes": t.device_bytes(), "token_bytes": t.token_bytes(),
            "host_blocks": len(self.blocks), "host_bytes": host,
            "kept_share": c["tokens_kept"] / c["tokens_seen"] if c["tokens_seen"] else None,
            **c, "last_selections": list(self.last_selections),
        }


def _pieces(ids, up_to: int, lo: int, fmt) -> list[tuple[int, int, int, list[int]]]:
    """(round, start, end, turn ends inside it) of the rounds in positions [lo, up_to) of
    ``ids``: the tree cuts its nodes at turns, so a history is kept at every turn's end
    (a later request that branches inside a turn finds the rounds before it)."""
    if fmt is None:
        return [(0, lo, up_to, [])]
    from sgl_spec.cache.segment import segment

    out: list[list] = []
    for sp in segment(ids[:up_to], fmt):
        s, e = max(sp.start, lo), min(sp.end, up_to)
        if s >= e:
            continue
        if out and out[-1][0] == sp.tag.round and out[-1][2] == s:
            out[-1][3].append(s)
            out[-1][2] = e
        else:
            out.append([sp.tag.round, s, e, []])
    return [tuple(p) for p in out]
