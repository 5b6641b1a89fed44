"""The markdown report of an evaluation run (``results.md``), from ``results.json``'s dict.

Pure functions; every table has one row per configuration, in the order of the
configuration file, so later rows (``loopserve B=512``) appear without code changes.
Speed chats and the serving run add a ratio row per configuration against the
baseline (the first row); divergent turns list the logit margins at the first
divergent token. Cells are formatted by ``render``.
"""

from __future__ import annotations

from sgl_spec.bench.dataset import POSITIONS, SOURCES
from sgl_spec.bench.render import num, ratio, table
from sgl_spec.bench.summary import bucket_order

# Divergent turns listed per configuration and workload; the rest are in results.json.
MAX_DIVERGENCES = 12


def _acc(summary: dict | None) -> str:
    """``EM (F1) n=N`` of a ``scoring.accuracy`` group."""
    if not summary or not summary.get("n"):
        return "-"
    return f"{summary['exact_match']:.2f} ({summary['f1']:.2f}) n={summary['n']}"


def accuracy_table(configs: list[dict]) -> list[str]:
    header = ["configuration", "all", *POSITIONS, *(s.replace("_", " ") for s in SOURCES)]
    rows = []
    for c in configs:
        a = c["accuracy"]
        rows.append([c["name"], _acc(a["overall"]),
                     *(_acc(a["by_position"].get(p)) for p in POSITIONS),
                     *(_acc(a["by_source"].get(s)) for s in SOURCES)])
    return table(header, rows)


def position_source_table(configs: list[dict]) -> list[str]:
    keys = [f"{p}/{s}" for p in POSITIONS for s in SOURCES]
    rows = [[c["name"], *(_acc(c["accuracy"]["by_position_source"].get(k)) for k in keys)]
            for c in configs]
    return table(["configuration", *(k.replace("_turn", "") for k in keys)], rows)


def size_table(configs: list[dict]) -> list[str]:
    """Overall accuracy per conversation size, and the issue's solvability figure."""
    sizes = sorted({int(s) for c in configs for s in c["accuracy_by_size"]})
    rows = []
    for c in configs:
        e = c["end_this_turn_short"]
        by = c["accuracy_by_size"]
        rows.append([c["name"], *(_acc((by.get(str(s)) or {}).get("overall")) for s in sizes),
                     f"{num(e['exact_match'])} (n={e['n']})"])
    limit = configs[0]["end_this_turn_short"]["max_history_tokens"] if configs else None
    return table(["configuration", *(f"{s} tok/turn" for s in sizes),
                   f"end, this turn, history < {limit} tok"], rows)


def history_accuracy_table(configs: list[dict]) -> list[str]:
    buckets = [b for b in bucket_order() if any(b in c["accuracy_by_history"] for c in configs)]
    rows = [[c["name"], *(_acc((c["accuracy_by_history"].get(b) or {}).get("overall"))
                          for b in buckets)] for c in configs]
    return table(["configuration", *buckets], rows)


def _agree_cells(a: dict | None) -> list[str]:
    if a is None:
        return ["-", "-", "-"]
    n, tok = a["counts"], a["tokens"]
    same = f"{n['identical']}/{n['turns']}"
    if n["identical"] != n["turns"]:
        same += f" ({n['near_tie_divergences']} near-tie)"
    return [same, num(tok["mean_prefix"], digits=1), num(tok["mean_share"], digits=3)]


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
    return table(header, rows)


def gap_table(configs: list[dict], reference: str | None, baseline: str | None
              ) -> list[str]:
    """Per row: exact match minus the reference's per position (points), greedy
    agreement on the QA chat, and QA-chat TTFT / TPOT against the baseline."""
    from sgl_spec.bench.results import position_deltas

    ref = next((c for c in configs if c["name"] == reference), None)
    rows = []
    for c in configs:
        deltas = position_deltas(c, ref) if ref is not None else {}
        agree = (c.get("agreement") or {}).get("chat")
        r = c.get("chat_ratio") or {}
        mark = " (other run)" if c.get("ratio_across_runs") else ""
        rows.append([c["name"], *("-" if (d := deltas.get(p)) is None else f"{d:+.1f}"
                                  for p in POSITIONS),
                     _agree_cells(agree)[0] if c is not ref else "(reference)",
                     *(ratio(r.get(k)) + (mark if r.get(k) is not None else "")
                       for k in ("ttft_turn1_mean_s", "ttft_later_mean_s", "tpot_median_s"))])
    return table(["configuration", *(f"EM gap {p} (pts)" for p in POSITIONS),
                  "answers identical", f"TTFT turn 1 / {baseline}",
                  f"TTFT turns >= 2 / {baseline}", f"TPOT / {baseline}"], rows)


