"""The markdown report of an evaluation run (``results.md``), from ``results.json``'s dict.

Pure functions; every table has one row per configuration, in the order of the
configuration file, so later rows (``loopserve B=512``) appear without code changes.
"""

from __future__ import annotations

from sgl_spec.bench.dataset import POSITIONS, SOURCES
from sgl_spec.bench.summary import bucket_order


def _fmt(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x * scale:.{digits}f}"


def _acc(summary: dict | None) -> str:
    """``EM (F1) n=N`` of a ``scoring.accuracy`` group."""
    if not summary or not summary.get("n"):
        return "-"
    return f"{summary['exact_match']:.2f} ({summary['f1']:.2f}) n={summary['n']}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def accuracy_table(configs: list[dict]) -> list[str]:
    header = ["configuration", "all", *POSITIONS, *(s.replace("_", " ") for s in SOURCES)]
    rows = []
    for c in configs:
        a = c["accuracy"]
        rows.append([c["name"], _acc(a["overall"]),
                     *(_acc(a["by_position"].get(p)) for p in POSITIONS),
                     *(_acc(a["by_source"].get(s)) for s in SOURCES)])
    return _table(header, rows)


def position_source_table(configs: list[dict]) -> list[str]:
    keys = [f"{p}/{s}" for p in POSITIONS for s in SOURCES]
    rows = [[c["name"], *(_acc(c["accuracy"]["by_position_source"].get(k)) for k in keys)]
            for c in configs]
    return _table(["configuration", *(k.replace("_turn", "") for k in keys)], rows)


def size_table(configs: list[dict]) -> list[str]:
    """Overall accuracy per conversation size, and the issue's solvability figure."""
    sizes = sorted({int(s) for c in configs for s in c["accuracy_by_size"]})
    rows = []
    for c in configs:
        e = c["end_this_turn_short"]
        by = c["accuracy_by_size"]
        rows.append([c["name"], *(_acc((by.get(str(s)) or {}).get("overall")) for s in sizes),
                     f"{_fmt(e['exact_match'])} (n={e['n']})"])
    limit = configs[0]["end_this_turn_short"]["max_history_tokens"] if configs else None
    return _table(["configuration", *(f"{s} tok/turn" for s in sizes),
                   f"end, this turn, history < {limit} tok"], rows)


def history_accuracy_table(configs: list[dict]) -> list[str]:
    buckets = [b for b in bucket_order() if any(b in c["accuracy_by_history"] for c in configs)]
    rows = [[c["name"], *(_acc((c["accuracy_by_history"].get(b) or {}).get("overall"))
                          for b in buckets)] for c in configs]
    return _table(["configuration", *buckets], rows)


def _agree_cells(a: dict | None) -> list[str]:
    if a is None:
        return ["-", "-", "-"]
    n, tok = a["counts"], a["tokens"]
    same = f"{n['identical']}/{n['turns']}"
    if n["identical"] != n["turns"]:
        same += f" ({n['near_tie_divergences']} near-tie)"
    return [same, _fmt(tok["mean_prefix"], digits=1), _fmt(tok["mean_share"], digits=3)]


def agreement_table(configs: list[dict], reference: str | None) -> list[str]:
    header = ["configuration", "chat answers identical", "chat tokens before divergence",
              "chat share", "long-gen identical", "long-gen tokens before divergence",
              "long-gen share"]
    rows = []
    for c in configs:
        if c["name"] == reference:
            rows.append([f"{c['name']} (reference)", *["-"] * 6])
            continue
        agree = c.get("agreement") or {}
        rows.append([c["name"], *_agree_cells(agree.get("chat")),
                     *_agree_cells(agree.get("longgen"))])
    return _table(header, rows)


def sparse_cell(counts: dict | None) -> str:
    """``sparse / all decode steps (share)`` of a ``sparse_counters.delta``; '-' for a
    server without sgl_spec's sparse-decode counters."""
    if counts is None:
        return "-"
    share = counts["sparse_share"]
    return (f"{counts['sparse_steps']}/{counts['decode_steps']}"
            f"{'' if share is None else f' ({share:.2f})'}")


