"""Soak and memory-pressure runs: N concurrent clients for T minutes against one server
per row, sampling the server's memory, KV pool and sgl_spec's per-request structures
(issue 18, items 1 and 2).

Every row plays the same seeded mix (``soak_load``: chats over shared documents, a
growing conversation, the fork/join frontend agent, long generations, streams the client
drops, over-limit prompts) for ``--minutes``; then the clients stop (visits under way
finish), one probe request runs, and the per-request structures must be back to empty
(``GET /sgl_spec/cache``'s ``live_requests``). Every ``--sample-s`` seconds: the server's
RSS (all its processes), KV pool use and queue (``/metrics``), and the live structures.

Rows (``ROWS``): ``stock``, ``exact``, ``sparse`` (``--spec-mode loopserve --spec-prefill
loopserve``), ``specontext`` (both from 512 tokens of context, so that most visits take the
sparse paths); and, for memory pressure, ``exact-pressure`` and
``exact-pressure-hicache``: the KV pool at ``--pressure`` (default 25%) of the workload's
working set, without and with HiCache, so that eviction, write-back and reload churn all
the time. The other rows get a pool that holds the working set (an upper-bound estimate,
``working_set``); where the reference row ran first without evicting, the pressure pool is
a share of what it measured (``measured_working_set``). Greedy answers of every
row are compared with ``--reference``'s (default ``exact``) on the visits both completed
(the same prompts), divergences with their logit margin::

    python -m sgl_spec.bench.soak --out results/soak --rows stock exact sparse specontext
    python -m sgl_spec.bench.soak --out results/pressure \\
        --rows exact exact-pressure exact-pressure-hicache
    # 32 clients x 10 minutes per row (defaults): ~12 minutes a row on 2 cores

Writes results.json (every record and sample), results.md and soak.png. Loopback only.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import Counter
from dataclasses import asdict

import psutil
import requests
from tqdm import tqdm

from sgl_spec import corpus
from sgl_spec.bench import agreement, cli, configset, plots, render, sparse_counters
from sgl_spec.bench.chat_client import TurnResult
from sgl_spec.bench.server import SPEC, STOCK, ServerProcess, flush_cache
from sgl_spec.bench.soak_load import KINDS, Mix, play

logger = logging.getLogger(__name__)

HICACHE = ("--enable-hierarchical-cache", "--hicache-io-backend", "direct",
           "--hicache-mem-layout", "layer_first", "--hicache-ratio", "4")
ROWS: dict[str, tuple[str, tuple[str, ...]]] = {  # name -> (launcher module, flags)
    "stock": (STOCK, tuple(configset.LAUNCHERS["stock"].flags)),
    "exact": (SPEC, ()),
    # Thresholds at 512 (defaults 2048) so that most visits take the sparse paths, and
    # taken whether or not sparse decode pays on this host (a reliability run).
    "sparse": (SPEC, ("--spec-mode", "loopserve", "--spec-prefill", "loopserve",
                      "--spec-min-context", "512", "--spec-prefill-min-tokens", "512",
                      "--spec-decode-profile", "off")),
    "specontext": (SPEC, ("--spec-mode", "specontext", "--spec-min-context", "512",
                          "--spec-decode-profile", "off")),
    "exact-pressure": (SPEC, ()),
    "exact-pressure-hicache": (SPEC, HICACHE),
}
# Sized for a 2-core AVX2 host, where a bf16 prefill runs at ~65 tokens/s: 32 clients'
# first visits alone are ~10k tokens of prefill.
DOCS, DOC_TOKENS = 8, (150, 400)
KV_METRICS = ("sglang:token_usage", "sglang:num_used_tokens", "sglang:num_running_reqs",
              "sglang:num_queue_reqs")


def working_set(clients: int, mix: Mix) -> int:
    """Tokens of KV the clients keep live at once: each a document-sized prompt and its
    answer, or its growing conversation (the larger)."""
    return clients * (max(DOC_TOKENS[1], mix.grow_limit) + mix.longgen_tokens)


def measured_working_set(samples: list[dict]) -> int | None:
    """Peak KV the workload kept on the device in a run that never evicted: tokens in
    the tree plus those running requests hold (an upper bound: locked tree tokens count
    twice); None without sgl_spec's endpoint or where the run evicted."""
    peaks = [s["cached_by_tier"].get("device", 0) + s.get("sglang:num_used_tokens", 0)
             for s in samples if s.get("cached_by_tier")]
    if not peaks or any(s.get("evicted_tokens") for s in samples):
        return None
    return int(max(peaks))


