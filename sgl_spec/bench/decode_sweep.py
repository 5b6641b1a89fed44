"""Decode speed against history length: stock sglang, sgl_spec exact, the sparse modes.

    python -m sgl_spec.bench.decode_sweep --out results/decode-sweep [--quick]
    python -m sgl_spec.bench.decode_sweep --out results/x --rows stock loopserve-B-1024 \\
        --histories 512 7168 --batches 1 --new-tokens 256 --repeats 2 --rounds 3

One server at a time (``CONFIGS``, or the ``--rows`` picked, ``sgl_spec exact`` always
kept; one row decodes exactly after a LoopServe sparse prefill; the sparse modes
``SPARSE_ROWS`` keep the same KV: B=1024, or StreamingLLM's sink + 1088). For each history
length and batch size: flush the cache, send each prompt once with
``max_new_tokens=1`` (its prefix is then cached, so prefill is excluded), then time
streamed /generate requests of N new tokens (greedy, ``ignore_eos``). Per request,
decode tok/s = (N - 1) / (latency - TTFT); a batch of 4 sends 4 different prompts of
the same length at once and sums them. Medians over repeats; ``--rounds R`` starts
each row's server R times, interleaved (``sweep``), and pools their repeats (one
server process can decode a few percent faster or slower than the next); the
per-start tables then give the spread (min / median / max over the starts) of every
row's tok/s against ``stock``'s and ``sgl_spec exact``'s same start, and against its
own tok/s at the shortest history. Writes ``results.json``, ``results.md`` (tok/s and
the ratios of ``RATIOS``) and ``decode_speed.png``.

Every server gets ``--enable-metrics`` (``configset.COMMON_FLAGS``) so that only a
row's own flags differ; loopserve's ``sgl_spec:decode_steps_total{path=...}`` counters
(``sparse_counters``, read before and after each point) say how many request-steps
attended a sparse subset. LoopServe decodes exactly before its first selection (step
16; sparse from the first step with ``--spec-prompt-seed``) and below
``--spec-min-context``. Every sgl_spec row also reports ``sgl_spec:decode_pass_seconds``
by path ("Decode pass time by path": the mean pass, and sparse and reselect passes over
the same server's exact pass, free of the drift between server starts).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import requests

from sgl_spec.bench import cli, plots, sparse_counters, sweep, timing
from sgl_spec.bench.configset import ServerConfig
from sgl_spec.bench.render import num, spread_cell, table
from sgl_spec.bench.server import flush_cache

STOCK = "stock"
EXACT = "sgl_spec exact"
LOOPSERVE = "loopserve B=1024"
LOOPSERVE_SEED = "loopserve B=1024 seeded"
PREFILL = "loopserve-prefill a=0.97"
SNAPKV = "snapkv B=1024"
STREAMING = "streaming B=1024"
SPECONTEXT = "specontext B=1024"
SPECONTEXT_THREAD = "specontext B=1024 thread"
CONFIGS: tuple[ServerConfig, ...] = (
    ServerConfig(STOCK, "stock"),
    ServerConfig(EXACT, "sgl_spec", ("--spec-mode", "exact")),
    ServerConfig(LOOPSERVE, "sgl_spec", ("--spec-mode", "loopserve", "--spec-budget", "1024")),
    # Its steps before the first selection on the prompt's seed, not dense.
    ServerConfig(LOOPSERVE_SEED, "sgl_spec", ("--spec-mode", "loopserve", "--spec-budget",
                                              "1024", "--spec-prompt-seed")),
    # Exact decode after a sparse prefill (histories >= 2048 are prefilled on the
    # lines): its decode must run as fast as sgl_spec exact's.
    ServerConfig(PREFILL, "sgl_spec",
                 ("--spec-prefill", "loopserve", "--spec-prefill-alpha", "0.97")),
    ServerConfig(SNAPKV, "sgl_spec", ("--spec-mode", "snapkv", "--spec-budget", "1024")),
    # The same KV as the others: sink + a 1088-position window (configs/sparse-decode.toml).
    ServerConfig(STREAMING, "sgl_spec",
                 ("--spec-mode", "streaming", "--spec-window", "1088", "--spec-budget", "1")),
    # The retrieval head trained for the model (prepared before the first start).
    ServerConfig(SPECONTEXT, "sgl_spec", ("--spec-mode", "specontext", "--spec-budget", "1024")),
    # Its elastic loads copied by a worker thread while the layers run (on CPU the
    # default, auto, copies in line): which is faster here is what this row measures.
    ServerConfig(SPECONTEXT_THREAD, "sgl_spec", ("--spec-mode", "specontext", "--spec-budget",
                                                 "1024", "--spec-prefetch", "thread")),
)
KEEP: tuple[str, ...] = (EXACT,)  # always run, whatever --rows says
SPARSE_ROWS: tuple[str, ...] = (LOOPSERVE, LOOPSERVE_SEED, SNAPKV, STREAMING, SPECONTEXT,
                                SPECONTEXT_THREAD)
RATIOS: tuple[tuple[str, str], ...] = (
    *((row, base) for row in SPARSE_ROWS for base in (STOCK, EXACT)),
    (LOOPSERVE_SEED, LOOPSERVE), (SPECONTEXT, LOOPSERVE), (SPECONTEXT_THREAD, SPECONTEXT),
    (EXACT, STOCK), (PREFILL, EXACT))
# Rows whose per-start ratios are tabulated against every other row's.
START_BASELINES: tuple[str, ...] = (STOCK, EXACT)
PNG = "decode_speed.png"
# Tokens after the LATE_FROM-th: past loopserve's first selection from decoded queries
# (decode step 16, the 17th token), the rate a long generation settles at; reported beside
# the rate over all N - 1 decode steps, which the ratios use.
LATE_FROM = 17


@dataclass(frozen=True)
class SweepPlan:
    histories: tuple[int, ...] = (1024, 2048, 4096, 7168)  # prompt tokens
    batches: tuple[int, ...] = (1, 4)
    new_tokens: int = 64
    repeats: int = 3
    seed: int = 0
    starts: int = 1  # server starts per row, interleaved (--rounds)

    def __post_init__(self) -> None:
        if not self.histories or min(self.histories) < 16:
            raise ValueError(f"histories must be >= 16 tokens, got {self.histories}")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be >= 1, got {self.batches}")
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be >= 2 (rate needs N-1 > 0), got "
                             f"{self.new_tokens}")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        if self.starts < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.starts}")

    @classmethod
    def preset(cls, quick: bool, repeats: int | None = None) -> SweepPlan:
        n, r = (24, 1) if quick else (64, 3)
        return cls(new_tokens=n, repeats=r if repeats is None else repeats)


def build_prompts(tokenizer, plan: SweepPlan) -> dict[int, list[list[int]]]:
    """``max(batches)`` different prompts of exactly ``h`` tokens per history ``h``."""
    from sgl_spec import corpus

    out = {}
    for h in plan.histories:  # corpus text is <= its budget, within 2 %: ask a bit more
        docs = [corpus.document(tokenizer, int(h * 1.03) + 16, seed=plan.seed + i)
                for i in range(max(plan.batches))]
        out[h] = [tokenizer.encode(d, add_special_tokens=False)[:h] for d in docs]
        short = [len(p) for p in out[h] if len(p) != h]
        if short:
            raise ValueError(f"corpus prompts of {short} tokens, wanted {h}")
    return out


def generate(url: str, ids: list[int], n: int) -> dict:
    """One streamed greedy /generate; client-side TTFT and latency in seconds."""
    body = {"input_ids": ids, "stream": True, "sampling_params":
            {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    watch = timing.Stopwatch()
    ttft, t_late, tokens = None, None, 0
    with requests.post(url + "/generate", json=body, stream=True, timeout=1200) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            tokens = json.loads(line[5:])["meta_info"]["completion_tokens"]
            if ttft is None and tokens >= 1:
                ttft = watch.elapsed()
            if t_late is None and tokens >= LATE_FROM:
                t_late, late_tokens = watch.elapsed(), tokens
    latency = watch.elapsed()
    if tokens != n or ttft is None:
        raise RuntimeError(f"asked for {n} tokens (ignore_eos), got {tokens}")
    late = None
    if t_late is not None and n > late_tokens and latency > t_late:
        late = (n - late_tokens) / (latency - t_late)
    return {"ttft_s": ttft, "latency_s": latency,
            "decode_tok_s": (n - 1) / (latency - ttft) if latency > ttft else None,
            "late_tok_s": late}


def decode_steps(url: str) -> tuple[dict[str, float], dict[str, list[float]]]:
    """``sgl_spec:decode_steps_total`` by path, and ``sgl_spec:decode_pass_seconds``'s
    [seconds, passes] by path (both empty when the server has none)."""
    text = sparse_counters.fetch(url)
    counts = None if text is None else sparse_counters.parse(text)
    steps = {} if counts is None else {"sparse": counts.sparse, "exact": counts.exact}
    return steps, {} if text is None else sparse_counters.passes(text)


def measure(url: str, prompts: list[list[int]], plan: SweepPlan) -> dict:
    """One point: prime every prompt's prefix, then ``repeats`` timed concurrent rounds."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        for p in prompts:  # one at a time: the prefills must not share a pass's timing
            generate(url, p, 1)
        before, passes_before = decode_steps(url)
        rounds = []
        for _ in range(plan.repeats):
            reqs = list(pool.map(lambda p: generate(url, p, plan.new_tokens), prompts))
            rates = [q["decode_tok_s"] for q in reqs]
            late = [q["late_tok_s"] for q in reqs]
            rounds.append({"requests": reqs, "aggregate_tok_s":
                           None if None in rates else sum(rates),
                           "aggregate_late_tok_s": None if None in late else sum(late)})
        after, passes_after = decode_steps(url)
    steps = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after} or None
    return summarize(rounds, steps, sparse_counters.pass_delta(passes_after, passes_before))