def speed_table(configs: list[dict]) -> list[str]:
    header = ["configuration", "TTFT turn 1 (ms)", "TTFT turns >= 2 (ms)", "TPOT chat (ms)",
              "TPOT long-gen (ms)", "output tok/s long-gen", "cached tok / turn >= 2",
              "sparse decode steps chat", "sparse decode steps long-gen",
              "peak RSS (GiB)", "start (s)"]
    rows = []
    for c in configs:
        chat, lg = c["speed"]["chat"], c["speed"]["longgen"]
        srv = c.get("server") or {}
        rss = srv.get("peak_rss_bytes")
        sparse = c.get("sparse_decode") or {}
        rows.append([
            c["name"], _fmt(chat["ttft_turn1_mean_s"], 1e3, 0),
            _fmt(chat["ttft_later_mean_s"], 1e3, 0), _fmt(chat["tpot_median_s"], 1e3, 1),
            _fmt(lg["tpot_median_s"], 1e3, 1), _fmt(lg["output_tok_per_s"]),
            _fmt(chat["cached_tokens_later_mean"], digits=0),
            sparse_cell(sparse.get("chat")), sparse_cell(sparse.get("longgen")),
            _fmt(rss / 2**30 if rss else None), _fmt(srv.get("start_s"), digits=1),
        ])
    return _table(header, rows)


def history_table(configs: list[dict]) -> list[str]:
    buckets = [b for b in bucket_order() if any(b in c["speed_by_history"] for c in configs)]
    rows = []
    for b in buckets:
        row = [b]
        for c in configs:
            s = c["speed_by_history"].get(b)
            row.append("-" if s is None else
                       f"{_fmt(s['ttft_median_s'], 1e3, 0)} / {_fmt(s['tpot_median_s'], 1e3, 1)}"
                       f" (n={s['n']})")
        rows.append(row)
    return _table(["history (prompt tokens)", *(c["name"] for c in configs)], rows)


def stats_lines(stats: dict) -> list[str]:
    rows = [[k, str(v)] for k, v in stats.items()]
    return _table(["dataset", "value"], rows)


def markdown(results: dict) -> str:
    meta, configs = results["meta"], results["configs"]
    ref = results.get("reference")
    lines = [
        f"# Evaluation: {meta['configset']} ({meta['started']})", "",
        f"Model `{meta['model']}`; {len(configs)} configuration(s); dataset "
        f"{meta['dataset_preset']!r}, played with concurrency {meta['concurrency']}; "
        f"run time {meta['duration_s'] / 60:.1f} min.", "",
        "## Accuracy by query position and question source", "",
        "Exact match (F1 in brackets) and the number of questions.", "",
        *accuracy_table(configs), "",
        *position_source_table(configs), "",
        "## Accuracy by conversation size and by history length", "",
        *size_table(configs), "",
        "History length: the prompt's tokens at that turn (earlier turns included).", "",
        *history_accuracy_table(configs), "",
    ]
    if len(configs) > 1 or ref is not None:
        lines += [f"## Greedy agreement with `{ref}`", "",
                  "Each configuration plays its own answers as the chat history.", "",
                  *agreement_table(configs, ref), ""]
    lines += ["## Speed", "", *speed_table(configs), "",
              "Sparse decode steps: request decode steps that attended a KV subset / all "
              "decode steps, from the server's sgl_spec counters ('-': none exported, as "
              "for stock and exact mode).", "",
              "### TTFT / TPOT (ms, medians) by history length", "",
              *history_table(configs), "",
              "## Dataset", "", *stats_lines(results["dataset"]["stats"]), "",
              f"Long generation: {', '.join(results['longgen']['prompts'])}, up to "
              f"{results['longgen']['max_tokens']} tokens each.", ""]
    acc = results.get("acceptance")
    if acc:
        lines += ["## Checks", ""] + [f"- {k}: {v}" for k, v in acc.items()] + [""]
    return "\n".join(lines)
