"""Time to first token against new-turn length: sgl_spec exact vs LoopServe sparse prefill.

    python -m sgl_spec.bench.prefill_sweep --out results/prefill-sweep [--quick]

One server at a time (``CONFIGS``; the last row attends densely through the
sparse path, to tell the lines' saving from the dense kernel's). For each length
N (``SweepPlan.lengths``; the first is below ``--spec-prefill-min-tokens``, a check
that short turns cost the same): flush the cache, then send ``repeats`` fresh prompts of exactly N corpus
tokens (a different text per repeat, so nothing is cached) with
``max_new_tokens=1``; TTFT is the request latency. Medians over repeats; ratios
against ``sgl_spec exact`` measured in the same run. Writes ``results.json``,
``results.md`` and ``prefill_ttft.png``.

``--rounds R`` starts every row's server R times, interleaved (all rows, then all
rows again): a server process can run a few percent faster or slower than the
next one of the same code, so a single start per row cannot resolve a 5 %
difference. A point's TTFT is then the median of the requests of all its rounds.
``--rows`` times a subset (by slug; the reference is always kept).

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

import argparse
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass

import requests

from sgl_spec.bench import configset, provenance, sparse_counters
from sgl_spec.bench.configset import ServerConfig
from sgl_spec.bench.server import ServerProcess, ServerStartError

logger = logging.getLogger(__name__)

REFERENCE = "sgl_spec exact"
CONFIGS: tuple[ServerConfig, ...] = (
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
SWEEP_FLAGS: tuple[str, ...] = ("--sleep-on-idle",)  # after configset.COMMON_FLAGS
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
    """``CONFIGS`` whose slug is listed (all if None), the reference always kept."""
    return configset.select_rows(CONFIGS, slugs, REFERENCE)


def pool_rounds(runs: list[dict]) -> dict:
    """One row's server runs (``run_config`` results, one per round) as one result:
    per point, the requests of every round and their median."""
    first = runs[0]
    points = {}
    for n, p in first["points"].items():
        per_round = [r["points"][n] for r in runs]
        reqs = [q for pr in per_round for q in pr["requests"]]
        points[n] = {**p, "ttft_median_s": statistics.median(q["ttft_s"] for q in reqs),
                     "round_medians_s": [pr["ttft_median_s"] for pr in per_round],
                     "cached_tokens_max": max(pr["cached_tokens_max"] for pr in per_round),
                     "extends": sparse_counters.add([pr["extends"] for pr in per_round]),
                     "requests": reqs}
    return {**first, "peak_rss_bytes": max(r["peak_rss_bytes"] or 0 for r in runs),
            "logs": [r["log"] for r in runs], "points": points}


def build_prompts(tokenizer, plan: SweepPlan) -> dict[int, list[list[int]]]:
    """``repeats`` + 1 (a warm-up) different prompts of exactly ``history + n`` tokens
    per length ``n``."""
    from sgl_spec.bench import corpus

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
    t0 = time.perf_counter()
    r = requests.post(url + "/generate", json=body, timeout=600)
    latency = time.perf_counter() - t0
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return {"ttft_s": latency, "cached_tokens": meta.get("cached_tokens", 0)}


def parse_extends(text: str) -> dict[str, float]:
    """``sgl_spec:sparse_prefill_extends_total`` by path from /metrics text."""
    return sparse_counters.by_path(text, "sgl_spec:sparse_prefill_extends_total")


def _extends(url: str) -> dict[str, float]:
    return parse_extends(requests.get(url + "/metrics", timeout=30).text)


def _flush(url: str) -> None:
    requests.post(url + "/flush_cache", timeout=60).raise_for_status()


def _turn(url: str, prompt: list[int], history: int) -> dict:
    """Flush, cache the first ``history`` tokens (untimed), time the whole prompt."""
    _flush(url)
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
    return {"ttft_median_s": statistics.median(r["ttft_s"] for r in reqs),
            "cached_tokens_max": max(r["cached_tokens"] for r in reqs),
            "extends": extends, "load_average": provenance.load_average(), "requests": reqs}


def run_config(cfg: ServerConfig, model: str, prompts: dict, plan: SweepPlan, out_dir: str,
               bar, round_index: int = 0) -> dict:
    args = [*cfg.server_args(model), *SWEEP_FLAGS]
    suffix = f"-round{round_index + 1}" if plan.rounds > 1 else ""
    log = os.path.join(out_dir, f"server-{cfg.slug}{suffix}.log")
    bar.set_description(f"{cfg.name}: starting")
    points: dict[str, dict] = {}
    with ServerProcess(cfg.module, args, log_path=log) as server:
        for n in plan.lengths:
            bar.set_description(f"{cfg.name}: {n} tok")
            points[str(n)] = {"tokens": n, **measure(server.url, prompts[n], plan.history)}
            bar.update(1)
    return {"name": cfg.name, "config": asdict(cfg), "module": cfg.module, "args": args,
            "peak_rss_bytes": server.peak_rss_bytes, "log": log, "points": points}


def ratios(configs: list[dict], reference: str = REFERENCE) -> dict[str, dict[str, float]]:
    """TTFT of each configuration / the reference's, per length."""
    by = {c["name"]: c["points"] for c in configs}
    if reference not in by:
        return {}
    ref = by[reference]
    return {name: {k: p["ttft_median_s"] / ref[k]["ttft_median_s"] for k, p in pts.items()
                   if k in ref and ref[k]["ttft_median_s"] > 0}
            for name, pts in by.items() if name != reference}