def summarize(rounds: list[dict], steps: dict[str, float] | None,
              passes: dict[str, list[float]] | None = None) -> dict:
    """A point's medians over its timed rounds (of one server, or pooled)."""
    from sgl_spec.bench import provenance

    return {"tok_s_median": timing.median(r["aggregate_tok_s"] for r in rounds),
            "late_tok_s_median": timing.median(r["aggregate_late_tok_s"] for r in rounds),
            "ttft_median_s": timing.median(q["ttft_s"] for r in rounds
                                           for q in r["requests"]),
            "decode_steps": steps, "sparse": None if steps is None else
            steps.get("sparse", 0.0) > 0, "passes": passes or None,
            "pass_ms": sparse_counters.pass_ms(passes) or None,
            "load_average": provenance.load_average(),
            "rounds": rounds}


def pool_starts(runs: list[dict]) -> dict:
    """One row's server starts (``run_config`` results) as one: per point, the timed
    rounds of every start, their medians, and each start's own median."""
    def point(per: list[dict]) -> dict:
        steps = sparse_counters.add([q["decode_steps"] for q in per])
        passes: dict[str, list[float]] = {}
        for q in per:
            for path, (sec, n) in (q.get("passes") or {}).items():
                passes[path] = [a + b for a, b in zip(passes.get(path, [0.0, 0.0]), (sec, n))]
        return {"history": per[0]["history"], "batch": per[0]["batch"],
                **summarize([r for q in per for r in q["rounds"]], steps, passes),
                "start_tok_s_medians": [q["tok_s_median"] for q in per]}

    return sweep.pool(runs, point)