def server_rss(server: ServerProcess) -> dict[str, int]:
    """RSS per process of the server's tree, by name (``sglang::scheduler``, ...; the
    launcher's own process is ``http``: it runs the HTTP server and tokenizer)."""
    root = psutil.Process(server.proc.pid)
    out: dict[str, int] = {}
    for i, p in enumerate([root, *root.children(recursive=True)]):
        try:
            name = "http" if i == 0 else p.name()
            out[name] = out.get(name, 0) + p.memory_info().rss
        except psutil.Error:
            continue
    return out


def _metrics(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=30).text
    return {name: sparse_counters.scalar(text, name) for name in KV_METRICS}


def spec_state(url: str) -> dict | None:
    """sgl_spec's per-request structures, cached tokens by tier and tokens evicted so
    far (``GET /sgl_spec/cache``); None on a server without it (stock)."""
    r = requests.get(url + "/sgl_spec/cache", timeout=60)
    if r.status_code != 200:
        return None
    j = r.json()
    return {"live": j["live_requests"], "cached_by_tier": j["totals"]["by_tier"],
            "evicted_tokens": sum(j["freed_tokens_by_rule"].values()),
            "invariants": j.get("invariants")}


def live(url: str) -> dict[str, int] | None:
    state = spec_state(url)
    return state and state["live"]


def sample(server: ServerProcess, t0: float) -> dict:
    by_process = server_rss(server)
    s = {"t_s": time.monotonic() - t0, "rss_bytes": sum(by_process.values()),
         "rss_by_process": by_process}
    try:
        s.update(_metrics(server.url))
        s.update(spec_state(server.url) or {})
    except requests.RequestException as exc:
        s["error"] = str(exc)[:200]
    return s


def rss_growth(samples: list[dict], warmup_s: float) -> float | None:
    """(median RSS over the last minute) / (median RSS over the minute after warm-up) - 1."""
    end = samples[-1]["t_s"] if samples else 0.0
    after = [s["rss_bytes"] for s in samples if warmup_s <= s["t_s"] < warmup_s + 60]
    last = [s["rss_bytes"] for s in samples if s["t_s"] >= end - 60]
    if not after or not last or end - 60 < warmup_s:
        return None
    return statistics.median(last) / statistics.median(after) - 1


