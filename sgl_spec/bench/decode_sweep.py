"""Decode speed against history length: stock sglang, sgl_spec exact, sgl_spec loopserve.

    python -m sgl_spec.bench.decode_sweep --out results/decode-sweep [--quick]

One server at a time (``CONFIGS``, or the ``--rows`` picked; the last row decodes
exactly after a LoopServe sparse prefill). For each history length and batch size: flush
the cache, send each prompt once with ``max_new_tokens=1`` (its prefix is then
cached, so prefill is excluded), then time streamed /generate requests of N new
tokens (greedy, ``ignore_eos``). Per request, decode tok/s = (N - 1) / (latency -
TTFT); a batch of 4 sends 4 different prompts of the same length at once and sums
them. Medians over repeats; ``--rounds R`` starts each row's server R times,
interleaved, and pools their repeats (one server process can decode a few
percent faster or slower than the next). Writes ``results.json``, ``results.md`` (tok/s and the
ratios of ``RATIOS``) and ``decode_speed.png``.

Every server gets ``--enable-metrics`` (``configset.COMMON_FLAGS``) so that only a
row's own flags differ; loopserve's ``sgl_spec:decode_steps_total{path=...}`` counters
(``sparse_counters``, read before and after each point) say how many request-steps
attended a sparse subset. LoopServe decodes exactly before its first selection
(step 16) and below ``--spec-min-context``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
import dataclasses
from dataclasses import asdict, dataclass

import requests

from sgl_spec.bench import configset, plots, provenance, sparse_counters
from sgl_spec.bench.configset import ServerConfig
from sgl_spec.bench.server import ServerProcess, ServerStartError

logger = logging.getLogger(__name__)

LOOPSERVE = "loopserve B=1024"
EXACT = "sgl_spec exact"
PREFILL = "loopserve-prefill a=0.97"
CONFIGS: tuple[ServerConfig, ...] = (
    ServerConfig("stock", "stock"),
    ServerConfig(EXACT, "sgl_spec", ("--spec-mode", "exact")),
    ServerConfig(LOOPSERVE, "sgl_spec", ("--spec-mode", "loopserve", "--spec-budget", "1024")),
    # Exact decode after a sparse prefill (histories >= 2048 are prefilled on the
    # lines): its decode must run as fast as sgl_spec exact's.
    ServerConfig(PREFILL, "sgl_spec",
                 ("--spec-prefill", "loopserve", "--spec-prefill-alpha", "0.97")),
)
SWEEP_FLAGS: tuple[str, ...] = ("--sleep-on-idle",)
RATIOS: tuple[tuple[str, str], ...] = ((LOOPSERVE, "stock"), (LOOPSERVE, EXACT),
                                       (EXACT, "stock"), (PREFILL, EXACT))
PNG = "decode_speed.png"
# Tokens after the LATE_FROM-th: past loopserve's first selection (decode step 16,
# the 17th token), the rate a long generation settles at; reported beside the rate
# over all N - 1 decode steps, which the ratios use.
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
    from sgl_spec.bench import corpus

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
    t0 = time.perf_counter()
    ttft, t_late, tokens = None, None, 0
    with requests.post(url + "/generate", json=body, stream=True, timeout=1200) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            tokens = json.loads(line[5:])["meta_info"]["completion_tokens"]
            if ttft is None and tokens >= 1:
                ttft = time.perf_counter() - t0
            if t_late is None and tokens >= LATE_FROM:
                t_late, late_tokens = time.perf_counter() - t0, tokens
    latency = time.perf_counter() - t0
    if tokens != n or ttft is None:
        raise RuntimeError(f"asked for {n} tokens (ignore_eos), got {tokens}")
    late = None
    if t_late is not None and n > late_tokens and latency > t_late:
        late = (n - late_tokens) / (latency - t_late)
    return {"ttft_s": ttft, "latency_s": latency,
            "decode_tok_s": (n - 1) / (latency - ttft) if latency > ttft else None,
            "late_tok_s": late}


def decode_steps(url: str) -> dict[str, float]:
    """``sgl_spec:decode_steps_total`` by path (empty when the server has none)."""
    counts = sparse_counters.read(url)
    return {} if counts is None else {"sparse": counts.sparse, "exact": counts.exact}


def measure(url: str, prompts: list[list[int]], plan: SweepPlan) -> dict:
    """One point: prime every prompt's prefix, then ``repeats`` timed concurrent rounds."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        for p in prompts:  # one at a time: the prefills must not share a pass's timing
            generate(url, p, 1)
        before = decode_steps(url)
        rounds = []
        for _ in range(plan.repeats):
            reqs = list(pool.map(lambda p: generate(url, p, plan.new_tokens), prompts))
            rates = [q["decode_tok_s"] for q in reqs]
            late = [q["late_tok_s"] for q in reqs]
            rounds.append({"requests": reqs, "aggregate_tok_s":
                           None if None in rates else sum(rates),
                           "aggregate_late_tok_s": None if None in late else sum(late)})
        after = decode_steps(url)
    steps = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after} or None
    return summarize(rounds, steps)