def run_config(cfg: ServerConfig, model: str, prompts: dict, plan: SweepPlan, out_dir: str,
               bar, start: int = 0) -> dict:
    bar.set_description(f"{cfg.name}: starting")
    with sweep.row_server(cfg, model, out_dir, start, plan.starts) as (server, record):
        generate(server.url, prompts[plan.histories[0]][0][:32], 8)  # warm-up
        points: dict[str, dict] = {}
        for h in plan.histories:
            flush_cache(server.url)
            for b in plan.batches:
                bar.set_description(f"{cfg.name}: {h} tok x{b}")
                points[f"{h}x{b}"] = {"history": h, "batch": b,
                                      **measure(server.url, prompts[h][:b], plan)}
                bar.update(1)
        record["points"] = points
    return record


def ratios(configs: list[dict], key: str = "tok_s_median") -> dict[str, dict[str, float | None]]:
    by = {c["name"]: c["points"] for c in configs}
    out = {}
    for a, b in RATIOS:
        if a in by and b in by:
            out[f"{a} / {b}"] = sweep.point_ratios(by[a], by[b], key)
    return out


def history_ratios(configs: list[dict]) -> dict[str, dict[str, timing.Spread | None]]:
    """Per row and point: the spread over starts of its tok/s / its own tok/s at the
    shortest history (same batch, same start), how much speed a long history costs."""
    out = {}
    for c in configs:
        pts = c["points"]
        shortest = min(p["history"] for p in pts.values())
        out[c["name"]] = {k: timing.ratio_spread(
            p.get("start_tok_s_medians") or [],
            pts[f"{shortest}x{p['batch']}"].get("start_tok_s_medians") or [])
            for k, p in pts.items()}
    return out


