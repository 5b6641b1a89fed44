"""Exact match by query position pooled over several harness runs of one configuration
set (``python -m sgl_spec.bench --seed N``), so a gap of a few points is measured on
enough questions to be seen.

One preset holds 18 questions per position: a single question the sparse row loses is
5.6 points, so a 3-point line can only be met by losing none. Runs of the same set on
other seeds of the same preset ask other questions of the same shapes; pooled, 36
questions make one question 2.8 points. Each question a row answers differently from
the reference is listed with how its answer left the reference's: at a near tie (the
reference's own top1 - top2 margin at the first divergent token is under
``agreement.NEAR_TIE_NATS``), otherwise, or over a history its own earlier answer had
already changed::

    python -m sgl_spec.bench --configs C.toml --out results/lt-s1 --seed 1 ...
    python -m sgl_spec.bench.pool results/lt-s0 results/lt-s1 --out results/lt-pooled

Writes pool.json and pool.md; the checks are the first run's ``within_points``.
Pure functions over results.json (``pool``), unit-tested.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from sgl_spec.bench.dataset import POSITIONS
from sgl_spec.bench.results import position_deltas


def _row(results: dict, name: str) -> dict | None:
    return next((c for c in results["configs"] if c["name"] == name), None)


def _seed(results: dict) -> int | None:
    return ((results.get("dataset") or {}).get("config") or {}).get("seed")


def _how(div: dict | None) -> str:
    """How a changed answer left the reference's (its agreement entry)."""
    if div is None:
        return "unknown"
    if not div["same_prompt"]:
        return "history"  # an earlier answer of the row had changed the prompt
    d = div.get("divergence")
    if d is None:
        return "identical"  # same tokens, so the same EM: not expected here
    return "near_tie" if d["near_tie"] else "other"


def changes(row: dict, ref: dict, run: str) -> list[dict]:
    """The questions whose exact match differs between ``row`` and ``ref`` (one run)."""
    ref_em = {(t["conversation"], t["turn"]): t["exact_match"] for t in ref["turns"]}
    # agreement numbers a conversation's turns from 1, the scored turns from 0
    agree = {(t["conversation"], t["turn"] - 1): t
             for t in ((row.get("agreement") or {}).get("chat") or {}).get("turns", [])}
    out = []
    for t in row["turns"]:
        key = (t["conversation"], t["turn"])
        if key not in ref_em or ref_em[key] == t["exact_match"]:
            continue
        a = agree.get(key)
        d = (a or {}).get("divergence") or {}
        out.append({"run": run, "conversation": key[0], "turn": key[1] + 1,
                    "position": t["position"], "source": t.get("source"),
                    "change": "won" if t["exact_match"] else "lost", "how": _how(a),
                    "reference_margin": d.get("reference_margin"),
                    "prediction": t["prediction"]})
    return out


def pool(runs: Sequence[tuple[str, dict]]) -> dict:
    """``runs``: (label, results.json) of one configuration set on different datasets.
    Per row besides the reference: questions and exact match per position summed over
    the runs, the pooled gap in points, each run's gap, the changed questions, and the
    first run's ``within_points`` checks."""
    if len(runs) < 1:
        raise ValueError("pool needs at least one run")
    first = runs[0][1]
    ref_name = first["reference"]
    if ref_name is None:
        raise ValueError(f"{runs[0][0]}: a --url run has no reference row to pool against")
    datasets = {}
    for label, res in runs:
        if res["reference"] != ref_name:
            raise ValueError(f"{label}: reference row {res['reference']!r}, the first run's "
                             f"is {ref_name!r}: pool runs of one configuration set")
        key = json.dumps(res.get("dataset", {}).get("config"), sort_keys=True)
        if key in datasets:
            raise ValueError(f"{label} asks the same questions as {datasets[key]} (same "
                             "dataset): pool runs of different --seed")
        datasets[key] = label
    names = [c["name"] for c in first["configs"] if c["name"] != ref_name]
    within = (first.get("checks") or {}).get("within_points") or {}
    rows = {}
    for name in names:
        missing = [label for label, res in runs if _row(res, name) is None]
        if missing:
            rows[name] = {"missing_in": missing}
            continue
        n = dict.fromkeys(POSITIONS, 0)
        hits = {p: [0, 0] for p in POSITIONS}  # row, reference
        per_run, changed = [], []
        for label, res in runs:
            row, ref = _row(res, name), _row(res, ref_name)
            for p in POSITIONS:
                a = row["accuracy"]["by_position"].get(p) or {}
                b = ref["accuracy"]["by_position"].get(p) or {}
                k = a.get("n") or 0
                if k != (b.get("n") or 0):
                    raise ValueError(f"{label}: {name} has {k} {p} questions, "
                                     f"{ref_name} {b.get('n')}")
                n[p] += k
                hits[p][0] += round((a.get("exact_match") or 0) * k)
                hits[p][1] += round((b.get("exact_match") or 0) * k)
            per_run.append({"run": label, "seed": _seed(res),
                            "gap_points": position_deltas(row, ref)})
            changed += changes(row, ref, label)
        by_pos = {p: {"n": n[p], "exact_match": hits[p][0] / n[p] if n[p] else None,
                      "reference_exact_match": hits[p][1] / n[p] if n[p] else None,
                      "gap_points": 100.0 * (hits[p][0] - hits[p][1]) / n[p] if n[p] else None}
                  for p in POSITIONS}
        counts = {}
        for c in changed:
            k = f"{c['change']}_{c['how']}"
            counts[k] = counts.get(k, 0) + 1
        entry = {"by_position": by_pos, "runs": per_run, "changes": changed,
                 "change_counts": counts}
        tol = within.get(name)
        if tol is not None:
            gaps = [v["gap_points"] for v in by_pos.values()]
            entry["within_points"] = tol
            entry["pass"] = all(g is not None and g >= -tol - 1e-9 for g in gaps)
        rows[name] = entry
    return {"reference": ref_name, "runs": [label for label, _ in runs],
            "seeds": [_seed(res) for _, res in runs],
            "dataset_preset": first["meta"].get("dataset_preset"),
            "questions_per_position": {p: sum((_row(res, ref_name)["accuracy"]["by_position"]
                                               .get(p) or {}).get("n", 0) for _, res in runs)
                                       for p in POSITIONS},
            "rows": rows}