def answer_timing_table(configs: list[dict]) -> list[str]:
    """Where the answers came and how much of the decoding before them was sparse."""
    rows = []
    for c in configs:
        t = c.get("answer_timing") or {"by_style": {}}
        cells = []
        for style in ("short", "long"):
            s = t["by_style"].get(style)
            cells.append("-" if not s else
                         f"{num(s['median_step'], digits=0)} (>= 24: "
                         f"{num(s['share_late'])}, n={s['answered']}/{s['n']})")
        share = t.get("sparse_share_before_answer")
        rows.append([c["name"], *cells,
                     f"{t.get('sparse_steps_before_answer', 0)}/"
                     f"{t.get('decode_steps_before_answer', 0)} ({num(share)})"])
    return table(["configuration", "short answers: median step", "long answers: median step",
                  "sparse / all decode steps before the answers"], rows)


def sparse_cell(counts: dict | None) -> str:
    """``sparse / all decode steps (share)`` of a ``sparse_counters.delta``; '-' for a
    server without sgl_spec's sparse-decode counters."""
    if counts is None:
        return "-"
    share = counts["sparse_share"]
    return (f"{counts['sparse_steps']}/{counts['decode_steps']}"
            f"{'' if share is None else f' ({share:.2f})'}")


def elastic_table(configs: list[dict]) -> list[str]:
    """specontext rows: elastic loading and the head, per workload ([] if none)."""
    rows = []
    for c in configs:
        for workload, d in (c.get("sparse_decode") or {}).items():
            if d and d.get("rows_loaded_per_step") is not None:
                rows.append([c["name"], workload, num(d["rows_loaded_per_step"], digits=1),
                             num(d.get("selection_overlap"), digits=3),
                             num(d.get("head_ms_per_pass"), digits=2)])
    if not rows:
        return []
    return table(["configuration", "workload", "rows loaded per step and KV head",
                  "overlap of consecutive selections", "head ms per pass"], rows)


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
            c["name"], num(chat["ttft_turn1_mean_s"], 1e3, 0),
            num(chat["ttft_later_mean_s"], 1e3, 0), num(chat["tpot_median_s"], 1e3, 1),
            num(lg["tpot_median_s"], 1e3, 1), num(lg["output_tok_per_s"]),
            num(chat["cached_tokens_later_mean"], digits=0),
            sparse_cell(sparse.get("chat")), sparse_cell(sparse.get("longgen")),
            num(rss / 2**30 if rss else None), num(srv.get("start_s"), digits=1),
        ])
    return table(header, rows)


def history_table(configs: list[dict]) -> list[str]:
    buckets = [b for b in bucket_order() if any(b in c["speed_by_history"] for c in configs)]
    rows = []
    for b in buckets:
        row = [b]
        for c in configs:
            s = c["speed_by_history"].get(b)
            row.append("-" if s is None else
                       f"{num(s['ttft_median_s'], 1e3, 0)} / {num(s['tpot_median_s'], 1e3, 1)}"
                       f" (n={s['n']})")
        rows.append(row)
    return table(["history (prompt tokens)", *(c["name"] for c in configs)], rows)


def _outputs_cell(agree: dict | None) -> str:
    if agree is None:
        return "-"
    if "requests" in agree:  # bench_serving: texts only, batched so not bit-stable
        return f"{agree['identical_texts']}/{agree['requests']} texts identical"
    n = agree["counts"]
    if n["identical"] == n["turns"]:
        return f"identical ({n['turns']}/{n['turns']})"
    return (f"{n['identical']}/{n['turns']} identical, {n['near_tie_divergences']} near-tie, "
            f"{n['other_divergences']} other")


