"""``results.json`` of an evaluation run: every row's figures, comparisons and checks.

``build`` turns the runs of ``runner`` (one ``ConfigRun`` per row) into one document:

* per row, its own figures (``summary.config_figures``: accuracy, speed);
* greedy agreement with the reference row on every workload played
  (``agreement.figures``): chat dataset, long generation, speed chats, and the
  serving texts;
* speed ratios against the baseline, the first row, measured in the same run: per
  speed chat (``summary.summarize_turns``) and for the serving row;
* the checks (``acceptance``): the reference solves the dataset, per-position
  accuracy against the reference (``[checks.within_points]``), identical outputs,
  and follow-up TTFT against the baseline (``[checks.followup_speedup]``).

``write`` writes it with ``results.md`` (``tables``) and the plots (``plots``).
Pure apart from ``write``; unit-tested on synthetic runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import NamedTuple

from sgl_spec.bench import agreement, chats, summary
from sgl_spec.bench.chat_client import TurnResult
from sgl_spec.bench.dataset import POSITIONS, Conversation, DatasetConfig
from sgl_spec.bench.plan import RunPlan

SOLVABLE_EM = 0.5  # the bar for end-position, this-turn questions


class ConfigRun(NamedTuple):
    """What one configuration answered; ``server`` is None for a URL run."""

    name: str
    config: dict | None  # asdict(ServerConfig)
    server: dict | None
    chat: list[TurnResult]
    longgen: list[TurnResult]
    # workload -> sparse_counters.delta (None: the server exports no such counters)
    sparse: dict[str, dict | None] | None = None
    chats: dict[str, list[TurnResult]] | None = None  # speed chat name -> its turns
    serving: dict | None = None  # serving.figures


def _speed_chats(run: ConfigRun, base: ConfigRun | None, ref: ConfigRun | None) -> dict:
    out = {}
    for name, turns in (run.chats or {}).items():
        entry = {"summary": asdict(summary.summarize_turns(turns))}
        if base is not None and run is not base:
            other = asdict(summary.summarize_turns(base.chats[name]))
            entry["ratio"] = summary.ratios(entry["summary"], other)
        if ref is not None and run is not ref:
            entry["agreement"] = agreement.figures(ref.chats[name], turns)
        out[name] = entry
    return out


def _serving(run: ConfigRun, base: ConfigRun | None, ref: ConfigRun | None) -> dict | None:
    if run.serving is None:
        return None
    entry = {"figures": run.serving}
    if base is not None and run is not base:
        entry["ratio"] = summary.ratios(run.serving, base.serving)
    if ref is not None and run is not ref:
        mine, theirs = run.serving["generated_texts"], ref.serving["generated_texts"]
        entry["agreement"] = {"requests": len(theirs),
                              "identical_texts": sum(a == b for a, b in zip(theirs, mine))}
    return entry


def _first_sparse(run: ConfigRun):
    """The row's ``DecodeConfig.first_sparse_step``; None for stock or URL rows."""
    from sgl_spec.bench.configset import ServerConfig

    spec = ServerConfig(**run.config).spec() if run.config else None
    return None if spec is None or spec.disable else spec.decode.first_sparse_step


def build(meta: dict, dataset_config: DatasetConfig, convs: Sequence[Conversation],
          plan: RunPlan, runs: Sequence[ConfigRun], reference: str | None,
          within_points: dict[str, float] | None = None,
          followup_speedup: dict[str, float] | None = None) -> dict:
    """``results.json``: every figure of every configuration, in run order. Speed ratios
    are against ``runs[0]``, agreement against the run named ``reference``; the two
    dicts are the set's per-row checks (``configset.ConfigSet``)."""
    from sgl_spec.bench import dataset

    ref = next((r for r in runs if r.name == reference), None) if reference else None
    base = runs[0] if len(runs) > 1 else None
    configs = []
    for run in runs:
        entry = {"name": run.name, "config": run.config, "server": run.server,
                 **summary.config_figures(summary.score_conversations(convs, run.chat),
                                          run.longgen, _first_sparse(run)),
                 "sparse_decode": run.sparse or {"chat": None, "longgen": None},
                 "chats": _speed_chats(run, base, ref), "serving": _serving(run, base, ref)}
        if ref is not None and run is not ref:
            entry["agreement"] = {"chat": agreement.figures(ref.chat, run.chat),
                                  "longgen": agreement.figures(ref.longgen, run.longgen)}
        configs.append(entry)
    for entry in configs[1:] if base is not None else ():
        entry["chat_ratio"] = summary.ratios(entry["speed"]["chat"], configs[0]["speed"]["chat"])
        entry["ratio_across_runs"] = played(entry) != played(configs[0])
    results = {
        "meta": meta,
        "dataset": {"config": asdict(dataset_config), "stats": dataset.stats(list(convs))},
        "longgen": {"prompts": list(plan.longgen), "max_tokens": plan.longgen_max_tokens},
        "chats": {n: asdict(chats.preset(n)) for n in plan.chats},
        "serving": None if plan.serving_config is None else asdict(plan.serving_config),
        "reference": reference,
        "baseline": base.name if base else None,
        "near_tie_nats": agreement.NEAR_TIE_NATS,
        "checks": {"within_points": dict(within_points or {}),
                   "followup_speedup": dict(followup_speedup or {})},
        "configs": configs,
    }
    results["acceptance"] = acceptance(results)
    return results


