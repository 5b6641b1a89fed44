"""Aborted streams, malformed requests, then short questions: do the answers equal a fresh
server's? (issue 48's reproduction).

Per seed, one server (by default the issue's flags: LoopServe decode from 512 tokens of
history and LoopServe prefill from 1024 new tokens, a 32k pool, an API key) plays:

1. ``--streams`` streamed chat requests (``max_tokens`` 200, ``ignore_eos``, greedy), each
   a user message of 300, 900 or 1500 words of prose and "Summarise.", started
   ``--gap-s`` apart on separate connections, each closed by the client after 0-30
   streamed chunks (0: before the first token);
2. six malformed requests (bad JSON, an unknown role, no messages, ``max_tokens`` -3, a
   prompt over the context, non-UTF-8 bytes): each must get a 400;
3. the probe questions, greedy, one at a time.

A fresh server with the same flags answers the probes first: the reference. Each answer
after the sequence is compared token by token (``agreement.divergence``): identical, a
divergence at a near tie (the top-2 margin at the first differing token within
``agreement.NEAR_TIE_NATS``), or wrong. The servers run with ``--spec-check-invariants``
(``--no-check-invariants`` to leave it out), whose counts the table shows::

    python -m sgl_spec.bench.aborts --seeds 0 1 2 3 4 --out results/aborts

Writes results.json and results.md. Loopback only; ~8 minutes a seed on 2 cores.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from dataclasses import asdict

import requests
from tqdm import tqdm

from sgl_spec import corpus
from sgl_spec.bench import agreement, cli, render
from sgl_spec.bench.chat_client import make_client, stream_turn
from sgl_spec.bench.server import SPEC, ServerProcess

logger = logging.getLogger(__name__)

API_KEY = "K"
ISSUE_FLAGS = ("--max-total-tokens", "32768", "--api-key", API_KEY, "--spec-mode", "loopserve",
               "--spec-min-context", "512", "--spec-prefill", "loopserve",
               "--spec-prefill-min-tokens", "1024")
WORDS = (300, 900, 1500)  # words of prose per streamed request
MAX_CHUNKS = 30  # a stream is cut after 0..MAX_CHUNKS chunks
PROBES = ("What is the capital of France?", "Name three primary colours.",
          "What is 12 times 12?", "Who wrote Romeo and Juliet?")
PROBE_TOKENS = 16
PROBE_CHATS = [[{"role": "user", "content": q}] for q in PROBES]
OVER_CONTEXT_WORDS = 12000


def _words() -> list[str]:
    return " ".join(text for _, text in corpus.paragraphs()).split()


def prose(words: list[str], n: int, rng: random.Random) -> str:
    start = rng.randrange(0, len(words) - n)
    return " ".join(words[start : start + n])


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def stream_and_cut(url: str, messages: list[dict], cut_after: int, max_tokens: int = 200,
                   api_key: str | None = API_KEY) -> int:
    """Stream one greedy chat request (``ignore_eos``) and close the connection after
    ``cut_after`` chunks (0: before the first token); returns the chunks read."""
    body = {"model": "default", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "messages": messages}
    read = 0
    with requests.post(url + "/v1/chat/completions", json=body, headers=_headers(api_key),
                       stream=True, timeout=1800) as r:
        for _ in r.iter_lines():
            if read >= cut_after:
                break
            read += 1
    return read


def cut_streams(url: str, plan: list[tuple[list[dict], int]], gap_s: float,
                max_tokens: int = 200, api_key: str | None = API_KEY,
                beside=None) -> list[dict]:
    """Stream each ``(messages, cut_after)`` of ``plan`` on its own connection and thread,
    ``gap_s`` apart, and ``beside()`` (if given) on one more thread meanwhile; returns
    per stream the chunks read or the error, once every thread is done."""
    out: list[dict] = [{"cut_after": c} for _, c in plan]

    def one(i: int) -> None:
        try:
            out[i]["chunks"] = stream_and_cut(url, plan[i][0], plan[i][1], max_tokens, api_key)
        except requests.RequestException as e:
            out[i]["error"] = str(e)[:200]

    threads = [threading.Thread(target=beside, daemon=True)] if beside else []
    for i in range(len(plan)):
        threads.append(threading.Thread(target=one, args=(i,), daemon=True))
    for t in threads:
        t.start()
        time.sleep(gap_s)
    for t in threads:
        t.join()
    return out


def aborted_streams(url: str, seed: int, streams: int, gap_s: float,
                    first_words: int | None = None) -> list[dict]:
    """Step 1: the issue's streams (``WORDS`` of prose, cut after 0-``MAX_CHUNKS``);
    ``first_words``: the first one's length instead of a draw."""
    rng, words = random.Random(seed), _words()
    sizes = [(rng.choice(WORDS), rng.randint(0, MAX_CHUNKS)) for _ in range(streams)]
    if first_words is not None:
        sizes[0] = (first_words, sizes[0][1])
    plan = [([user(prose(words, n, rng) + "\n\nSummarise.")], c) for n, c in sizes]
    out = cut_streams(url, plan, gap_s)
    for o, (n, _) in zip(out, sizes):
        o["words"] = n
    return out


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def malformed(url: str, api_key: str | None = API_KEY) -> list[int]:
    """Step 2: the statuses of the six malformed requests (each should be 400)."""
    u, auth = url + "/v1/chat/completions", _headers(api_key)
    raw = {**auth, "Content-Type": "application/json"}
    chat = lambda **kw: {"model": "default", "messages": [user("hi")], **kw}  # noqa: E731
    over = " ".join((_words() * 2)[:OVER_CONTEXT_WORDS])
    return [
        requests.post(u, data=b"{not json", headers=raw, timeout=60).status_code,
        requests.post(u, json=chat(messages=[{"role": "wizard", "content": "hi"}]),
                      headers=auth, timeout=60).status_code,
        requests.post(u, json=chat(messages=[]), headers=auth, timeout=60).status_code,
        requests.post(u, json=chat(max_tokens=-3), headers=auth, timeout=60).status_code,
        requests.post(u, json=chat(messages=[user(over)]), headers=auth,
                      timeout=600).status_code,
        requests.post(u, data=b"\xff\xfe\x00garbage", headers=raw, timeout=60).status_code,
    ]


