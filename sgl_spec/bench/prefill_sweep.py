"""Time to first token against new-turn length: stock sglang, sgl_spec exact, LoopServe prefill.

    python -m sgl_spec.bench.prefill_sweep --out results/prefill-sweep [--quick]

One server at a time (``CONFIGS``; the last row attends densely through the
sparse path, to tell the lines' saving from the dense kernel's). For each length
N (``SweepPlan.lengths``; the first is below ``--spec-prefill-min-tokens``, a check
that short turns cost the same): flush the cache, then send ``repeats`` fresh prompts of exactly N corpus
tokens (a different text per repeat, so nothing is cached) with
``max_new_tokens=1``; TTFT is the request latency. Medians over repeats; ratios
against ``stock`` (sglang's own server) and against ``sgl_spec exact`` (what the
lines save over sgl_spec's dense path), both measured in the same run and always
run whatever ``--rows`` says. Writes ``results.json``, ``results.md`` and
``prefill_ttft.png`` (the ratios against stock).

``--rounds R`` starts every row's server R times, interleaved (all rows, then all
rows again): a server process can run a few percent faster or slower than the
next one of the same code, so a single start per row cannot resolve a 5 %
difference. A point's TTFT is then the median of the requests of all its rounds.
``--rows`` times a subset (by slug; the two baselines are always kept).

``--history H``: each prompt is instead a new turn of N tokens after H tokens of
conversation already in the radix cache (the chat a user pastes a document into):
the first H tokens are sent and cached first, then the whole prompt is timed, so
the prefill is an extend of N tokens over a cached prefix of H.

Every server gets the harness's common flags (``--enable-metrics`` among them);
the ``sgl_spec:sparse_prefill_extends_total`` counters (read before and after
each point) say how many request-extends took the sparse path, so a point that
silently ran exact is visible.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

import requests

from sgl_spec.bench import cli, plots, provenance, sparse_counters, sweep, timing
from sgl_spec.bench.configset import ServerConfig
from sgl_spec.bench.render import num, spread_cell, table
from sgl_spec.bench.server import flush_cache

STOCK = "stock"
REFERENCE = "sgl_spec exact"
BASELINES: tuple[str, ...] = (STOCK, REFERENCE)  # always run; ratios against each
CONFIGS: tuple[ServerConfig, ...] = (
    ServerConfig(STOCK, "stock"),
    ServerConfig(REFERENCE, "sgl_spec", ("--spec-prefill", "exact")),
    ServerConfig("loopserve-prefill a=0.955", "sgl_spec",
                 ("--spec-prefill", "loopserve", "--spec-prefill-alpha", "0.955")),
    ServerConfig("loopserve-prefill a=0.97", "sgl_spec",
                 ("--spec-prefill", "loopserve", "--spec-prefill-alpha", "0.97")),
    ServerConfig("loopserve-prefill a=0.98", "sgl_spec",
                 ("--spec-prefill", "loopserve", "--spec-prefill-alpha", "0.98")),
    # The threshold row: 1024-token turns (below the default --spec-prefill-min-tokens
    # 2048) take the sparse path too, so the 1024 point says whether it would pay.
    ServerConfig("loopserve-prefill a=0.98, min-tokens 512", "sgl_spec",
                 ("--spec-prefill", "loopserve", "--spec-prefill-alpha", "0.98",
                  "--spec-prefill-min-tokens", "512")),
    # The reuse row: the same without seeding a turn's selection with the lines of
    # the cached sequence (the 1024-token history above is a sparse extend, so the
    # row above seeds every new turn).
    ServerConfig("loopserve-prefill a=0.98, min-tokens 512, no reuse", "sgl_spec",
                 ("--spec-prefill", "loopserve", "--spec-prefill-alpha", "0.98",
                  "--spec-prefill-min-tokens", "512", "--no-spec-prefill-reuse")),
    # The attribution row: every layer is "too dense", so the sparse path attends
    # densely (exact's call on a fresh extend, the fused history + causal split
    # over a prefix) and selects only on re-probes. What the rows above gain beyond
    # this one is the lines' own saving.
    ServerConfig("loopserve-prefill, no lines (max/skip density 1e-6)", "sgl_spec",
                 ("--spec-prefill", "loopserve", "--spec-prefill-alpha", "0.98",
                  "--spec-prefill-max-density", "1e-6",
                  "--spec-prefill-skip-density", "1e-6")),
)
PNG = "prefill_ttft.png"


@dataclass(frozen=True)
class SweepPlan:
    lengths: tuple[int, ...] = (1024, 2048, 4096, 6144)  # new-turn tokens
    repeats: int = 3
    seed: int = 0
    history: int = 0  # cached conversation tokens before each new turn
    rounds: int = 1  # server starts per row, interleaved

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 16:
            raise ValueError(f"lengths must be >= 16 tokens, got {self.lengths}")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        if self.history < 0:
            raise ValueError(f"--history must be >= 0, got {self.history}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")

    @classmethod
    def preset(cls, quick: bool, repeats: int | None = None,
               lengths: tuple[int, ...] | None = None, history: int = 0,
               rounds: int = 1) -> SweepPlan:
        default, r = ((1024, 4096), 1) if quick else ((1024, 2048, 4096, 6144), 3)
        return cls(lengths=tuple(lengths or default), repeats=r if repeats is None else repeats,
                   history=history, rounds=rounds)


def select_rows(slugs: list[str] | None) -> tuple[ServerConfig, ...]:
    """``CONFIGS`` whose slug is listed (all if None), the baselines always kept."""
    return sweep.select_rows(CONFIGS, slugs, BASELINES)


def pool_rounds(runs: list[dict]) -> dict:
    """One row's server runs (``run_config`` results, one per round) as one result:
    per point, the requests of every round and their median."""
    def point(per_round: list[dict]) -> dict:
        reqs = [q for pr in per_round for q in pr["requests"]]
        return {**per_round[0], "ttft_median_s": timing.median(q["ttft_s"] for q in reqs),
                "round_medians_s": [pr["ttft_median_s"] for pr in per_round],
                "cached_tokens_max": max(pr["cached_tokens_max"] for pr in per_round),
                "extends": sparse_counters.add([pr["extends"] for pr in per_round]),
                "requests": reqs}

    return sweep.pool(runs, point)


def build_prompts(tokenizer, plan: SweepPlan) -> dict[int, list[list[int]]]:
    """``repeats`` + 1 (a warm-up) different prompts of exactly ``history + n`` tokens
    per length ``n``."""
    from sgl_spec import corpus

    out = {}
    for n in plan.lengths:  # corpus text is <= its budget, within 2 %: ask a bit more
        total = n + plan.history
        docs = [corpus.document(tokenizer, int(total * 1.03) + 16,
                                seed=plan.seed + 1000 * n + i)
                for i in range(plan.repeats + 1)]
        out[n] = [tokenizer.encode(d, add_special_tokens=False)[:total] for d in docs]
        short = [len(p) for p in out[n] if len(p) != total]
        if short:
            raise ValueError(f"corpus prompts of {short} tokens, wanted {total}")
    return out


def first_token(url: str, ids: list[int]) -> dict:
    """One greedy /generate of one token; its latency is the TTFT."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    r, latency = timing.timed(lambda: requests.post(url + "/generate", json=body, timeout=600))
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return {"ttft_s": latency, "cached_tokens": meta.get("cached_tokens", 0)}


