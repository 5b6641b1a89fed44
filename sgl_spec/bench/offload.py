"""Long generations under one device KV byte budget (issue 45): SpeContext's adaptive
memory management against the rows a user would run instead.

``--requests`` prompts of about ``--prompt-tokens`` tokens (a corpus document and an
instruction to explain it at length) are sent at once, each generating ``--gen-tokens``
tokens (greedy, ignore_eos). Every row gets the same device KV bytes: ``--budget-tokens``
tokens per request at every layer (the issue's budget: N requests' full KV at 2k tokens
while they generate to 8k). Rows (one server each, the same model and dtype):

* ``stock``: ``sglang.launch_server``, ``--max-total-tokens`` = N x budget tokens;
* ``exact``: sgl_spec exact mode, the same pool;
* ``specontext``: ``--spec-mode specontext``; its pool also holds the retrieval head's
  layer, so the same bytes are fewer tokens (its staging rows are outside the budget);
* ``specontext-offload``: ``--spec-offload auto --spec-offload-kv-bytes`` the budget (the
  resident layers' rows in use, the head's layer and the staging rows), and a pool whose
  slots hold every request's whole generation on the host tier;
* ``specontext-offload-inline``: the same with ``--spec-prefetch inline`` (each layer
  copies its loads right before its attention): what the worker thread's overlap is worth.

Measured per row: output tokens/s (all tokens over the wall time), the most requests
decoding at once (the client's clock), sglang's retractions, and for the offload row the
device KV bytes it reported (sampled; the largest), the layers on the host at the end and
the share of the host layers' loads hidden behind compute. The offload row's greedy
output is compared with the specontext row's, token by token. ``--rounds`` repeats every
row, interleaved, for the spread.

    python -m sgl_spec.bench.offload --out DIR                 # N=4, 512 in, 7168 out
    python -m sgl_spec.bench.offload --quick --out DIR         # minutes
    python -m sgl_spec.bench.offload --gen-tokens 2048 --budget-tokens 640 --budget 256 --out DIR
"""

from __future__ import annotations

import json
import os
import shlex
import threading
from concurrent.futures import ThreadPoolExecutor

import requests
from tqdm import tqdm

from sgl_spec import corpus
from sgl_spec.attention import step_cost
from sgl_spec.bench import agreement, cli, configset, round_play, timing
from sgl_spec.bench.provenance import git_label
from sgl_spec.bench.render import cell
from sgl_spec.bench.server import SPEC, STOCK, ServerProcess, flush_cache
from sgl_spec.launch_server import _value

ROWS = ("stock", "exact", "specontext", "specontext-offload",
        "specontext-offload-inline")
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
INSTRUCTION = ("Explain the document above in as much detail as you can, section by "
               "section, then list every name, number and claim it makes.")