def _tok_s(x: float | None) -> str:
    return num(x, digits=2)


def _ratio(x: float | None) -> str:
    return num(x, digits=3)


def _steps(s: dict | None) -> str:
    return "-" if s is None else f"{s.get('sparse', 0):.0f}/{sum(s.values()):.0f}"


def _point_table(configs: list[dict], columns: list[tuple[str, dict, object]]) -> list[str]:
    """One line per point (history, batch); ``columns``: (header, point key -> value,
    cell formatter)."""
    rows = [[str(p["history"]), str(p["batch"]), *(cell(values.get(key)) for _, values, cell
                                                   in columns)]
            for key, p in configs[0]["points"].items()]
    return table(["history", "batch", *(h for h, _, _ in columns)], rows)


def _field(configs: list[dict], field: str, names=None) -> list[tuple[str, dict, object]]:
    """A column of ``field`` per configuration (those in ``names`` if given)."""
    cell = _steps if field == "decode_steps" else _tok_s
    suffix = "sparse steps" if field == "decode_steps" else "tok/s"
    return [(f"{c['name']} {suffix}", {k: p.get(field) for k, p in c["points"].items()}, cell)
            for c in configs if names is None or c["name"] in names]


def markdown(res: dict) -> str:
    plan, configs, meta = res["plan"], res["configs"], res["meta"]
    ratio_cols = [(name, r, _ratio) for name, r in res["ratios"].items()]
    lines = [f"# Decode speed vs history ({meta['started']})", "",
             f"Model `{meta['model']}`; N={plan['new_tokens']} new tokens, median of "
             f"{plan['repeats']} repeat(s) x {plan.get('starts', 1)} server start(s); batch "
             "> 1: sum over concurrent requests; decode tok/s = (N-1)/(latency-TTFT), prefix "
             f"cached. Run time {meta['duration_s'] / 60:.1f} min; load "
             f"{meta['load_average_before']} -> {meta['load_average_after']}.", "",
             *_point_table(configs, [*_field(configs, "tok_s_median"), *ratio_cols,
                                     *_field(configs, "decode_steps", SPARSE_ROWS)]), "",
             "Sparse steps: request-steps that attended a sparse subset / all "
             "decode request-steps of the point (timed rounds).", ""]
    late = res.get("late_ratios")
    if late:
        lines += [f"## After loopserve's first reselection (tokens {LATE_FROM + 1}..N)", "",
                  f"Rate over the tokens after the {LATE_FROM}th (decode step 16 selects), "
                  "where a long generation spends its time; medians as above.", "",
                  *_point_table(configs, [*_field(configs, "late_tok_s_median"),
                                          *((n, r, _ratio) for n, r in late.items())]), ""]
    lines += pass_section(configs)
    spreads = [(f"`{base}`", f"each row's tok/s over `{base}`'s in the same round of "
                "server starts", per_row)
               for base, per_row in (res.get("start_ratios") or {}).items()]
    spreads.append(("the same row at the shortest history", "each server's tok/s at the "
                    "history over its own tok/s at the shortest history, same batch",
                    res.get("history_ratios") or {}))
    for what, how, per_row in spreads:
        if per_row:
            lines += [f"## Per server start: tok/s / {what}", "",
                      f"{how[0].upper()}{how[1:]}: min / median / max over the "
                      f"{plan.get('starts', 1)} start(s).", "",
                      *_point_table(configs, [(n, r, spread_cell) for n, r in per_row.items()]),
                      ""]
    return "\n".join(lines)