def parse_extends(text: str) -> dict[str, float]:
    """``sgl_spec:sparse_prefill_extends_total`` by path from /metrics text."""
    return sparse_counters.by_path(text, "sgl_spec:sparse_prefill_extends_total")


def _extends(url: str) -> dict[str, float]:
    return parse_extends(requests.get(url + "/metrics", timeout=30).text)


def _turn(url: str, prompt: list[int], history: int) -> dict:
    """Flush, cache the first ``history`` tokens (untimed), time the whole prompt."""
    flush_cache(url)
    if history:
        first_token(url, prompt[:history])
    return first_token(url, prompt)


def measure(url: str, prompts: list[list[int]], history: int = 0) -> dict:
    """One length: a warm-up prompt, then each timed prompt once (all distinct).

    The radix cache is flushed before every prompt: corpus prompts can share their
    first tokens, and an unplanned cached token would make the prompt an extend
    over a prefix (and shift the chunked prefill's split below
    ``--spec-prefill-min-tokens``). Only the planned ``history`` is cached."""
    _turn(url, prompts[0], history)
    before = _extends(url)
    reqs = [_turn(url, p, history) for p in prompts[1:]]
    after = _extends(url)
    extends = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after} or None
    return {"ttft_median_s": timing.median(r["ttft_s"] for r in reqs),
            "cached_tokens_max": max(r["cached_tokens"] for r in reqs),
            "extends": extends, "load_average": provenance.load_average(), "requests": reqs}