def run_row(name: str, model: str, args, docs: list[str], mix: Mix, pool: int) -> dict:
    module, flags = ROWS[name]
    argv = ["--model-path", model, *configset.COMMON_FLAGS, *flags]
    argv[argv.index("--max-total-tokens") + 1] = str(pool)
    if module == SPEC:  # KV slots and per-request structures checked every step
        argv.append("--spec-check-invariants")
    with ServerProcess(module, argv) as server:
        flush_cache(server.url)
        t0 = time.monotonic()
        samples: list[dict] = []
        stop = threading.Event()

        def sampler() -> None:
            while not stop.is_set():
                samples.append(sample(server, t0))
                stop.wait(args.sample_s)

        thread = threading.Thread(target=sampler, name="soak-sampler", daemon=True)
        thread.start()
        bar = tqdm(desc=name, unit="req", dynamic_ncols=True)
        records, _ = play(server.url, docs, mix, args.clients, args.minutes * 60, args.seed,
                          on_record=lambda r: bar.update(1))
        bar.close()
        load_s = time.monotonic() - t0
        probe = requests.post(server.url + "/generate", timeout=300, json={
            "text": "Say hello.", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        end_live = live(server.url)
        for _ in range(60):  # disconnects and seeds settle within a few passes
            if not end_live or not any(end_live.values()):
                break
            time.sleep(1)
            end_live = live(server.url)
        stop.set()
        thread.join()
        samples.append(sample(server, t0))
        return {"name": name, "module": module, "flags": flags, "pool_tokens": pool,
                "load_s": load_s, "probe_status": probe.status_code, "end_live": end_live,
                "peak_rss_bytes": server.peak_rss_bytes, "samples": samples,
                "records": [asdict(r) for r in records]}


def summarize(row: dict, warmup_s: float, reference: dict | None) -> dict:
    recs = row["records"]
    by = Counter((r["kind"], r["status"]) for r in recs)
    rejected = Counter((r["kind"], r["http_status"]) for r in recs if r["status"] == "rejected")
    out = {
        "requests": len(recs),
        "by_kind": {k: {s: n for (kk, s), n in by.items() if kk == k} for k in KINDS},
        "rejected_statuses": {f"{k} {s}": n for (k, s), n in rejected.items()},
        "failed": [r for r in recs if r["status"] == "failed"][:20],
        "unexpected": sum(1 for r in recs if r["status"] == "failed" or (
            r["status"] == "rejected" and r["kind"] != "over_limit")),
        "rss_growth_after_warmup": rss_growth(row["samples"], warmup_s),
        "peak_kv_usage": max((s.get("sglang:token_usage", 0.0) for s in row["samples"]),
                             default=None),
        "end_live": row["end_live"],
        "ended_empty": row["end_live"] is None or not any(row["end_live"].values()),
        "peak_live": _peak_live(row["samples"]),
        "evicted_tokens": max((s.get("evicted_tokens", 0) for s in row["samples"]),
                              default=None),
        "invariants": next((s["invariants"] for s in reversed(row["samples"])
                            if s.get("invariants")), None),
    }
    if reference is not None and reference is not row:
        out["agreement"] = compare(reference, row)
    return out


def _peak_live(samples: list[dict]) -> dict[str, int]:
    peak: dict[str, int] = {}
    for s in samples:
        for k, v in (s.get("live") or {}).items():
            peak[k] = max(peak.get(k, 0), v)
    return peak


def compare(reference: dict, row: dict) -> dict:
    """Greedy agreement on the visits both rows completed; the agent by its answers."""
    def turns(r: dict) -> dict[str, TurnResult]:
        return {x["key"]: TurnResult.from_json(x["turn"]) for x in r["records"]
                if x["status"] == "ok" and x["turn"]}

    ref, cand = turns(reference), turns(row)
    keys = sorted(ref.keys() & cand.keys())
    fig = agreement.figures([ref[k] for k in keys], [cand[k] for k in keys]) if keys else None
    agents = {x["key"]: x["output_sha1"] for x in reference["records"] if x["output_sha1"]}
    both = [(agents[x["key"]], x["output_sha1"]) for x in row["records"]
            if x["output_sha1"] and x["key"] in agents]
    out = {"turns": fig["counts"] if fig else {"turns": 0},
           "agent_runs": len(both), "agent_identical": sum(a == b for a, b in both)}
    if fig:
        out["divergences"] = [t for t in fig["turns"] if not t["identical"]][:50]
    return out


def markdown(results: dict) -> str:
    rows = results["rows"]
    head = ["row", "pool", "requests", "unexpected", "aborted", "over-limit statuses",
            "RSS growth", "peak KV use", "evicted tokens", "ended empty",
            "invariant violations", "greedy vs " + results["reference"]]
    body = []
    for r in rows:
        s = r["summary"]
        ag = s.get("agreement")
        agree = "reference" if ag is None else (
            f"{ag['turns'].get('identical', 0)}/{ag['turns']['turns']} identical, "
            f"{ag['turns'].get('near_tie_divergences', 0)} near ties, "
            f"{ag['turns'].get('other_divergences', 0)} other; agent "
            f"{ag['agent_identical']}/{ag['agent_runs']}")
        aborted = sum(k.get("aborted", 0) for k in s["by_kind"].values())
        over = ", ".join(f"{k.split()[1]} x{n}" for k, n in s["rejected_statuses"].items()
                         if k.startswith("over_limit")) or "-"
        growth = s["rss_growth_after_warmup"]
        inv = s.get("invariants")
        checked = "-" if not inv else f"{inv['violations']} in {inv['checks']} checks"
        body.append([r["name"], str(r["pool_tokens"]), str(s["requests"]), str(s["unexpected"]),
                     str(aborted), over, "-" if growth is None else f"{100 * growth:+.1f}%",
                     render.num(s["peak_kv_usage"]), str(s["evicted_tokens"] or 0),
                     "n/a" if s["end_live"] is None else "yes" if s["ended_empty"] else
                     f"NO {s['end_live']}", checked, agree])
    meta = results["meta"]
    lines = [f"# Soak: {results['clients']} clients x {results['minutes']} min per row", "",
             f"Working set ~{results['working_set_tokens']} tokens (estimate; the reference row "
             f"measured {results['measured_working_set_tokens']}); pressure pool "
             f"{results['pressure_pool_tokens']}. Run {meta.get('duration_s', 0):.0f} s.", "",
             *render.table(head, body), "",
             "Requests per kind and status:", ""]
    for r in rows:
        kinds = "; ".join(f"{k}: " + ", ".join(f"{s} {n}" for s, n in v.items())
                          for k, v in r["summary"]["by_kind"].items() if v)
        lines.append(f"- {r['name']}: {kinds}; peak live structures {r['summary']['peak_live']}")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> str:
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for r in results["rows"]:
        ts = [s["t_s"] / 60 for s in r["samples"]]
        axes[0].plot(ts, [s["rss_bytes"] / 2**30 for s in r["samples"]], label=r["name"])
        axes[1].plot(ts, [s.get("sglang:token_usage", 0.0) for s in r["samples"]],
                     label=r["name"])
        axes[2].plot(ts, [sum((s.get("live") or {}).values()) for s in r["samples"]],
                     label=r["name"])
    for ax, title in zip(axes, ("server RSS (GiB)", "KV pool use", "live per-request states")):
        ax.set_title(title)
        ax.set_xlabel("minutes")
    plots.finish_axes(*axes)
    return plots.save(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = cli.parser("python -m sgl_spec.bench.soak", __doc__)
    cli.add_common(ap)
    ap.add_argument("--rows", nargs="+", default=["stock", "exact", "sparse"],
                    choices=list(ROWS), help="rows, each one server (default: %(default)s)")
    ap.add_argument("--reference", default="exact", choices=list(ROWS),
                    help="the row greedy answers are compared with (default: %(default)s)")
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    ap.add_argument("--minutes", type=float, default=10.0, help="load per row (default 10)")
    ap.add_argument("--warmup-minutes", type=float, default=2.0,
                    help="RSS growth is measured from here (default 2)")
    ap.add_argument("--pressure", type=float, default=0.25,
                    help="the pressure rows' KV pool, as a share of the working set (0.25)")
    ap.add_argument("--sample-s", type=float, default=5.0, help="sampling period (5 s)")
    ap.add_argument("--seed", type=int, default=18)
    args = ap.parse_args(argv)
    if args.clients < 1 or args.minutes <= 0 or not 0 < args.pressure <= 1:
        ap.error("--clients must be >= 1, --minutes > 0 and --pressure in (0, 1]")
    cli.setup_logging()
    model = cli.model_path(ap, args.model_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    docs = [corpus.document(tok, DOC_TOKENS[0] + i * (DOC_TOKENS[1] - DOC_TOKENS[0]) // DOCS,
                            seed=100 + i) for i in range(DOCS)]
    mix = Mix()
    ws = working_set(args.clients, mix)
    pressure_pool = max(int(args.pressure * ws), 4096)  # the largest visit fits
    meta, watch = cli.start_meta(model, argv=argv)
    order = sorted(args.rows, key=lambda n: n != args.reference)  # reference first
    rows = []
    for name in order:
        if "pressure" in name and rows and rows[0]["name"] == args.reference:
            measured = measured_working_set(rows[0]["samples"])
            if measured:  # the reference's own peak, where it ran first and unpressured
                pressure_pool = max(int(args.pressure * measured), 4096)
        rows.append(run_row(name, model, args, docs, mix,
                            pressure_pool if "pressure" in name else ws))
    ref = next((r for r in rows if r["name"] == args.reference), None)
    for r in rows:
        r["summary"] = summarize(r, args.warmup_minutes * 60, ref)
    results = {"meta": cli.finish_meta(meta, watch), "clients": args.clients,
               "minutes": args.minutes, "reference": args.reference, "working_set_tokens": ws,
               "measured_working_set_tokens": rows and measured_working_set(rows[0]["samples"]),
               "pressure_pool_tokens": pressure_pool, "rows": rows}
    paths = cli.write_results(args.out, results, markdown(results))
    paths.append(plot(results, f"{args.out}/soak.png"))
    print(markdown(results))
    print("\n".join(paths))


if __name__ == "__main__":
    main()