def markdown(res: dict) -> str:
    configs = res["configs"]
    lengths = [str(n) for n in res["plan"]["lengths"]]
    hist = res["plan"].get("history", 0)
    what = f"a new turn over {hist} cached tokens" if hist else "a fresh prompt"
    lines = [f"# TTFT of {what} vs its length (median, seconds)", "",
             "| config | " + " | ".join(f"{n} tok" for n in lengths) + " |",
             "|---" * (len(lengths) + 1) + "|"]
    for c in configs:
        cells = []
        for n in lengths:
            p = c["points"].get(n)
            sparse = (p or {}).get("extends") or {}
            mark = "*" if sparse.get("sparse", 0) > 0 else ""
            cells.append("n/a" if p is None else f"{p['ttft_median_s']:.3f}{mark}")
        lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
    lines += ["", "`*`: sparse request-extends counted at that point.", "",
              f"## TTFT ratio vs {REFERENCE}", "",
              "| config | " + " | ".join(f"{n} tok" for n in lengths) + " |",
              "|---" * (len(lengths) + 1) + "|"]
    for name, r in res["ratios"].items():
        lines.append(f"| {name} | " + " | ".join(
            f"{r[n]:.2f}" if n in r else "n/a" for n in lengths) + " |")
    ref = next((c["points"] for c in configs if c["name"] == REFERENCE), None)
    if ref and any("round_medians_s" in p for p in ref.values()):
        lines += ["", "## Ratio per round (round medians, each vs the reference's same round)",
                  "", "| config | " + " | ".join(f"{n} tok" for n in lengths) + " |",
                  "|---" * (len(lengths) + 1) + "|"]
        for c in configs:
            if c["name"] == REFERENCE:
                continue
            cells = []
            for n in lengths:
                mine = c["points"].get(n, {}).get("round_medians_s")
                theirs = ref.get(n, {}).get("round_medians_s")
                cells.append("n/a" if not (mine and theirs) else " / ".join(
                    f"{a / b:.2f}" for a, b in zip(mine, theirs)))
            lines.append(f"| {c['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> str:
    from sgl_spec.bench.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in res["ratios"].items():
        xs = sorted(int(n) for n in r)
        ax.plot(xs, [r[str(x)] for x in xs], marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    hist = res["plan"].get("history", 0)
    xlabel = (f"new-turn tokens (over {hist} cached)" if hist
              else "prompt tokens (fresh, uncached)")
    ax.set(xlabel=xlabel, ylabel=f"TTFT / {REFERENCE}",
           title="Sparse prefill: TTFT ratio")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog="python -m sgl_spec.bench.prefill_sweep",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, metavar="DIR", help="output directory")
    ap.add_argument("--quick", action="store_true", help="1k and 4k tokens, 1 repeat")
    ap.add_argument("--repeats", type=int, metavar="R", help="override the repeats (>= 1)")
    ap.add_argument("--lengths", type=int, nargs="+", metavar="N",
                    help="new-turn token counts to time (default 1024 2048 4096 6144)")
    ap.add_argument("--history", type=int, default=0, metavar="H",
                    help="time a new turn after H cached conversation tokens (default 0: "
                         "a fresh prompt)")
    ap.add_argument("--rounds", type=int, default=1, metavar="R",
                    help="start every row's server R times, interleaved, and pool the "
                         "requests (default 1)")
    ap.add_argument("--rows", nargs="+", metavar="SLUG",
                    help="time only these rows (and the reference); valid: "
                         + ", ".join(c.slug for c in CONFIGS))
    ap.add_argument("--model-path", help="HF model dir (default: sgl_spec's default model)")
    args = ap.parse_args(argv)
    try:
        plan = SweepPlan.preset(args.quick, args.repeats, args.lengths, args.history,
                                args.rounds)
        rows = select_rows(args.rows)
    except ValueError as exc:
        ap.error(str(exc))
    from transformers import AutoTokenizer

    model = provenance.sweep_model(ap, args.model_path, max(plan.lengths) + plan.history + 1)
    os.makedirs(args.out, exist_ok=True)
    from tqdm import tqdm

    t0 = time.perf_counter()
    meta = provenance.run_meta(model, quick=args.quick, sweep_flags=list(SWEEP_FLAGS))
    prompts = build_prompts(AutoTokenizer.from_pretrained(model), plan)
    total = plan.rounds * len(rows) * len(plan.lengths)
    with tqdm(total=total, unit="point", dynamic_ncols=True) as bar:
        try:
            runs = configset.run_interleaved(
                rows, plan.rounds,
                lambda cfg, i: run_config(cfg, model, prompts, plan, args.out, bar, i))
        except ServerStartError as exc:
            print(f"error: {exc}")
            return 1
    configs = [pool_rounds(r) if plan.rounds > 1 else r[0] for r in runs.values()]
    meta.update(duration_s=time.perf_counter() - t0,
                load_average_after=provenance.load_average())
    res = {"meta": meta, "plan": asdict(plan), "configs": configs, "ratios": ratios(configs)}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown(res))
    plot(res, os.path.join(args.out, PNG))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