# (figure, scale, decimals) of the speed-chat and serving tables; times shown in ms.
CHAT_CELLS = (("ttft_turn1_mean_s", 1e3, 0), ("ttft_later_mean_s", 1e3, 0),
              ("tpot_median_s", 1e3, 1), ("output_tok_per_s", 1, 2),
              ("cached_tokens_later_mean", 1, 0))
SERVING_CELLS = (("ttft_mean_s", 1e3, 0), ("ttft_median_s", 1e3, 0),
                 ("tpot_median_s", 1e3, 1), ("output_tok_per_s", 1, 2),
                 ("cached_tokens_total", 1, 0))


def _speed_rows(lead: list[str], row: str, figures: dict, entry: dict, cells,
                baseline: str | None, reference: str | None) -> list[list[str]]:
    """A configuration's figures, and its ratios to the baseline when it has them."""
    outputs = "reference" if row == reference else _outputs_cell(entry.get("agreement"))
    out = [[*lead, row, *(num(figures[k], sc, d) for k, sc, d in cells), outputs]]
    if "ratio" in entry:
        out.append([*lead, f"**{row} / {baseline}**",
                    *(ratio(entry["ratio"].get(k)) for k, _, _ in cells), ""])
    return out


def chats_table(configs: list[dict], baseline: str | None,
                reference: str | None = None) -> list[str]:
    """Per speed chat, a row per configuration and its ratio to the baseline."""
    header = ["chat", "configuration", "TTFT turn 1 (ms)", "TTFT turns >= 2 (ms, mean)",
              "TPOT (ms, median)", "output tok/s", "cached tok / turn >= 2",
              "outputs vs reference"]
    names = list(dict.fromkeys(n for c in configs for n in c.get("chats", {})))
    rows = [r for name in names for c in configs if name in c["chats"]
            for r in _speed_rows([name], c["name"], c["chats"][name]["summary"],
                                 c["chats"][name], CHAT_CELLS, baseline, reference)]
    return table(header, rows)


def serving_table(configs: list[dict], baseline: str | None,
                  reference: str | None = None) -> list[str]:
    header = ["configuration", "TTFT mean (ms)", "TTFT median (ms)", "TPOT median (ms)",
              "output tok/s", "cached tokens", "outputs vs reference"]
    rows = [r for c in configs if c.get("serving")
            for r in _speed_rows([], c["name"], c["serving"]["figures"], c["serving"],
                                 SERVING_CELLS, baseline, reference)]
    return table(header, rows)


def divergence_table(configs: list[dict], limit: int = MAX_DIVERGENCES) -> list[str]:
    """The first divergent token of every speed-chat turn (same prompts on every row)
    that differs from the reference's."""
    rows, left = [], 0
    for c in configs:
        for workload, entry in c.get("chats", {}).items():
            agree = entry.get("agreement")
            if agree is None:
                continue
            divs = [t for t in agree["turns"] if not t["identical"]]
            left += max(0, len(divs) - limit)
            for t in divs[:limit]:
                d = t["divergence"]
                rows.append([c["name"], workload, t["conversation"], str(t["turn"]),
                             str(d["position"]), str(d["reference_token"]),
                             str(d["candidate_token"]), num(d["reference_margin"], digits=3),
                             num(d["candidate_margin"], digits=3),
                             "yes" if d["near_tie"] else "no",
                             "yes" if t["same_prompt"] else "no"])
    if not rows:
        return []
    header = ["configuration", "workload", "conversation", "turn", "position",
              "reference token", "token", "reference margin", "margin", "near tie",
              "same prompt"]
    more = ["", f"({left} more divergent turns in results.json.)"] if left else []
    return [*table(header, rows), *more]


def stats_lines(stats: dict) -> list[str]:
    rows = [[k, str(v)] for k, v in stats.items()]
    return table(["dataset", "value"], rows)