def played(entry: dict) -> str | None:
    """When the row's run started (``runner.side_by_side``); a row that ``--resume``
    read back keeps the time of the run that played it."""
    return ((entry.get("server") or {}).get("played") or {}).get("started")


def position_deltas(row: dict, ref: dict) -> dict[str, float | None]:
    """Exact match of ``row`` minus the reference's, in points (0-100), per query
    position; None where either has no question at that position."""
    out = {}
    for p in POSITIONS:
        a, b = row["accuracy"]["by_position"].get(p), ref["accuracy"]["by_position"].get(p)
        ok = a and b and a.get("n") and b.get("n")
        out[p] = 100.0 * (a["exact_match"] - b["exact_match"]) if ok else None
    return out


def position_check(row: dict, ref: dict, tolerance: float | None) -> str:
    """The per-position deltas as text, with PASS/FAIL against ``tolerance`` points."""
    deltas = position_deltas(row, ref)
    text = ", ".join(f"{p} {'n/a' if d is None else f'{d:+.1f}'}" for p, d in deltas.items())
    if tolerance is None:
        return f"{text} points"
    ok = all(d is not None and d >= -tolerance - 1e-9 for d in deltas.values())
    return f"{text} points (need >= {-tolerance:g} each): {'PASS' if ok else 'FAIL'}"


def _solvable(c: dict) -> tuple[str, str]:
    e = c["end_this_turn_short"]
    em = e["exact_match"]
    if em is None:  # the dataset has no such question (e.g. only long turns)
        verdict = "n/a (no such question in this dataset)"
    else:
        verdict = "PASS" if em >= SOLVABLE_EM else "FAIL"
    return (f"{c['name']}: end-position this-turn EM, history < {e['max_history_tokens']} "
            f"tokens", f"{'n/a' if em is None else f'{em:.2f}'} of {e['n']} questions "
            f"(need >= {SOLVABLE_EM}): {verdict}")


def _followups(c: dict, base: dict, ref_name: str | None, need: float | None) -> dict[str, str]:
    """Follow-up TTFT over a cached document against the baseline row ``base``, per doc
    chat, and whether the outputs agree (identical or near tie) with the other of the
    pair row / reference (the reference's own entry has none: it is the baseline's)."""
    out = {}
    for name, entry in c.get("chats", {}).items():
        r = (entry.get("ratio") or {}).get("ttft_later_mean_s")
        if not chats.preset(name).follow_ups or r is None:
            continue
        agree = entry.get("agreement") or base["chats"][name].get("agreement")
        text = f"{1 / r:.2f}x faster than {base['name']}" if r else "n/a"
        if agree:
            n = agree["counts"]
            other = base["name"] if c["name"] == ref_name else ref_name
            text += (f"; outputs identical to {other} or near-tie "
                     f"{n['identical'] + n['near_tie_divergences']}/{n['turns']}")
        if need is not None:
            ok = bool(r) and 1 / r >= need and (not agree or agree["counts"]["acceptable"])
            text += f" (need >= {need:g}x): {'PASS' if ok else 'FAIL'}"
        out[f"{c['name']}: {name} TTFT of turns >= 2"] = text
    return out


def acceptance(results: dict) -> dict:
    """The issue's checks: the reference solves the dataset, every other row's
    exact-match change against it per query position (PASS/FAIL for the rows of
    ``checks.within_points``), whether each row agrees with it on every answer (a row
    is not expected to agree unless it is exact), and follow-up TTFT against the
    baseline (PASS/FAIL for the rows of ``checks.followup_speedup``)."""
    ref_name, base_name = results["reference"], results.get("baseline")
    checks = results.get("checks") or {}
    within = checks.get("within_points") or {}
    speedup = checks.get("followup_speedup") or {}
    ref = next((c for c in results["configs"] if c["name"] == ref_name), None)
    base = next((c for c in results["configs"] if c["name"] == base_name), None)
    out = {}
    for c in results["configs"]:
        if c["name"] == ref_name or ref_name is None:
            key, value = _solvable(c)
            out[key] = value
        if ref is not None and c is not ref:
            tol = within.get(c["name"])
            key = (f"{c['name']}: exact match vs {ref_name} by query position" if tol is None
                   else f"{c['name']}: exact match within {tol:g} points of {ref_name} at "
                   f"every query position")
            out[key] = position_check(c, ref, tol)
        agree = c.get("agreement")
        if agree:
            chat, lg = agree["chat"]["counts"], agree["longgen"]["counts"]
            out[f"{c['name']}: identical to {ref_name}"] = (
                f"chat {chat['identical']}/{chat['turns']}, long-gen "
                f"{lg['identical']}/{lg['turns']}")
        if base is not None and c is not base:
            out.update(_followups(c, base, ref_name, speedup.get(c["name"])))
    return out


def write(results: dict, out_dir: str) -> list[str]:
    """results.json, results.md and the plots; returns the paths written."""
    from sgl_spec.bench import cli, plots, tables

    paths = cli.write_results(out_dir, results, tables.markdown(results))
    return [*paths, *plots.write_plots(results, out_dir)]
