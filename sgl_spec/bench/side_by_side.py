"""Side by side with what a user would pick instead (issue 47): the same workloads, through
the same OpenAI-API client, on stock sglang, sgl_spec and llama.cpp's ``llama-server``.

Rows (``--rows``; one server up at a time, each started ``--rounds`` times, interleaved):

* ``stock``: ``python -m sglang.launch_server`` (torch_native on a CPU);
* ``sgl_spec``: ``python -m sgl_spec.launch_server`` with its defaults (exact attention);
* ``sgl_spec-loopserve``, ``sgl_spec-specontext``: with that ``--spec-mode`` (the sparse
  mode a workload favours; its host profile decides where it pays, as served);
* ``llama.cpp-bf16``, ``llama.cpp-f16``: ``llama-server`` on a GGUF converted from the same
  Hugging Face directory (``peers gguf``): the same weights in the same precision;
* ``llama.cpp-q4``: on the quantized GGUF the model ships as (SmolLM2 Q4_1, Qwen2.5-Coder
  Q4_K_M), what a llama.cpp user downloads.

llama.cpp rows use this host's cores as threads, its prompt cache (its default) and as
many slots (``--parallel``) as the workload has requests at once. sglang rows get one KV
pool size (``--max-total-tokens``), enough for the workload's requests at once.

Workloads (``--workload``):

* ``serving``: ``sglang.bench_serving``, ``random-ids`` 1k in / 128 out, 64 prompts at
  each ``--concurrency`` (1 8 32), its OpenAI-compatible backend (``sglang-oai``) for
  every row: output tokens/s, TTFT and TPOT;
* ``shared-prefix``: ``bench_serving`` ``generated-shared-prefix``: groups of requests
  that share a long system prompt (8 groups of 8, 1k-token prefix, 128-token questions,
  64 out) at concurrency 8: what a prefix cache is for;
* ``doc-chat``: a ~3k- and a ~7k-token document, each asked a question and then 4
  follow-ups (greedy, 64 tokens): TTFT per turn; every row is sent the first row's
  answers as its history, so prompts match; answers compared with the ``sgl_spec`` row's;
* ``decode``: decode tokens/s after a 1k- and a ~8k-token history (SmolLM2's window
  caps it at 7.9k), 128 tokens (ignore_eos), batch 1 and 4 (distinct documents);
* ``agent``: the research agent (``sgl_spec.agents.research_assistant --api openai``) over
  three ~1.7k-token documents, one after the other: a plan, 3 forked answers sent at once,
  the join's report and a follow-up: seconds end to end and the share of prompt tokens
  the server reports cached; later rows are sent the first row's plan, answers and report
  (the same prompts); answers compared with the ``sgl_spec`` row's.

Every ratio is against ``stock`` (or the first row), with the spread over rounds.

    python -m sgl_spec.bench.peers build        # once, for the llama.cpp rows
    python -m sgl_spec.bench.side_by_side --workload serving --rounds 2 --out DIR
    python -m sgl_spec.bench.side_by_side --workload doc-chat --rows stock sgl_spec \\
        llama.cpp-bf16 --out DIR
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from tqdm import tqdm

from sgl_spec.bench import cli, configset, timing
from sgl_spec.bench.provenance import git_label
from sgl_spec.bench.render import cell
from sgl_spec.bench.server import SPEC, STOCK, ServerProcess, _die_with_parent, free_port, tail
from sgl_spec.launch_server import CPU_MAX_TOTAL_TOKENS

WORKLOADS = ("serving", "shared-prefix", "doc-chat", "decode", "agent")
AGENT_DOCS = ("textwrap", "json", "argparse")  # stdlib modules' docstrings
AGENT_FOLLOW_UP = "Which one of these points matters most to a new user, and why?"


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # "sglang" or "llama.cpp"
    flags: tuple[str, ...] = ()
    module: str = SPEC
    gguf: str = ""  # llama.cpp: "bf16", "f16" or "quant"


ROWS = {r.name: r for r in (
    Row("stock", "sglang", tuple(configset.LAUNCHERS["stock"].flags), STOCK),
    Row("sgl_spec", "sglang"),
    Row("sgl_spec-loopserve", "sglang", ("--spec-mode", "loopserve")),
    Row("sgl_spec-specontext", "sglang", ("--spec-mode", "specontext")),
    Row("llama.cpp-bf16", "llama.cpp", gguf="bf16"),
    Row("llama.cpp-f16", "llama.cpp", gguf="f16"),
    Row("llama.cpp-q4", "llama.cpp", gguf="quant"),
)}
DEFAULT_ROWS = ("stock", "sgl_spec", "llama.cpp-bf16", "llama.cpp-q4")


@dataclass(frozen=True)
class Workload:
    """What a workload sends: ``parallel`` requests at most at once; ``ctx`` tokens a
    request may need (history and answer)."""

    parallel: int
    ctx: int

    @property
    def pool_tokens(self) -> int:
        """The KV pool every sglang row gets: stock sizes its own from free memory and
        sgl_spec's launcher caps a CPU's (``CPU_MAX_TOTAL_TOKENS``), so unlike pools would
        queue requests on one row that the other runs at once."""
        return max(CPU_MAX_TOTAL_TOKENS, self.parallel * self.ctx)


def workload(name: str, concurrency: tuple[int, ...]) -> Workload:
    if name == "serving":
        return Workload(max(concurrency), 1024 + 128 + 64)
    if name == "shared-prefix":
        return Workload(8, 1024 + 128 + 64 + 64)
    if name == "doc-chat":
        return Workload(1, 8192)
    if name == "agent":
        return Workload(3, 4096)  # the forks at once
    return Workload(4, 8192)


def quant_gguf(model: str) -> str:
    """The quantized GGUF the model at ``model`` ships as (``model_sources``)."""
    from sgl_spec import envs, model_sources

    name = os.path.basename(os.path.normpath(model))
    for src in model_sources.SOURCES.values():
        if src.dir_name == name:
            work = os.path.join(envs.cache_dir(), "peers", "quant")
            os.makedirs(work, exist_ok=True)
            return src.gguf(work)
    raise ValueError(f"no quantized GGUF is known for {name}; valid models: "
                     f"{', '.join(s.dir_name for s in model_sources.SOURCES.values())}")


def sglang_args(row: Row, model: str, wl: Workload) -> list[str]:
    """An sglang row's flags: the same pool for every row, then the row's own."""
    return ["--model-path", model, "--enable-cache-report", "--enable-metrics",
            "--max-total-tokens", str(wl.pool_tokens), *row.flags]


@contextmanager
def serve(row: Row, model: str, wl: Workload, log_path: str):
    """The row's server, up; yields its base URL."""
    if row.kind == "sglang":
        args = sglang_args(row, model, wl)
        with ServerProcess(row.module, args, log_path=log_path, timeout_s=600) as server:
            yield server.url
        return
    from sgl_spec.bench import peers

    if not peers.is_built():
        raise peers.PeerError("the llama.cpp rows need its server: run python -m "
                              "sgl_spec.bench.peers build (once, minutes)")
    path = quant_gguf(model) if row.gguf == "quant" else peers.gguf(model, row.gguf)
    port = free_port()
    cmd = peers.server_argv(path, port, parallel=wl.parallel, ctx=wl.ctx)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent)  # gone if we are killed
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            peers.wait_ready(url, proc)
        except peers.PeerError as e:
            raise peers.PeerError(f"{e}; log {log_path}:\n{tail(log_path)}") from None
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=30)