def summarize(rounds: list[dict], steps: dict[str, float] | None) -> dict:
    """A point's medians over its timed rounds (of one server, or pooled)."""
    agg = [r["aggregate_tok_s"] for r in rounds if r["aggregate_tok_s"] is not None]
    late = [r["aggregate_late_tok_s"] for r in rounds if r["aggregate_late_tok_s"] is not None]
    return {"tok_s_median": statistics.median(agg) if agg else None,
            "late_tok_s_median": statistics.median(late) if late else None,
            "ttft_median_s": statistics.median(q["ttft_s"] for r in rounds
                                               for q in r["requests"]),
            "decode_steps": steps, "sparse": None if steps is None else
            steps.get("sparse", 0.0) > 0, "load_average": provenance.load_average(),
            "rounds": rounds}


def pool_starts(runs: list[dict]) -> dict:
    """One row's server starts (``run_config`` results) as one: per point, the timed
    rounds of every start, their medians, and each start's own median."""
    points = {}
    for key, p in runs[0]["points"].items():
        per = [r["points"][key] for r in runs]
        steps = sparse_counters.add([q["decode_steps"] for q in per])
        points[key] = {"history": p["history"], "batch": p["batch"],
                       **summarize([r for q in per for r in q["rounds"]], steps),
                       "start_tok_s_medians": [q["tok_s_median"] for q in per]}
    return {**runs[0], "logs": [r["log"] for r in runs], "points": points,
            "peak_rss_bytes": max(r["peak_rss_bytes"] or 0 for r in runs)}


def run_config(cfg: ServerConfig, model: str, prompts: dict, plan: SweepPlan, out_dir: str,
               bar, start: int = 0) -> dict:
    args = [*cfg.server_args(model), *SWEEP_FLAGS]
    suffix = f"-round{start + 1}" if plan.starts > 1 else ""
    log = os.path.join(out_dir, f"server-{cfg.slug}{suffix}.log")
    bar.set_description(f"{cfg.name}: starting")
    t0 = time.perf_counter()
    points: dict[str, dict] = {}
    with ServerProcess(cfg.module, args, log_path=log) as server:
        start_s = time.perf_counter() - t0
        generate(server.url, prompts[plan.histories[0]][0][:32], 8)  # warm-up
        for h in plan.histories:
            requests.post(server.url + "/flush_cache", timeout=60).raise_for_status()
            for b in plan.batches:
                bar.set_description(f"{cfg.name}: {h} tok x{b}")
                points[f"{h}x{b}"] = {"history": h, "batch": b,
                                      **measure(server.url, prompts[h][:b], plan)}
                bar.update(1)
    return {"name": cfg.name, "config": asdict(cfg), "module": cfg.module, "args": args,
            "start_s": start_s, "peak_rss_bytes": server.peak_rss_bytes, "log": log,
            "points": points}


def ratios(configs: list[dict], key: str = "tok_s_median") -> dict[str, dict[str, float | None]]:
    by = {c["name"]: c["points"] for c in configs}
    out = {}
    for num, den in RATIOS:
        if num in by and den in by:
            out[f"{num} / {den}"] = {k: (p.get(key) / by[den][k].get(key)
                                         if p.get(key) and by[den][k].get(key)
                                         else None) for k, p in by[num].items()}
    return out