def speed_chat_lines(results: dict) -> list[str]:
    """The speed chats, the serving run and the divergent speed-chat turns, if played."""
    configs, base, ref = results["configs"], results.get("baseline"), results.get("reference")
    lines = []
    if any(c.get("chats") for c in configs):
        lines += ["## Speed chats: chat over a document, growing context", "",
                  f"Every row after the first is sent `{configs[0]['name']}`'s answers as "
                  "the chat history, so all rows get the same prompts. Ratios are row / "
                  f"`{base}`, measured in the same run (below 1 is better for times, above 1 "
                  "for throughput).", "", *chats_table(configs, base, ref), ""]
    if any(c.get("serving") for c in configs):
        lines += ["## Serving (`sglang.bench_serving --dataset-name random-ids`)", "",
                  *serving_table(configs, base, ref), ""]
    divs = divergence_table(configs)
    if divs:
        lines += ["## Divergent speed-chat turns", "",
                  "Where a row's answer first differs from the reference's: the top1 - top2 "
                  "logprob margins (nats) there; a near tie is a margin up to "
                  f"{results.get('near_tie_nats', 'n/a')}.", "", *divs, ""]
    return lines


def reused_lines(results: dict) -> list[str]:
    """The rows ``--resume`` read back from earlier runs, with when and where played."""
    from sgl_spec.bench.results import played

    now = results["meta"]["started"]
    rows = [[c["name"], played(c),
             ((c["server"]["played"].get("git") or {}).get("commit") or "?")[:10]]
            for c in results["configs"] if played(c) not in (None, now)]
    if not rows:
        return []
    return ["Rows read back from earlier runs (`--resume`); their speed ratios compare "
            "runs played at different times (marked 'other run'):", "",
            *table(["configuration", "played", "commit"], rows), ""]


def markdown(results: dict) -> str:
    meta, configs = results["meta"], results["configs"]
    ref = results.get("reference")
    lines = [
        f"# Evaluation: {meta['configset']} ({meta['started']})", "",
        f"Model `{meta['model']}`; {len(configs)} configuration(s); dataset "
        f"{meta['dataset_preset']!r}, played with concurrency {meta['concurrency']}; "
        f"run time {meta['duration_s'] / 60:.1f} min.", "",
        *reused_lines(results),
        "## Accuracy by query position and question source", "",
        "Exact match (F1 in brackets) and the number of questions.", "",
        *accuracy_table(configs), "",
        *position_source_table(configs), "",
        "## Accuracy by conversation size and by history length", "",
        *size_table(configs), "",
        "History length: the prompt's tokens at that turn (earlier turns included).", "",
        *history_accuracy_table(configs), "",
    ]
    if ref is not None and len(configs) > 1:
        lines += ["## Gap to the reference, by position, with speed", "",
                  f"EM gap: exact match minus `{ref}`'s, in points; ratios against "
                  f"`{results.get('baseline')}` on the QA chat (mean TTFT, median TPOT).", "",
                  *gap_table(configs, ref, results.get("baseline")), ""]
    lines += ["## When the answers came", "",
              "Output tokens before the gold answer (median); decode steps before the "
              "answers that attended a KV subset, from each row's own --spec-* flags.", "",
              *answer_timing_table(configs), ""]
    if len(configs) > 1 or ref is not None:
        lines += [f"## Greedy agreement with `{ref}`", "",
                  "Each configuration plays its own answers as the chat history.", "",
                  *agreement_table(configs, ref), ""]
    elastic = elastic_table(configs)
    lines += ["## Speed", "", *speed_table(configs), "",
              "Sparse decode steps: request decode steps that attended a KV subset / all "
              "decode steps, from the server's sgl_spec counters ('-': none exported, as "
              "for stock and exact mode).", ""]
    if elastic:
        lines += ["### SpeContext: elastic loading", "",
                  "Rows loaded per step and KV head: positions copied into the staging "
                  "buffer (every layer the same), mean over sparse request-steps, the "
                  "first step's full gather included; overlap: |S_now & S_last| / B.", "",
                  *elastic, ""]
    lines += ["### TTFT / TPOT (ms, medians) by history length", "",
              *history_table(configs), "",
              *speed_chat_lines(results),
              "## Dataset", "", *stats_lines(results["dataset"]["stats"]), "",
              f"Long generation: {', '.join(results['longgen']['prompts'])}, up to "
              f"{results['longgen']['max_tokens']} tokens each.", ""]
    acc = results.get("acceptance")
    if acc:
        lines += ["## Checks", ""] + [f"- {k}: {v}" for k, v in acc.items()] + [""]
    return "\n".join(lines)