def probe(url: str, conversations: list[list[dict]], api_key: str | None = API_KEY,
          max_tokens: int = PROBE_TOKENS) -> list:
    """Step 3: greedy answers (ids and top-2 logprobs), one conversation at a time."""
    client = make_client(url, api_key=api_key or "none")
    return [stream_turn(client, "default", messages, max_tokens, f"probe-{i}", 1)
            for i, messages in enumerate(conversations)]


def server_state(url: str, api_key: str | None = API_KEY) -> dict:
    j = requests.get(url + "/sgl_spec/cache", headers=_headers(api_key), timeout=60).json()
    return {"live_requests": j["live_requests"], "invariants": j.get("invariants")}


def compare(reference: list, answers: list) -> list[dict]:
    out = []
    for ref, got in zip(reference, answers, strict=True):
        div = agreement.divergence(ref, got)
        out.append({"probe": ref.conversation, "text": got.text, "reference_text": ref.text,
                    "verdict": "identical" if div is None else
                    "near tie" if div.near_tie else "wrong",
                    "divergence": asdict(div) if div else None})
    return out


def run(flags: list[str], seeds: list[int], streams: int, gap_s: float, log_dir: str,
        first_words: int | None = None) -> dict:
    with ServerProcess(SPEC, flags, log_path=f"{log_dir}/server-fresh.log") as server:
        reference = probe(server.url, PROBE_CHATS)
    seeds_out = []
    for seed in tqdm(seeds, desc="seeds", unit="seed"):
        with ServerProcess(SPEC, flags, log_path=f"{log_dir}/server-seed{seed}.log",
                           timeout_s=600) as server:
            t0 = time.monotonic()
            played = aborted_streams(server.url, seed, streams, gap_s, first_words)
            statuses = malformed(server.url)
            answers = probe(server.url, PROBE_CHATS)
            seeds_out.append({"seed": seed, "streams": played, "malformed_statuses": statuses,
                              "probes": compare(reference, answers),
                              "seconds": time.monotonic() - t0, **server_state(server.url)})
    return {"flags": flags, "reference": [{"probe": r.conversation, "text": r.text}
                                          for r in reference], "seeds": seeds_out}