def _f(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def markdown(res: dict) -> str:
    plan, configs, rat = res["plan"], res["configs"], res["ratios"]
    steps = lambda p: ("-" if p["decode_steps"] is None else  # noqa: E731
                       f"{p['decode_steps'].get('sparse', 0):.0f}/"
                       f"{sum(p['decode_steps'].values()):.0f}")
    head = ["history", "batch", *(f"{c['name']} tok/s" for c in configs), *rat,
            *(f"{c['name']} sparse steps" for c in configs if c["name"] == LOOPSERVE)]
    lines = [f"# Decode speed vs history ({res['meta']['started']})", "",
             f"Model `{res['meta']['model']}`; N={plan['new_tokens']} new tokens, "
             f"median of {plan['repeats']} repeat(s); batch > 1: sum over concurrent "
             f"requests; decode tok/s = (N-1)/(latency-TTFT), prefix cached. Run time "
             f"{res['meta']['duration_s'] / 60:.1f} min; load "
             f"{res['meta']['load_average_before']} -> {res['meta']['load_average_after']}.",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in configs[0]["points"]:
        p0 = configs[0]["points"][key]
        row = [str(p0["history"]), str(p0["batch"]),
               *(_f(c["points"][key]["tok_s_median"], ".2f") for c in configs),
               *(_f(r[key], ".3f") for r in rat.values()),
               *(steps(c["points"][key]) for c in configs if c["name"] == LOOPSERVE)]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Sparse steps: request-steps that attended a sparse subset / all "
              "decode request-steps of the point (timed rounds).", ""]
    late = res.get("late_ratios")
    if late:
        head = ["history", "batch", *(f"{c['name']} tok/s" for c in configs), *late]
        lines += [f"## After loopserve's first selection (tokens {LATE_FROM + 1}..N)", "",
                  f"Rate over the tokens after the {LATE_FROM}th (decode step 16 selects), "
                  "where a long generation spends its time; medians as above.", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for key in configs[0]["points"]:
            p0 = configs[0]["points"][key]
            row = [str(p0["history"]), str(p0["batch"]),
                   *(_f(c["points"][key].get("late_tok_s_median"), ".2f") for c in configs),
                   *(_f(r[key], ".3f") for r in late.values())]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    by = {c["name"]: c["points"] for c in configs}
    if EXACT in by and any("start_tok_s_medians" in p for p in by[EXACT].values()):
        others = [c["name"] for c in configs if c["name"] != EXACT]
        lines += ["## Per server start (each start's tok/s / sgl_spec exact's same start)", "",
                  "| history | batch | " + " | ".join(others) + " |",
                  "|" + "---|" * (len(others) + 2)]
        for key, p in by[EXACT].items():
            cells = [" / ".join(_f(a / b if a and b else None, ".2f") for a, b in
                                zip(by[n][key]["start_tok_s_medians"], p["start_tok_s_medians"]))
                     for n in others]
            lines.append(f"| {p['history']} | {p['batch']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(res: dict, path: str) -> str:
    plt = plots._pyplot()
    batches = res["plan"]["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for c in res["configs"]:
            pts = [p for p in c["points"].values() if p["batch"] == b]
            ax.plot([p["history"] for p in pts], [p["tok_s_median"] for p in pts],
                    marker="o", label=c["name"])
        ax.set(xlabel="history (prompt tokens)", ylabel="decode tok/s (median)",
               title=f"batch {b}" + (" (sum over requests)" if b > 1 else ""))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog="python -m sgl_spec.bench.decode_sweep",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, metavar="DIR", help="output directory")
    ap.add_argument("--quick", action="store_true", help="N=24 tokens, 1 repeat")
    ap.add_argument("--repeats", type=int, metavar="R", help="override the repeats (>= 1)")
    ap.add_argument("--model-path", help="HF model dir (default: sgl_spec's default model)")
    ap.add_argument("--histories", type=int, nargs="+", metavar="H",
                    help=f"history lengths in tokens (default: {SweepPlan.histories})")
    ap.add_argument("--batches", type=int, nargs="+", metavar="B",
                    help=f"batch sizes (default: {SweepPlan.batches})")
    ap.add_argument("--new-tokens", type=int, metavar="N",
                    help="tokens generated per request (default: 64; --quick 24)")
    ap.add_argument("--rounds", type=int, metavar="R",
                    help="start every row's server R times, interleaved, and pool the timed "
                         "rounds (default 1)")
    ap.add_argument("--rows", nargs="+", metavar="SLUG",
                    help="time only these rows (and sgl_spec exact); valid: "
                         + ", ".join(c.slug for c in CONFIGS))
    args = ap.parse_args(argv)
    try:
        rows = configset.select_rows(CONFIGS, args.rows, EXACT)
        plan = SweepPlan.preset(args.quick, args.repeats)
        over = {k: v for k, v in (("histories", args.histories), ("batches", args.batches),
                                  ("new_tokens", args.new_tokens), ("starts", args.rounds))
                if v is not None}
        plan = dataclasses.replace(plan, **{k: tuple(v) if isinstance(v, list) else v
                                            for k, v in over.items()})
    except ValueError as exc:
        ap.error(str(exc))
    from transformers import AutoTokenizer

    model = provenance.sweep_model(ap, args.model_path, max(plan.histories) + plan.new_tokens)
    os.makedirs(args.out, exist_ok=True)
    from tqdm import tqdm

    t0 = time.perf_counter()
    meta = provenance.run_meta(model, quick=args.quick, sweep_flags=list(SWEEP_FLAGS))
    prompts = build_prompts(AutoTokenizer.from_pretrained(model), plan)
    with tqdm(total=plan.starts * len(rows) * len(plan.histories) * len(plan.batches),
              unit="point", dynamic_ncols=True) as bar:
        try:
            runs = configset.run_interleaved(
                rows, plan.starts,
                lambda cfg, i: run_config(cfg, model, prompts, plan, args.out, bar, i))
        except ServerStartError as exc:
            print(f"error: {exc}")
            return 1
    configs = [pool_starts(r) if plan.starts > 1 else r[0] for r in runs.values()]
    meta.update(duration_s=time.perf_counter() - t0,
                load_average_after=provenance.load_average())
    res = {"meta": meta, "plan": asdict(plan), "configs": configs, "ratios": ratios(configs),
           "late_ratios": ratios(configs, "late_tok_s_median")}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown(res))
    plot(res, os.path.join(args.out, PNG))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