# ---- bench_serving -----------------------------------------------------------------------
def bench_serving_cmd(url: str, model: str, out_file: str, dataset: str, prompts: int,
                      concurrency: int, seed: int = 1) -> list[str]:
    """One ``sglang.bench_serving`` run through its OpenAI completions backend (and
    ``bench_serving_sse``: llama-server's keep-alive lines skipped)."""
    cmd = [sys.executable, "-m", "sgl_spec.bench.bench_serving_sse", "--backend", "sglang-oai",
           "--base-url", url, "--tokenizer", model, "--model", model,
           "--dataset-name", dataset, "--num-prompts", str(prompts),
           "--max-concurrency", str(concurrency), "--request-rate", "inf",
           "--seed", str(seed), "--output-file", out_file, "--disable-tqdm"]
    if dataset == "random-ids":
        cmd += ["--random-input-len", "1024", "--random-output-len", "128",
                "--random-range-ratio", "1.0"]
    else:
        cmd += ["--gsp-num-groups", "8", "--gsp-prompts-per-group", str(prompts // 8),
                "--gsp-system-prompt-len", "1024", "--gsp-question-len", "128",
                "--gsp-output-len", "64"]
    return cmd


def run_bench_serving(cmd: list[str], log_path: str, prompts: int) -> dict:
    from sgl_spec.bench import serving

    out_file = cmd[cmd.index("--output-file") + 1]
    raw = serving.run_command(cmd, out_file, prompts, log_path, timeout_s=7200)
    return {k: raw[k] for k in serving.METRICS if k in raw}


# ---- chat and decode -----------------------------------------------------------------------
def doc_chats(tok, seed: int = 0):
    from sgl_spec.bench import chats

    return [chats.conversations(tok, chats.ChatConfig(1, 5, n, 0, 64, seed=seed + i),
                                f"doc-{n // 1000}k")[0]
            for i, n in enumerate((3000, 7000))]


def play_doc_chat(url: str, model: str, scripts, history: dict | None) -> dict:
    from sgl_spec.bench import chat_client

    client = chat_client.make_client(url)  # it adds /v1
    chat_client.warmup(client, model)
    out = {}
    for s in scripts:
        turns = chat_client.play(client, model, s, 64,
                                 history=None if history is None else history[s.name])
        out[s.name] = [{"ttft_s": t.ttft_s, "text": t.text, "prompt_tokens": t.prompt_tokens,
                        "cached_tokens": t.cached_tokens} for t in turns]
    return out


def decode_prompts(tok, histories=(1024, 7900), batch: int = 4) -> dict[int, list[str]]:
    from sgl_spec import corpus

    return {n: [corpus.document(tok, n, seed=1000 + 17 * n + i) for i in range(batch)]
            for n in histories}


def play_decode(url: str, prompts: dict[int, list[str]], batches=(1, 4),
                tokens: int = 128) -> dict:
    from sgl_spec.bench import round_play

    out = {}
    round_play.ask(url, [{"role": "user", "content": "Say hello."}], 8)  # warm-up
    for n, docs in prompts.items():
        for b in batches:
            msgs = [[{"role": "user", "content": d + "\n\nSummarize the text above."}]
                    for d in docs[:b]]
            with ThreadPoolExecutor(b) as pool:
                replies = list(pool.map(
                    lambda m: round_play.ask(url, m, tokens, ignore_eos=True), msgs))
            first = min(r.first_at for r in replies)
            last = max(r.last_at for r in replies)
            out[f"{n}/{b}"] = {
                "history": n, "batch": b,
                "decode_tok_s": statistics.median(r.decode_tok_s for r in replies),
                "output_tok_s": sum(r.completion_tokens for r in replies) / (last - first),
                "ttft_s": statistics.median(r.ttft_s for r in replies),
                "completion_tokens": [r.completion_tokens for r in replies]}
    return out


def play_agent(url: str, pinned: dict | None) -> dict:
    """The research agent over each of ``AGENT_DOCS`` through the OpenAI API; ``pinned``:
    the first row's results, whose texts the later prompts carry."""
    from sgl_spec.agents import research_assistant as ra
    from sgl_spec.bench import round_play

    round_play.ask(url, [{"role": "user", "content": "Say hello."}], 8)  # warm-up
    out = {}
    for name in AGENT_DOCS:
        first = ra.AgentResult(**{k: pinned[name][k] for k in (
            "question", "plan", "sub_questions", "sub_answers", "report", "follow_up")}
        ) if pinned else None
        res = ra.run_research_openai(url, ra.stdlib_document(name), follow_up=AGENT_FOLLOW_UP,
                                     pinned=first)
        out[name] = res.to_json()
    return out


# ---- summary -----------------------------------------------------------------------------
def summarize(name: str, played: dict[str, list[dict]]) -> dict:
    """Per row and point, the spread over rounds of each figure and of its ratio to the
    first row's; doc-chat adds answer agreement with the ``sgl_spec`` row."""
    rows = list(played)
    base = rows[0]
    figure = {"serving": ("output_throughput", "mean_ttft_ms", "mean_tpot_ms"),
              "shared-prefix": ("output_throughput", "mean_ttft_ms", "mean_tpot_ms"),
              "decode": ("decode_tok_s", "output_tok_s", "ttft_s"),
              "agent": ("elapsed_s", "hit_ratio", "prompt_tokens")}.get(name)
    out: dict = {}
    for row in rows:
        runs = played[row]
        if name == "doc-chat":
            points = {f"{c}/{i + 1}": [r[c][i]["ttft_s"] for r in runs]
                      for c in runs[0] for i in range(len(runs[0][c]))}
            ref = [r[c][i]["ttft_s"] for r in played[base] for c in r
                   for i in range(len(r[c]))]
            mine = [r[c][i]["ttft_s"] for r in runs for c in r for i in range(len(r[c]))]
            out[row] = {"ttft_s": {p: timing.spread(v) for p, v in points.items()},
                        "ttft_vs_first": timing.ratio_spread(mine, ref)}
            if "sgl_spec" in played:
                pairs = [(a["text"], b["text"]) for r, q in zip(runs, played["sgl_spec"])
                         for c in r for a, b in zip(r[c], q[c])]
                out[row]["answers_equal_sgl_spec"] = sum(a == b for a, b in pairs) / len(pairs)
            continue
        out[row] = {}
        for point in runs[0]:
            cell_ = {f: timing.spread(r[point][f] for r in runs) for f in figure}
            mine = [r[point][figure[0]] for r in runs]
            first = [r[point][figure[0]] for r in played[base]]
            # a rate against the first row's; for the agent's seconds, the first's over
            # this row's: above 1 is faster either way
            cell_["vs_first"] = (timing.ratio_spread(first, mine) if name == "agent"
                                 else timing.ratio_spread(mine, first))
            out[row][point] = cell_
        if name == "agent" and "sgl_spec" in played:
            texts = [(agent_texts(r[d]), agent_texts(q[d]))
                     for r, q in zip(runs, played["sgl_spec"]) for d in r]
            pairs = [(a, b) for x, y in texts for a, b in zip(x, y)]
            out[row]["answers_equal_sgl_spec"] = sum(a == b for a, b in pairs) / len(pairs)
    return out


def agent_texts(res: dict) -> list[str]:
    """An agent run's generated texts, in call order."""
    return [res["plan"], *res["sub_answers"], res["report"], res["follow_up"] or ""]


def markdown(res: dict) -> str:
    s, name = res["summary"], res["workload"]
    rows = list(s)
    lines = [f"# Side by side: {name}", "", f"Model {res['config']['model']}; rounds "
             f"{res['config']['rounds']}; git {git_label(res['meta'].get('git'))}. Ratios against "
             f"{rows[0]} (median, min-max over rounds).", ""]
    if name == "doc-chat":
        points = list(s[rows[0]]["ttft_s"])
        lines += ["| row | " + " | ".join(f"TTFT {p}" for p in points)
                  + " | vs first | answers = sgl_spec |",
                  "|---|" + "---|" * (len(points) + 2)]
        for row, r in s.items():
            lines.append(f"| {row} | " + " | ".join(cell(r["ttft_s"][p]) for p in points)
                         + f" | {cell(r['ttft_vs_first'])} | "
                         f"{cell(r.get('answers_equal_sgl_spec'))} |")
        return "\n".join(lines) + "\n"
    if name == "agent":
        points = list(AGENT_DOCS)
        lines += [("Seconds end to end per agent run (plan, forks, report, follow-up), the "
                   "share of prompt tokens the server reported cached, and the speed against "
                   f"{rows[0]} (its seconds over the row's):"), "",
                  "| row | " + " | ".join(f"{p} s" for p in points) + " | "
                  + " | ".join(f"cached {p}" for p in points) + " | "
                  + " | ".join(f"vs first @ {p}" for p in points) + " | answers = sgl_spec |",
                  "|---|" + "---|" * (3 * len(points) + 1)]
        for row, r in s.items():
            lines.append(f"| {row} | " + " | ".join(cell(r[p]["elapsed_s"]) for p in points)
                         + " | " + " | ".join(cell(r[p]["hit_ratio"]) for p in points) + " | "
                         + " | ".join(cell(r[p]["vs_first"]) for p in points)
                         + f" | {cell(r.get('answers_equal_sgl_spec'))} |")
        return "\n".join(lines) + "\n"
    key = "decode_tok_s" if name == "decode" else "output_throughput"
    points = list(s[rows[0]])
    label = "history/batch" if name == "decode" else "concurrency"
    lines += [f"{key} by {label}:", "",
              "| row | " + " | ".join(f"{p}" for p in points) + " | "
              + " | ".join(f"vs first @ {p}" for p in points) + " |",
              "|---|" + "---|" * (2 * len(points))]
    for row, r in s.items():
        lines.append(f"| {row} | " + " | ".join(cell(r[p][key]) for p in points) + " | "
                     + " | ".join(cell(r[p]["vs_first"]) for p in points) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.side_by_side", __doc__)
    cli.add_common(ap, quick=None, rounds=cli.ROUNDS_HELP, rounds_default=1)
    ap.add_argument("--workload", choices=WORKLOADS, required=True)
    ap.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), metavar="ROW",
                    choices=list(ROWS), help=f"rows, in order (valid: {', '.join(ROWS)}; "
                    f"default: {' '.join(DEFAULT_ROWS)})")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], metavar="C",
                    help="serving: bench_serving's --max-concurrency values (default 1 8 32)")
    ap.add_argument("--prompts", type=int, default=64, metavar="N",
                    help="serving, shared-prefix: prompts per bench_serving run (default 64)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.prompts < 8 or min(args.concurrency) < 1:
        ap.error("--rounds and --concurrency must be >= 1, --prompts >= 8")
    rows = list(dict.fromkeys(args.rows))
    model = cli.model_path(ap, args.model_path)
    wl = workload(args.workload, tuple(args.concurrency))
    os.makedirs(args.out, exist_ok=True)
    meta, watch = cli.start_meta(model, rounds=args.rounds, workload=args.workload)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    scripts = doc_chats(tok) if args.workload == "doc-chat" else None
    prompts = decode_prompts(tok) if args.workload == "decode" else None
    steps = {"serving": len(args.concurrency)}.get(args.workload, 1)
    bar = tqdm(total=len(rows) * args.rounds * steps, desc="side by side", unit="run")
    pinned: dict = {}

    def run(row: str, i: int) -> dict:
        bar.set_description(f"side by side: {row} ({i + 1}/{args.rounds})")
        log = os.path.join(args.out, f"server-{row}-{i}.log")
        with serve(ROWS[row], model, wl, log) as url:
            if args.workload == "doc-chat":
                got = play_doc_chat(url, model, scripts, pinned.get("history"))
                pinned.setdefault("history", {c: [t["text"] for t in ts]
                                              for c, ts in got.items()})
                bar.update()
                return got
            if args.workload == "decode":
                got = play_decode(url, prompts)
                bar.update()
                return got
            if args.workload == "agent":
                got = play_agent(url, pinned.get("agent"))
                pinned.setdefault("agent", got)
                bar.update()
                return got
            got = {}
            for c in (args.concurrency if args.workload == "serving" else [8]):
                ds = "random-ids" if args.workload == "serving" else "generated-shared-prefix"
                f = os.path.join(args.out, f"bench-{row}-{i}-c{c}.jsonl")
                got[str(c)] = run_bench_serving(
                    bench_serving_cmd(url, model, f, ds, args.prompts, c),
                    os.path.join(args.out, f"bench-{row}-{i}-c{c}.log"), args.prompts)
                bar.update()
            return got

    played = timing.interleaved(rows, args.rounds, run)
    bar.close()
    res = {"meta": cli.finish_meta(meta, watch), "workload": args.workload,
           "config": {"model": model, "rows": rows, "rounds": args.rounds,
                      "concurrency": args.concurrency, "prompts": args.prompts,
                      "parallel": wl.parallel, "ctx": wl.ctx},
           "summary": summarize(args.workload, played), "played": played}
    md = markdown(res)
    cli.write_results(args.out, res, md)
    print(md)


if __name__ == "__main__":
    main()