def run_config(cfg: ServerConfig, model: str, prompts: dict, plan: SweepPlan, out_dir: str,
               bar, round_index: int = 0) -> dict:
    bar.set_description(f"{cfg.name}: starting")
    with sweep.row_server(cfg, model, out_dir, round_index, plan.rounds) as (server, record):
        points: dict[str, dict] = {}
        for n in plan.lengths:
            bar.set_description(f"{cfg.name}: {n} tok")
            points[str(n)] = {"tokens": n, **measure(server.url, prompts[n], plan.history)}
            bar.update(1)
        record["points"] = points
    return record


def ratios(configs: list[dict], reference: str) -> dict[str, dict[str, float]]:
    """TTFT of each configuration / the reference's, per length."""
    by = {c["name"]: c["points"] for c in configs}
    if reference not in by:
        return {}
    return {name: sweep.point_ratios(pts, by[reference], "ttft_median_s")
            for name, pts in by.items() if name != reference}


def _length_table(lengths: list[str], rows: dict[str, dict], cell) -> list[str]:
    """A line per configuration, a column per new-turn length."""
    return table(["config", *(f"{n} tok" for n in lengths)],
                 [[name, *(cell(r.get(n)) for n in lengths)] for name, r in rows.items()])


def _ttft_cell(p: dict | None) -> str:
    if p is None:
        return "n/a"
    mark = "*" if ((p.get("extends") or {}).get("sparse", 0)) > 0 else ""
    return f"{num(p['ttft_median_s'], digits=3)}{mark}"


def markdown(res: dict) -> str:
    configs = res["configs"]
    lengths = [str(n) for n in res["plan"]["lengths"]]
    hist = res["plan"].get("history", 0)
    what = f"a new turn over {hist} cached tokens" if hist else "a fresh prompt"
    lines = [f"# TTFT of {what} vs its length (median, seconds)", "",
             *_length_table(lengths, {c["name"]: c["points"] for c in configs}, _ttft_cell),
             "", "`*`: sparse request-extends counted at that point.", ""]
    spreads = res.get("round_ratios") or {}
    for base, per_row in (res.get("ratios") or {}).items():
        lines += [f"## TTFT ratio vs {base}", "",
                  *_length_table(lengths, per_row, lambda r: num(r)), ""]
        if res["plan"].get("rounds", 1) > 1 and spreads.get(base):
            lines += [f"Per round (each round's median vs {base}'s same round), "
                      "min / median / max:", "",
                      *_length_table(lengths, spreads[base], spread_cell), ""]
    return "\n".join(lines)


def plot(res: dict, path: str) -> str:
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in res["ratios"].get(STOCK, {}).items():
        xs = sorted(int(n) for n in r)
        ax.plot(xs, [r[str(x)] for x in xs], marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    hist = res["plan"].get("history", 0)
    xlabel = (f"new-turn tokens (over {hist} cached)" if hist
              else "prompt tokens (fresh, uncached)")
    ax.set(xlabel=xlabel, ylabel=f"TTFT / {STOCK}",
           title="Sparse prefill: TTFT ratio")
    plots.finish_axes(ax, ylim_zero=False)
    return plots.save(fig, path)


def results(meta: dict, plan: SweepPlan, runs: dict[str, list[dict]]) -> dict:
    """results.json of a sweep: every row's rounds pooled, ratios and their spread."""
    configs = [pool_rounds(r) for r in runs.values()]
    return {"meta": meta, "plan": asdict(plan), "configs": configs,
            "ratios": {b: ratios(configs, b) for b in BASELINES},
            "round_ratios": {b: sweep.start_ratios(configs, b, "round_medians_s")
                             for b in BASELINES}}


def main(argv: list[str] | None = None) -> int:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.prefill_sweep", __doc__)
    cli.add_common(ap, quick="1k and 4k tokens, 1 repeat", repeats=cli.REPEATS_HELP,
                   rounds=cli.ROUNDS_HELP, rounds_default=1)
    ap.add_argument("--lengths", type=int, nargs="+", metavar="N",
                    help="new-turn token counts to time (default 1024 2048 4096 6144)")
    ap.add_argument("--history", type=int, default=0, metavar="H",
                    help="time a new turn after H cached conversation tokens (default 0: "
                         "a fresh prompt)")
    sweep.add_rows(ap, CONFIGS, BASELINES)
    args = ap.parse_args(argv)
    try:
        plan = SweepPlan.preset(args.quick, args.repeats, args.lengths, args.history,
                                args.rounds)
        rows = select_rows(args.rows)
    except ValueError as exc:
        ap.error(str(exc))
    return sweep.run(sys.modules[__name__], ap, args, plan, rows, plan.rounds,
                     len(plan.lengths), max(plan.lengths) + plan.history + 1)


if __name__ == "__main__":
    raise SystemExit(main())