def row_flags(row: str, budget_bytes: int, pool_tokens: int, row_bytes: int, layers: int,
              sparse_flags: list[str]) -> tuple[str, list[str]]:
    """(launcher, flags) of ``row`` under ``budget_bytes`` of device KV."""
    if row == "stock":
        return STOCK, [*configset.LAUNCHERS["stock"].flags,
                       "--max-total-tokens", str(budget_bytes // (layers * row_bytes))]
    if row == "exact":
        return SPEC, ["--max-total-tokens", str(budget_bytes // (layers * row_bytes))]
    spec = ["--spec-mode", "specontext", *sparse_flags]  # sparse_flags name --spec-prefetch
    if row == "specontext":  # + the head's layer: fewer tokens in the same bytes
        return SPEC, [*spec, "--max-total-tokens",
                      str(budget_bytes // ((layers + 1) * row_bytes))]
    if row == "specontext-offload-inline":
        i = spec.index("--spec-prefetch")
        spec[i + 1] = "inline"
    return SPEC, [*spec, "--spec-offload", "auto", "--spec-offload-kv-bytes",
                  str(budget_bytes), "--max-total-tokens", str(pool_tokens)]


class OffloadWatch:
    """Polls ``GET /sgl_spec/cache`` -> ``offload`` while a phase runs: the largest device
    KV bytes reported (resident layers' rows in use + staging) and the last report."""

    def __init__(self, url: str, every_s: float = 0.5):
        self.url, self.every_s = url, every_s
        self.peak_device_bytes, self.over_budget, self.last = 0, False, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def sample(self) -> None:
        try:
            rep = requests.get(self.url + "/sgl_spec/cache", timeout=30).json().get("offload")
        except (requests.RequestException, ValueError):
            return
        if rep:
            d = rep["device_bytes"]
            self.peak_device_bytes = max(self.peak_device_bytes, d["layers"] + d["staging"])
            self.over_budget |= rep["over_budget"]
            self.last = rep

    def __enter__(self) -> OffloadWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.sample()


def play(url: str, row: str, prompts: list[list[dict]], gen: int, bar) -> dict:
    """Every prompt at once; what the row did with them."""
    def one(msgs):
        r = round_play.ask(url, msgs, gen, ignore_eos=True, timeout=7200)
        bar.update()
        return r

    offload = row.startswith("specontext-offload")
    with round_play.Watch(url) as watch, OffloadWatch(url) if offload else _Null() as ow, \
            ThreadPoolExecutor(len(prompts)) as pool:
        t0 = timing.clock()
        replies = list(pool.map(one, prompts))
        wall = timing.clock() - t0
    return {"output_tok_s": sum(r.completion_tokens for r in replies) / wall, "wall_s": wall,
            "decoding_at_once": round_play.peak_overlap(replies),
            "retracted": watch.retracted, "texts": [r.text for r in replies],
            "completion_tokens": [r.completion_tokens for r in replies],
            "decode_tok_s": [r.decode_tok_s for r in replies],
            "offload": None if not offload else {
                "peak_device_bytes": ow.peak_device_bytes, "over_budget": ow.over_budget,
                "last": ow.last}}


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> None:
        return None


def summarize(played: dict, tok, budget_bytes: int) -> dict:
    out = {}
    for row, runs in played.items():
        r = runs[0]
        s = {"output_tok_s": timing.spread(x["output_tok_s"] for x in runs),
             "decoding_at_once": min(x["decoding_at_once"] for x in runs),
             "retracted": max(x["retracted"] for x in runs),
             "tokens": sum(r["completion_tokens"])}
        if r["offload"] is not None:
            last = r["offload"]["last"] or {}
            s.update(peak_device_bytes=max(x["offload"]["peak_device_bytes"] for x in runs),
                     over_budget=any(x["offload"]["over_budget"] for x in runs),
                     budget_bytes=budget_bytes,
                     host_layers=len(last.get("host_layers", [])),
                     hidden_share=(last.get("host_loads") or {}).get("hidden_share"))
        out[row] = s
    base = played.get("exact")
    for row, s in out.items():
        if base is not None and row != "exact":
            s["tok_s_vs_exact"] = timing.ratio_spread(
                [x["output_tok_s"] for x in played[row]],
                [x["output_tok_s"] for x in base])
    ref, cand = played.get("specontext"), played.get("specontext-offload")
    if ref and cand:
        key = "alone" if "alone" in ref[0] and "alone" in cand[0] else "texts"
        ags = [agreement.greedy_agreement(tok.encode(a, add_special_tokens=False),
                                          tok.encode(b, add_special_tokens=False))
               for a, b in zip(ref[0][key], cand[0][key], strict=True)]
        out["specontext-offload"]["agreement_with_specontext"] = {
            "outputs": "each prompt alone" if key == "alone" else "the timed batch",
            "share": sum(a.share for a in ags) / len(ags), "prefix": [a.prefix for a in ags]}
    return out


def _within(r: dict) -> str:
    if "over_budget" not in r:
        return "-"
    return "no" if r["over_budget"] or r["peak_device_bytes"] > r["budget_bytes"] else "yes"


def markdown(res: dict) -> str:
    c, s = res["config"], res["summary"]
    lines = ["# Long generations under one device KV budget", "",
             (f"Model {c['model']}; {c['requests']} requests at once, {c['prompt_tokens']} "
              f"prompt tokens, {c['gen_tokens']} generated each; budget {c['budget_bytes']:,} "
              f"bytes ({c['budget_tokens']} tokens per request at every layer, "
              f"{c['kv_dtype']}); specontext B={c['specontext_budget']}; git "
              f"{git_label(res['meta'].get('git'))}."), "",
             ("| row | decoding at once | retracted | output tok/s | vs exact | device KV "
              "bytes (peak) | within budget | layers on host | host loads hidden |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for row, r in s.items():
        lines.append(f"| {row} | {r['decoding_at_once']} / {c['requests']} | {r['retracted']} | "
                     f"{cell(r['output_tok_s'])} | {cell(r.get('tok_s_vs_exact'))} | "
                     f"{cell(r.get('peak_device_bytes'), ',.0f')} | "
                     f"{_within(r)} | {r.get('host_layers', '-')} | {cell(r.get('hidden_share'))} |")
    ag = s.get("specontext-offload", {}).get("agreement_with_specontext")
    if ag:
        lines += ["", (f"Greedy agreement of specontext-offload with specontext "
                       f"({ag['outputs']}): {100 * ag['share']:.1f}% of positions; tokens "
                       f"before the first divergence per request: {ag['prefix']}.")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.offload", __doc__)
    cli.add_common(ap, quick="2 requests, 256 in, 768 out, B=64 (minutes)", rounds=cli.ROUNDS_HELP,
                   rounds_default=1)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS, metavar="ROW",
                    help=f"rows, in order (valid: {', '.join(ROWS)})")
    ap.add_argument("--requests", type=int, default=4, metavar="N")
    ap.add_argument("--prompt-tokens", type=int, default=512, metavar="T")
    ap.add_argument("--gen-tokens", type=int, default=7168, metavar="T",
                    help="tokens generated per request (default 7168: 512 + 7168 fill the "
                    "default model's 8k window)")
    ap.add_argument("--budget-tokens", type=int, default=2048, metavar="T",
                    help="the device KV budget: this many tokens per request at every layer")
    ap.add_argument("--min-context", type=int, default=1024, metavar="T",
                    help="the specontext rows' --spec-min-context (their decode profile "
                    "off: every row measures the same thing on every host)")
    ap.add_argument("--budget", type=int, default=1024, metavar="B",
                    help="the specontext rows' --spec-budget (their staging rows, B + sink + "
                    "window per request and layer, come out of the offload row's budget)")
    ap.add_argument("--agreement-tokens", type=int, default=256, metavar="T",
                    help="after the timed phase, each specontext row flushes its cache and "
                    "answers every prompt alone for T tokens (the offload row with its layers "
                    "still on the host): the greedy agreement of the offload row with "
                    "specontext at the same batch (0: skip)")
    ap.add_argument("--prefetch", default="thread", choices=("auto", "inline", "thread"),
                    help="the specontext rows' --spec-prefetch (default thread: the host "
                    "layers' loads run on a worker thread while earlier layers compute)")
    ap.add_argument("--server-flags", default="", metavar="'FLAGS'",
                    help="flags appended to every row's server, one string")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_tokens, args.gen_tokens, args.budget_tokens = 2, 256, 768, 512
        args.min_context, args.budget, args.agreement_tokens = 256, 64, 64
    for flag in ("requests", "prompt_tokens", "gen_tokens", "budget_tokens", "rounds", "budget"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    model = cli.model_path(ap, args.model_path, tokens=args.prompt_tokens + args.gen_tokens)
    from transformers import AutoTokenizer

    with open(os.path.join(model, "config.json")) as f:
        mc = json.load(f)
    layers = mc["num_hidden_layers"]
    kv_heads = mc.get("num_key_value_heads", mc["num_attention_heads"])
    head_dim = mc.get("head_dim", mc["hidden_size"] // mc["num_attention_heads"])
    extra = shlex.split(args.server_flags)
    kv = step_cost.kv_dtype(_value(extra, "--dtype"), _value(extra, "--kv-cache-dtype"), mc)
    row_bytes = 2 * kv_heads * head_dim * ELEMENT_BYTES[kv]  # K and V at one layer
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [[{"role": "user", "content": corpus.document(
        tok, args.prompt_tokens - 48, seed=i) + "\n\n" + INSTRUCTION}]
        for i in range(args.requests)]
    budget_bytes = args.requests * args.budget_tokens * layers * row_bytes
    pool_tokens = int(1.1 * args.requests * (args.prompt_tokens + args.gen_tokens)) + 256
    sparse = ["--spec-decode-profile", "off", "--spec-min-context", str(args.min_context),
              "--spec-prefetch", args.prefetch, "--spec-budget", str(args.budget)]
    cfg = {"model": model, "rows": args.rows, "requests": args.requests,
           "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
           "budget_tokens": args.budget_tokens, "budget_bytes": budget_bytes,
           "kv_dtype": kv, "row_bytes": row_bytes, "offload_pool_tokens": pool_tokens,
           "specontext_flags": sparse, "specontext_budget": args.budget,
           "agreement_tokens": args.agreement_tokens, "server_flags": extra}
    meta, watch = cli.start_meta(model, rounds=args.rounds)
    os.makedirs(args.out, exist_ok=True)
    bar = tqdm(total=len(args.rows) * args.rounds * args.requests, desc="offload", unit="req")

    def run(row: str, i: int) -> dict:
        bar.set_description(f"offload: {row}")
        launcher, flags = row_flags(row, budget_bytes, pool_tokens, row_bytes, layers, sparse)
        log = os.path.join(args.out, f"server-{row}-{i}.log")
        with ServerProcess(launcher, ["--model-path", model, "--enable-metrics", *flags,
                                      *extra], log_path=log) as server:
            out = play(server.url, row, prompts, args.gen_tokens, bar)
            if row.startswith("specontext") and args.agreement_tokens:
                flush_cache(server.url)  # every prompt's prefill cold on both rows
                out["alone"] = [round_play.ask(server.url, p, args.agreement_tokens,
                                               ignore_eos=True).text for p in prompts]
            return out

    played = timing.interleaved(args.rows, args.rounds, run)
    bar.close()
    res = {"meta": cli.finish_meta(meta, watch), "config": cfg,
           "summary": summarize(played, tok, budget_bytes), "played": played}
    md = markdown(res)
    cli.write_results(args.out, res, md)
    print(md)


if __name__ == "__main__":
    main()