def markdown(res: dict) -> str:
    rows = []
    for s in res["seeds"]:
        verdicts = [p["verdict"] for p in s["probes"]]
        diffs = "; ".join(
            f"{p['probe']}: {p['text']!r} (margin "
            f"{render.num(_margin(p['divergence']), digits=3)})"
            for p in s["probes"] if p["divergence"]) or "-"
        inv = s["invariants"] or {}
        rows.append([str(s["seed"]), " ".join(map(str, s["malformed_statuses"])),
                     str(verdicts.count("identical")), str(verdicts.count("near tie")),
                     str(verdicts.count("wrong")), diffs,
                     f"{inv.get('violations', '-')} in {inv.get('checks', '-')}",
                     "yes" if not any(s["live_requests"].values()) else
                     json.dumps(s["live_requests"])])
    head = (f"Flags: `{' '.join(res['flags'])}`. Per seed: the malformed requests' statuses; "
            f"the {len(PROBES)} probes' answers against a fresh server's: identical, a "
            f"divergence at a near tie (margin <= {agreement.NEAR_TIE_NATS} nats) or wrong; "
            "the invariant checks' violations; per-request structures empty at the end.")
    return "\n".join([head, "", *render.table(
        ["seed", "malformed", "identical", "near tie", "wrong", "differing answers (margin at "
         "the first differing token)", "invariant violations", "empty"], rows)]) + "\n"


def _margin(div: dict) -> float | None:
    known = [m for m in (div["reference_margin"], div["candidate_margin"]) if m is not None]
    return min(known) if known else None


def main(argv: list[str] | None = None) -> None:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.aborts", __doc__)
    cli.add_common(ap)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                    help="one server per seed (default 0-4)")
    ap.add_argument("--streams", type=int, default=24, help="streamed requests (default 24)")
    ap.add_argument("--gap-s", type=float, default=0.2,
                    help="seconds between the streams' starts (default 0.2)")
    ap.add_argument("--server-flags", default=" ".join(ISSUE_FLAGS),
                    help="sgl_spec.launch_server flags (default: the issue's)")
    ap.add_argument("--first-words", type=int, metavar="N",
                    help="the first stream's words instead of a draw (1500: a long first "
                         "request, which prefills the chat template's system prompt "
                         "sparsely under the default flags)")
    ap.add_argument("--no-check-invariants", action="store_true",
                    help="serve without --spec-check-invariants")
    args = ap.parse_args(argv)
    if args.streams < 1 or (args.first_words is not None and args.first_words < 1):
        ap.error(f"--streams {args.streams} and --first-words {args.first_words} must be >= 1")
    model = cli.model_path(ap, args.model_path)
    flags = ["--model-path", model, *args.server_flags.split()]
    if "--api-key" not in flags:
        flags += ["--api-key", API_KEY]
    if not args.no_check_invariants:
        flags.append("--spec-check-invariants")
    meta, watch = cli.start_meta(model, seeds=args.seeds)
    os.makedirs(args.out, exist_ok=True)
    res = run(flags, args.seeds, args.streams, args.gap_s, args.out, args.first_words)
    res["meta"] = cli.finish_meta(meta, watch)
    md = markdown(res)
    cli.write_results(args.out, res, md)
    print(md)


if __name__ == "__main__":
    main()