def pass_section(configs: list[dict]) -> list[str]:
    """Mean wall time of a decode pass by path, from each server's
    ``sgl_spec:decode_pass_seconds`` (timed rounds, starts pooled); empty without it."""
    from sgl_spec.attention.metrics import PASS_PATHS

    rows = []
    for key, p0 in configs[0]["points"].items():
        for c in configs:
            passes = c["points"].get(key, {}).get("passes") or {}
            if not passes:
                continue
            ms = sparse_counters.pass_ms(passes)
            cells = [f"{ms[p]:.1f} ({passes[p][1]:.0f})" if p in ms else "-"
                     for p in PASS_PATHS]
            every = sparse_counters.pass_ms({"all": [sum(v[i] for v in passes.values())
                                                     for i in (0, 1)]})
            # The other paths against the same server's exact passes: no drift between starts.
            rel = [_ratio(ms[p] / ms["exact"]) if p in ms and "exact" in ms else "-"
                   for p in PASS_PATHS[1:]]
            rows.append([str(p0["history"]), str(p0["batch"]), c["name"], *cells,
                         f"{every['all']:.1f}", *rel])
    if not rows:
        return []
    return ["## Decode pass time by path", "",
            ("Mean ms per decode pass (passes) from each server's "
             "`sgl_spec:decode_pass_seconds`: plan to the next decode pass's plan, the "
             "scheduler's whole iteration. exact: every row read its whole history; sparse: "
             "a KV subset; reselect: a subset, and the selection renewed. Timed rounds, "
             "starts pooled. The last columns divide by the same server's exact pass."), "",
            *table(["history", "batch", "row", *(f"{p} ms" for p in PASS_PATHS),
                    "all passes ms", *(f"{p} / exact" for p in PASS_PATHS[1:])], rows), ""]


def plot(res: dict, path: str) -> str:
    plt = plots.pyplot()
    batches = res["plan"]["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for c in res["configs"]:
            pts = [p for p in c["points"].values() if p["batch"] == b]
            ax.plot([p["history"] for p in pts], [p["tok_s_median"] for p in pts],
                    marker="o", label=c["name"])
        ax.set(xlabel="history (prompt tokens)", ylabel="decode tok/s (median)",
               title=f"batch {b}" + (" (sum over requests)" if b > 1 else ""))
    plots.finish_axes(*axes[0])
    return plots.save(fig, path)


def results(meta: dict, plan: SweepPlan, runs: dict[str, list[dict]]) -> dict:
    """results.json of a sweep: every row's starts pooled, ratios and spreads."""
    configs = [pool_starts(r) for r in runs.values()]
    return {"meta": meta, "plan": asdict(plan), "configs": configs, "ratios": ratios(configs),
            "late_ratios": ratios(configs, "late_tok_s_median"),
            "start_ratios": {b: sweep.start_ratios(configs, b, "start_tok_s_medians")
                             for b in START_BASELINES if any(c["name"] == b for c in configs)},
            "history_ratios": history_ratios(configs)}


def main(argv: list[str] | None = None) -> int:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.decode_sweep", __doc__)
    cli.add_common(ap, quick="N=24 tokens, 1 repeat", repeats=cli.REPEATS_HELP,
                   rounds=cli.ROUNDS_HELP)
    ap.add_argument("--histories", type=int, nargs="+", metavar="H",
                    help=f"history lengths in tokens (default: {SweepPlan.histories})")
    ap.add_argument("--batches", type=int, nargs="+", metavar="B",
                    help=f"batch sizes (default: {SweepPlan.batches})")
    ap.add_argument("--new-tokens", type=int, metavar="N",
                    help="tokens generated per request (default: 64; --quick 24)")
    sweep.add_rows(ap, CONFIGS, KEEP)
    args = ap.parse_args(argv)
    try:
        rows = sweep.select_rows(CONFIGS, args.rows, KEEP)
        over = {k: v for k, v in (("histories", args.histories), ("batches", args.batches),
                                  ("new_tokens", args.new_tokens), ("starts", args.rounds))
                if v is not None}
        plan = dataclasses.replace(SweepPlan.preset(args.quick, args.repeats), **{
            k: tuple(v) if isinstance(v, list) else v for k, v in over.items()})
    except ValueError as exc:
        ap.error(str(exc))
    return sweep.run(sys.modules[__name__], ap, args, plan, rows, plan.starts,
                     len(plan.histories) * len(plan.batches), max(plan.histories) + plan.new_tokens)


if __name__ == "__main__":
    raise SystemExit(main())
