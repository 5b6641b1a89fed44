"""What Krul's per-conversation estimator costs the turns it observes: TTFT and TPOT.

    python -m sgl_spec.bench.krul_overhead --out results/krul-overhead [--rounds 3]
    python -m sgl_spec.bench.krul_overhead --out results/x --quick        # ~6 min

Two rows, the same Krul server (HiCache, ``--spec-krul``) but for where the layer pairs
come from: ``--spec-krul-strategy model`` (the model's statistics: nothing observed)
and the default ``conversation`` (the attention path samples each conversation's
attention: ``prefill_rows`` query rows per extend, every ``decode_every``-th decode
step, ``sgl_spec.attention.observe``). Each server start plays the same ``--requests``
fresh prompts of ``--prompt-tokens`` (corpus text, no cached prefix), one at a time,
each streaming ``--new-tokens`` greedy tokens with EOS ignored; TTFT is the client's,
TPOT = (latency - TTFT) / (N - 1). ``--rounds R`` starts each row R times, interleaved;
the ratio of the estimator's median to the model row's median of the same round gives
the spread. Writes ``results.json`` and ``results.md``. The goal (issue 17): <= 1.03.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

import requests

from sgl_spec.bench import cli, render, sweep, timing
from sgl_spec.bench.configset import ServerConfig
from sgl_spec.bench.decode_sweep import generate
from sgl_spec.bench.server import flush_cache

# Room for the prompts on the device, HiCache's host tier beside it.
HICACHE = ("--enable-hierarchical-cache", "--hicache-ratio", "2", "--spec-krul")
MODEL = ServerConfig("krul, the model's pairs", "sgl_spec",
                     (*HICACHE, "--spec-krul-strategy", "model"))
ESTIMATOR = ServerConfig("krul, per-conversation estimator", "sgl_spec",
                         (*HICACHE, "--spec-krul-strategy", "conversation"))
ROWS = (MODEL, ESTIMATOR)


@dataclass(frozen=True)
class Plan:
    prompt_tokens: int = 4096
    new_tokens: int = 128
    requests: int = 4
    rounds: int = 3
    seed: int = 7

    def __post_init__(self):
        if self.prompt_tokens < 16 or self.new_tokens < 2 or self.requests < 1 or self.rounds < 1:
            raise ValueError(f"--prompt-tokens >= 16, --new-tokens >= 2, --requests >= 1 and "
                             f"--rounds >= 1, got {self}")


def prompts(tokenizer, plan: Plan) -> list[list[int]]:
    from sgl_spec import corpus

    out = []
    for i in range(plan.requests + 1):  # the first is the warm-up
        doc = corpus.document(tokenizer, int(plan.prompt_tokens * 1.03) + 16, seed=plan.seed + i)
        out.append(tokenizer.encode(doc, add_special_tokens=False)[: plan.prompt_tokens])
    return out


def run_row(cfg: ServerConfig, model: str, ids: list[list[int]], plan: Plan, out_dir: str,
            bar, i: int) -> dict:
    bar.set_description(f"{cfg.name}: starting")
    with sweep.row_server(cfg, model, out_dir, i, plan.rounds) as (server, record):
        generate(server.url, ids[0][:256], 8)  # warm-up
        flush_cache(server.url)
        reqs = []
        for p in ids[1:]:
            bar.set_description(f"{cfg.name}: round {i + 1}")
            q = generate(server.url, p, plan.new_tokens)
            q["tpot_s"] = (q["latency_s"] - q["ttft_s"]) / (plan.new_tokens - 1)
            reqs.append(q)
            bar.update(1)
        krul = requests.get(f"{server.url}/sgl_spec/cache", timeout=60).json().get("krul", {})
    record.update(requests=reqs, krul=krul,
                  ttft_median_s=timing.median(q["ttft_s"] for q in reqs),
                  tpot_median_s=timing.median(q["tpot_s"] for q in reqs))
    return record


def results(meta: dict, plan: Plan, runs: dict[str, list[dict]]) -> dict:
    rows = {}
    for name, starts in runs.items():
        rows[name] = {
            "ttft_median_s": timing.median(q["ttft_s"] for s in starts for q in s["requests"]),
            "tpot_median_s": timing.median(q["tpot_s"] for s in starts for q in s["requests"]),
            "start_ttft_s": [s["ttft_median_s"] for s in starts],
            "start_tpot_s": [s["tpot_median_s"] for s in starts],
            "krul": [s["krul"] for s in starts], "logs": [s["log"] for s in starts]}
    ratio = {}
    if MODEL.name in rows and ESTIMATOR.name in rows:
        a, b = rows[ESTIMATOR.name], rows[MODEL.name]
        for key in ("ttft", "tpot"):
            s = timing.ratio_spread(a[f"start_{key}_s"], b[f"start_{key}_s"])
            ratio[key] = s._asdict() if s is not None else None
    return {"meta": meta, "plan": asdict(plan), "rows": rows, "estimator_over_model": ratio}


def markdown(res: dict) -> str:
    p = res["plan"]
    lines = [f"# Krul's estimator: its cost on the turns it observes ({res['meta']['model']})", "",
             f"{p['requests']} prompts of {p['prompt_tokens']} tokens, {p['new_tokens']} new "
             f"tokens each (greedy, EOS ignored), one at a time; {p['rounds']} starts per row, "
             "interleaved. Medians over every request of every start.", ""]
    rows = []
    for name, r in res["rows"].items():
        k = (r["krul"] or [{}])[-1]
        rows.append([name, render.num(r["ttft_median_s"], 1, 3), render.num(r["tpot_median_s"], 1e3, 1),
                     str(k.get("observed_prefill_rows", 0)), str(k.get("observed_decode_rows", 0)),
                     render.num(k.get("observe_inline_seconds"), 1, 3),
                     render.num(k.get("observe_worker_seconds"), 1, 3),
                     f"{k.get('conversation_strategy_nodes', 0)} / {k.get('model_strategy_nodes', 0)}"])
    lines += render.table(["row", "TTFT s", "TPOT ms", "observed prefill rows",
                           "observed decode rows", "observing s (in the pass)",
                           "folding s (worker)", "nodes: own / model pairs"], rows)
    r = res["estimator_over_model"]
    if r:
        lines += ["", "Estimator / model, per round (min / median / max); goal <= 1.03:", ""]
        lines += render.table(["figure", "ratio"], [
            [k.upper(), render.spread_cell(timing.Spread(**v) if v else None, 3)]
            for k, v in r.items()])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser("python -m sgl_spec.bench.krul_overhead", __doc__)
    cli.add_common(ap, quick="2 prompts of 2048 tokens, 64 new tokens, 1 round")
    ap.add_argument("--prompt-tokens", type=int, default=Plan.prompt_tokens, metavar="N")
    ap.add_argument("--new-tokens", type=int, default=Plan.new_tokens, metavar="N")
    ap.add_argument("--requests", type=int, default=Plan.requests, metavar="N")
    ap.add_argument("--rounds", type=int, default=Plan.rounds, metavar="R",
                    help="server starts per row, interleaved (the spread)")
    args = ap.parse_args(argv)
    cli.setup_logging()
    try:
        plan = (Plan(2048, 64, 2, 1) if args.quick else
                Plan(args.prompt_tokens, args.new_tokens, args.requests, args.rounds))
    except ValueError as exc:
        ap.error(str(exc))
    from transformers import AutoTokenizer

    model = cli.model_path(ap, args.model_path, plan.prompt_tokens + plan.new_tokens)
    meta, watch = cli.start_meta(model, quick=args.quick, sweep_flags=list(sweep.SWEEP_FLAGS))
    ids = prompts(AutoTokenizer.from_pretrained(model), plan)
    runs = sweep.run_rows(ROWS, plan.rounds, plan.requests,
                          lambda cfg, i, bar: run_row(cfg, model, ids, plan, args.out, bar, i))
    if runs is None:
        return 1
    res = results(cli.finish_meta(meta, watch), plan, runs)
    text = markdown(res)
    cli.write_results(args.out, res, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