def markdown(pooled: dict) -> str:
    ref = pooled["reference"]
    qs = pooled["questions_per_position"]
    lines = [f"# Exact match pooled over {len(pooled['runs'])} runs "
             f"({pooled['dataset_preset']}, seeds {pooled['seeds']})", "",
             "Questions per position: " + ", ".join(f"{p} {qs[p]}" for p in POSITIONS)
             + f"; one question is {100 / max(min(qs.values()), 1):.1f} points.", "",
             f"| row | {' | '.join(f'{p} EM (gap)' for p in POSITIONS)} | per run gaps | "
             "lost: near tie / other / history | won | check |",
             f"|---|{'---|' * len(POSITIONS)}---|---|---|---|"]
    for name, r in pooled["rows"].items():
        if "missing_in" in r:
            lines.append(f"| {name} | not in {', '.join(r['missing_in'])} |")
            continue
        cells = []
        for p in POSITIONS:
            v = r["by_position"][p]
            cells.append("n/a" if v["gap_points"] is None else
                         f"{v['exact_match']:.3f} ({v['gap_points']:+.1f})")
        runs = "; ".join("/".join("n/a" if g is None else f"{g:+.1f}"
                                  for g in x["gap_points"].values()) for x in r["runs"])
        c = r["change_counts"]
        lost = " / ".join(str(c.get(f"lost_{k}", 0)) for k in ("near_tie", "other", "history"))
        won = sum(v for k, v in c.items() if k.startswith("won"))
        check = ("" if "pass" not in r else
                 f"within {r['within_points']:g}: {'PASS' if r['pass'] else 'FAIL'}")
        lines.append(f"| {name} | {' | '.join(cells)} | {runs} | {lost} | {won} | {check} |")
    lines += ["", f"EM is the row's, the gap is against {ref} in points. Per run gaps are "
              "begin/middle/end, one run per `;`.", "", "## Questions answered differently",
              "", "| row | run | conversation | turn | position | change | how | "
              "reference margin | answer |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in pooled["rows"].items():
        for c in r.get("changes", []):
            m = "" if c["reference_margin"] is None else f"{c['reference_margin']:.3f}"
            ans = c["prediction"].replace("|", "\\|").replace("\n", " ")[:60]
            lines.append(f"| {name} | {c['run']} | {c['conversation']} | {c['turn']} | "
                         f"{c['position']} | {c['change']} | {c['how']} | {m} | {ans} |")
    lines += ["", "how: `near_tie`, the first divergent token was a near tie in the "
              "reference's own logprobs; `other`, it was not; `history`, an earlier answer of "
              "the row had changed this turn's prompt."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sgl_spec.bench.pool",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="DIR",
                    help="harness output directories (results.json) of one configuration "
                    "set on different --seed")
    ap.add_argument("--out", required=True, metavar="DIR",
                    help="where pool.json and pool.md go")
    args = ap.parse_args(argv)
    runs = []
    for d in args.runs:
        path = os.path.join(d, "results.json")
        try:
            with open(path) as f:
                runs.append((os.path.basename(os.path.normpath(d)), json.load(f)))
        except (OSError, ValueError) as exc:
            ap.error(f"{path}: {exc}")
    try:
        pooled = pool(runs)
    except (ValueError, KeyError) as exc:
        ap.error(str(exc))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pool.json"), "w") as f:
        json.dump(pooled, f, indent=1)
    md = markdown(pooled)
    with open(os.path.join(args.out, "pool.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
