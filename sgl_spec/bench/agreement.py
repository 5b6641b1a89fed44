"""Greedy agreement of two servers' outputs for the same prompts, token by token.

Two greedy runs of one prompt agree until their first divergent output token.
Where they diverge, the top1 - top2 logprob margin each server computed at that
position (``chat_client.TurnResult.top_logprobs``) says whether the flip was a near
tie (floating-point sums in another order) or a real difference. Per turn
(``compare_turns``), counted (``counts``), and as tokens before the divergence
(``greedy_agreement``, ``agreement_summary``); ``figures`` is what results.json
holds per configuration and workload.

Pure functions over plain data (no server, no I/O), unit-tested; and one CLI that
compares two harness runs (before and after a change) row by row::

    python -m sgl_spec.bench.agreement BEFORE_DIR AFTER_DIR --out DIR

It reads each run's ``turns-<row>.json`` (the chat answers and long generations every
harness generation writes), pairs the rows by name and reports, per row and workload,
the turns answered identically, the divergences at a near tie (with their margins) and
the others. A row plays its own answers as history, so after a first divergence later
turns of that conversation may be sent other prompts (``same_prompts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple

from sgl_spec.bench.chat_client import TurnResult

# Largest top1-top2 logprob gap (nats) at which a greedy flip counts as a near tie.
# SGLang's lm_head returns bf16 logits, so margins come in bf16 steps: one ulp is
# 0.0625 nats for logits in [8, 16) and 0.125 in [16, 32). A flip one or two ulps
# apart is rounding (a batched flip at exactly 0.125 was seen); the real-server tests
# use the same threshold.
NEAR_TIE_NATS = 0.25


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (a prefix differs at its end);
    None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Agreement(NamedTuple):
    """``prefix``: reference tokens reproduced before the first divergence;
    ``share``: positions where both outputs hold the same token, over the longer length."""

    prefix: int
    share: float


def greedy_agreement(reference_ids: Sequence[int], candidate_ids: Sequence[int]) -> Agreement:
    """How far ``candidate_ids`` follows ``reference_ids`` (two greedy outputs for one
    prompt). Both empty: ``(0, 1.0)``; a strict prefix diverges where it ends."""
    pos = first_divergence(reference_ids, candidate_ids)
    longest = max(len(reference_ids), len(candidate_ids))
    if longest == 0:
        return Agreement(0, 1.0)
    same = sum(a == b for a, b in zip(reference_ids, candidate_ids))
    return Agreement(len(reference_ids) if pos is None else pos, same / longest)


def agreement_summary(agreements: Sequence[Agreement]) -> dict:
    """Counts and means over ``greedy_agreement`` results (one per prompt)."""
    n = len(agreements)
    if n == 0:
        return {"n": 0, "identical": 0, "mean_prefix": None, "min_prefix": None,
                "mean_share": None}
    return {
        "n": n,
        "identical": sum(a.share == 1.0 for a in agreements),
        "mean_prefix": sum(a.prefix for a in agreements) / n,
        "min_prefix": min(a.prefix for a in agreements),
        "mean_share": sum(a.share for a in agreements) / n,
    }


@dataclass(frozen=True)
class Divergence:
    """Where two greedy outputs for the same prompt first differ.

    ``position`` indexes the output tokens; the margins are top1 - top2 logprob
    (nats) at that position as each server saw it (None past the logprobs, i.e.
    at the final EOS). "reference" is the row agreement is measured against.
    """

    position: int
    reference_token: int | None  # None: that output ended here
    candidate_token: int | None
    reference_margin: float | None
    candidate_margin: float | None
    near_tie: bool


def margin(top: Sequence[Sequence[tuple[str, float]]], position: int) -> float | None:
    """top1 - top2 logprob at ``position``, from per-position top-2 lists."""
    if position >= len(top) or len(top[position]) < 2:
        return None
    return top[position][0][1] - top[position][1][1]


def divergence(reference: TurnResult, candidate: TurnResult,
               near_tie_nats: float = NEAR_TIE_NATS) -> Divergence | None:
    """The first divergence of two answers to one prompt; None when identical."""
    pos = first_divergence(reference.output_ids, candidate.output_ids)
    if pos is None:
        return None
    m_ref = margin(reference.top_logprobs, pos)
    m_cand = margin(candidate.top_logprobs, pos)
    known = [m for m in (m_ref, m_cand) if m is not None]

    def token(ids: Sequence[int]) -> int | None:
        return ids[pos] if pos < len(ids) else None

    return Divergence(
        position=pos,
        reference_token=token(reference.output_ids),
        candidate_token=token(candidate.output_ids),
        reference_margin=m_ref,
        candidate_margin=m_cand,
        near_tie=bool(known) and min(known) <= near_tie_nats,
    )


def compare_turns(reference: Sequence[TurnResult], candidate: Sequence[TurnResult],
                  near_tie_nats: float = NEAR_TIE_NATS) -> list[dict]:
    """Per turn: identical or not, and the divergence; pairs by (conversation, turn).
    Raises ValueError when ``candidate`` lacks a turn of ``reference``."""
    by_key = {(t.conversation, t.turn): t for t in candidate}
    out = []
    for a in reference:
        b = by_key.get((a.conversation, a.turn))
        if b is None:
            raise ValueError(f"the candidate has no result for {a.conversation} turn {a.turn}")
        div = divergence(a, b, near_tie_nats)
        out.append({
            "conversation": a.conversation,
            "turn": a.turn,
            "same_prompt": a.prompt_sha1 == b.prompt_sha1,
            "identical": div is None,
            "divergence": asdict(div) if div else None,
        })
    return out


def counts(comparisons: Sequence[dict]) -> dict:
    """Counts over ``compare_turns`` output; ``acceptable`` = identical or near tie."""
    n = len(comparisons)
    identical = sum(c["identical"] for c in comparisons)
    ties = sum(1 for c in comparisons if c["divergence"] and c["divergence"]["near_tie"])
    return {
        "turns": n,
        "identical": identical,
        "near_tie_divergences": ties,
        "other_divergences": n - identical - ties,
        "same_prompts": sum(c["same_prompt"] for c in comparisons),
        "acceptable": identical + ties == n,
    }


def figures(reference: Sequence[TurnResult], candidate: Sequence[TurnResult],
            near_tie_nats: float = NEAR_TIE_NATS) -> dict:
    """Greedy agreement of ``candidate`` with ``reference`` (the same prompts), per turn.

    ``counts``: identical turns, divergences at a near tie (top1-top2 margin up to
    ``near_tie_nats``) and others, and how many turns were sent the same prompt
    (a row that plays its own answers as history sends other prompts after a
    divergence). ``tokens``: tokens before the first divergence and share of matching
    positions. ``turns``: ``compare_turns``.
    """
    compared = compare_turns(reference, candidate, near_tie_nats)
    by_key = {(t.conversation, t.turn): t for t in candidate}
    tokens = [greedy_agreement(r.output_ids, by_key[(r.conversation, r.turn)].output_ids)
              for r in reference]
    return {"counts": counts(compared), "tokens": agreement_summary(tokens), "turns": compared}


def load_turns(path: str) -> dict[str, list[TurnResult]]:
    """A harness ``turns-<row>.json``: workload ("chat", "longgen") -> TurnResults."""
    import json

    with open(path) as f:
        data = json.load(f)
    out = {}
    for workload in ("chat", "longgen"):
        out[workload] = [TurnResult.from_json(t) for t in data.get(workload, [])]
    return out


def compare_runs(before_dir: str, after_dir: str) -> dict:
    """Per row present in both runs and workload: ``figures(before, after)``."""
    import glob
    import os

    rows = {}
    for path in sorted(glob.glob(os.path.join(before_dir, "turns-*.json"))):
        name = os.path.basename(path)
        other = os.path.join(after_dir, name)
        if not os.path.exists(other):
            continue
        before, after = load_turns(path), load_turns(other)
        rows[name[len("turns-"):-len(".json")]] = {
            w: figures(before[w], after[w]) for w in before if before[w]}
    if not rows:
        raise ValueError(f"no row's turns-*.json is in both {before_dir} and {after_dir}")
    return rows


def _min_margin(div: dict) -> float | None:
    known = [m for m in (div["reference_margin"], div["candidate_margin"]) if m is not None]
    return min(known) if known else None


def markdown(rows: dict) -> str:
    from sgl_spec.bench import render

    lines = []
    for row, per in rows.items():
        for workload, fig in per.items():
            c = fig["counts"]
            divs = [t["divergence"] for t in fig["turns"] if t["divergence"] and t["same_prompt"]]
            margins = ", ".join(f"{d['position']}: {render.num(_min_margin(d), digits=3)}"
                                for d in divs) or "-"
            lines.append([row, workload, str(c["turns"]), str(c["same_prompts"]),
                          str(c["identical"]), str(c["near_tie_divergences"]),
                          str(c["other_divergences"]), margins])
    head = ("Answers before vs after, per row: turns, turns sent the same prompt, "
            "identical answers, first divergences at a near tie (margin <= "
            f"{NEAR_TIE_NATS} nats) and others; margins (nats) at each first divergence "
            "of a same-prompt turn, as position: min(top1 - top2) of the two runs.")
    return "\n".join([head, "", *render.table(
        ["row", "workload", "turns", "same prompt", "identical", "near-tie", "other",
         "divergence margins"], lines)]) + "\n"


def main(argv: list[str] | None = None) -> None:
    from sgl_spec.bench import cli

    ap = cli.parser("python -m sgl_spec.bench.agreement", __doc__)
    ap.add_argument("before", help="a harness run's output directory (before the change)")
    ap.add_argument("after", help="a harness run's output directory (after the change)")
    cli.add_common(ap, out_required=False, out_default=None, model_path=False)
    args = ap.parse_args(argv)
    try:
        rows = compare_runs(args.before, args.after)
    except ValueError as e:
        ap.error(str(e))
    md = markdown(rows)
    if args.out:
        cli.write_results(args.out, rows, md)
    print(md)


if __name__ == "__main__":
    main()
