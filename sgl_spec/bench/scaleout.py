"""Scale-out: one multi-turn workload on one sgl_spec server, on a ``--dp-size 2`` server
and behind sglang-router (cache-aware) with two sgl_spec workers (issue 18, item 6).

N conversations, each with its own growing context (a document, then more text every
turn), are played concurrently; each turn is sent after the previous answer, greedy,
with a fixed answer budget, through sglang's ``/generate`` (the chat template applied
here). Rows:

* ``single``: one sgl_spec server, the reference;
* ``dp2``: one sgl_spec server with ``--dp-size 2`` (its DP controller dispatches by
  cached prefix: ``--spec-dp-dispatch cache_aware``, the default);
* ``dp2-rr`` (only when asked for): the same with ``--spec-dp-dispatch sglang`` (sglang's
  round robin, blind to the cache);
* ``dp2-router``: sglang-router ``--dp-aware --policy cache_aware`` in front of that
  same ``--dp-size 2`` server (the router picks the DP rank);
* ``router``: sglang-router ``--policy cache_aware`` in front of two sgl_spec servers;
* ``tp2`` (only when asked for): one sgl_spec server with ``--tp-size 2``.

Every row after the reference is sent the reference's prompts (its answers are the
history), so each turn's output compares token by token. Per row: completed and failed
turns, turns whose output differs from the reference (first differing position), the
cached-token share of follow-up turns (cached / prompt tokens, turns 2..T) and its ratio
to the reference's, and which worker served each conversation's turns (sglang's
``meta_info``: ``dp_rank``, and ``weight_version``, which names each router worker)::

    python -m sgl_spec.bench.scaleout --out results/scaleout   # ~22 min on 2 shared cores

Needs ``pip install 'sgl_spec[scaleout]'`` (sglang-router) for the router rows.
Loopback only.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass

import requests
from tqdm import tqdm

from sgl_spec.bench import cli, configset, render
from sgl_spec.bench.chat_client import ChatScript
from sgl_spec.bench.chats import ChatConfig, conversations
from sgl_spec.bench.server import SPEC, ServerProcess, flush_cache, free_port

ROWS = ("single", "dp2", "dp2-router", "router", "dp2-rr", "tp2")
DEFAULT_ROWS = ROWS[:4]
ROUTER = "sglang_router.launch_router"
DEFAULT_FLAGS = "--spec-cache-eviction turn"


@dataclass(frozen=True)
class Turn:
    """One turn as one row answered it; ``error`` is set (and the rest empty) on failure."""

    conversation: str
    turn: int  # 1-based
    round: int  # 1-based
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_ids: tuple[int, ...] = ()
    text: str = ""
    worker: str = ""  # weight_version, and /dp<rank> where the server has DP ranks
    error: str = ""


def cached_share(turns: list[Turn]) -> float | None:
    """Cached prompt tokens over prompt tokens, summed over completed follow-up turns
    (turn 1 has nothing of its own to find); None without any."""
    follow = [t for t in turns if t.turn > 1 and not t.error]
    total = sum(t.prompt_tokens for t in follow)
    return sum(t.cached_tokens for t in follow) / total if total else None


def first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """The first position where two token sequences differ (a length counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mismatches(turns: list[Turn], reference: dict[tuple[str, int], Turn]) -> list[dict]:
    """Completed turns whose output differs from the reference's same turn."""
    out = []
    for t in turns:
        ref = reference.get((t.conversation, t.turn))
        if t.error or ref is None:
            continue
        pos = first_difference(t.output_ids, ref.output_ids)
        if pos is not None:
            out.append({"conversation": t.conversation, "turn": t.turn, "round": t.round,
                        "position": pos})
    return out


def placement(turns: list[Turn]) -> dict:
    """Requests per worker, and per conversation (and round) the workers of its turns in
    order; ``moves`` counts follow-ups served elsewhere than the turn before."""
    by_conv: dict[str, list[Turn]] = {}
    for t in sorted(turns, key=lambda t: (t.round, t.conversation, t.turn)):
        if not t.error:
            by_conv.setdefault(f"{t.conversation} r{t.round}", []).append(t)
    paths = {k: [t.worker for t in v] for k, v in by_conv.items()}
    moves = sum(sum(a != b for a, b in zip(p, p[1:])) for p in paths.values())
    return {"requests": dict(sorted(Counter(t.worker for t in turns if not t.error).items())),
            "paths": paths, "moves": moves,
            "one_worker": sum(len(set(p)) == 1 for p in paths.values())}


def summarize(turns: list[Turn], reference: dict[tuple[str, int], Turn] | None,
              ref_share: float | None, expected: int) -> dict:
    share = cached_share(turns)
    diff = mismatches(turns, reference) if reference is not None else None
    done = [t for t in turns if not t.error]
    return {"completed": len(done), "failed": expected - len(done),
            "errors": sorted({t.error for t in turns if t.error}),
            "mismatches": diff, "cached_share": share,
            "share_ratio": share / ref_share if share is not None and ref_share else None,
            "placement": placement(turns)}


def _generate(url: str, text: str, max_tokens: int) -> dict:
    body = {"text": text, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens}}
    r = requests.post(url + "/generate", json=body, timeout=900)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
    return r.json()


def play_conversation(url: str, tok, script: ChatScript, max_tokens: int, rnd: int,
                      history: dict[tuple[str, int], Turn] | None, bar) -> list[Turn]:
    """Turn after turn; the assistant history is ``history``'s answers where given (the
    reference's), else this row's own. A failed turn ends the conversation."""
    messages: list[dict] = []
    out = []
    for i, user in enumerate(script.user_turns, start=1):
        messages.append({"role": "user", "content": user})
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        try:
            res = _generate(url, text, max_tokens)
        except (requests.RequestException, RuntimeError, ValueError) as exc:
            out.append(Turn(script.name, i, rnd, error=f"{type(exc).__name__}: {exc}"[:300]))
            bar.update(len(script.user_turns) - i + 1)
            return out
        meta = res["meta_info"]
        rank = meta.get("dp_rank")
        turn = Turn(script.name, i, rnd, meta["prompt_tokens"], meta.get("cached_tokens", 0),
                    tuple(res.get("output_ids") or ()), res["text"],
                    str(meta.get("weight_version")) + ("" if rank is None else f"/dp{rank}"))
        out.append(turn)
        bar.update(1)
        answer = history[(script.name, i)].text if history else turn.text
        messages.append({"role": "assistant", "content": answer})
    return out


def play(url: str, tok, scripts: list[ChatScript], max_tokens: int, rnd: int,
         history: dict | None, bar) -> list[Turn]:
    """All conversations at once, one thread each."""
    with ThreadPoolExecutor(max_workers=len(scripts)) as pool:
        runs = pool.map(lambda s: play_conversation(url, tok, s, max_tokens, rnd, history,
                                                    bar), scripts)
        return [t for run in runs for t in run]


def wait_workers(router_url: str, count: int, timeout_s: float = 120.0) -> None:
    """sglang-router answers ``/health`` before it has registered its workers (in the
    background): wait until ``/readiness`` counts ``count`` healthy ones (a ``--dp-aware``
    router counts one per DP rank), else RuntimeError with what it last said."""
    deadline = time.monotonic() + timeout_s
    said = ""
    while time.monotonic() < deadline:
        try:
            said = requests.get(router_url + "/readiness", timeout=5).text
            if json.loads(said).get("healthy_workers", 0) >= count:
                return
        except (requests.RequestException, ValueError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{router_url}: not {count} healthy workers after {timeout_s:.0f} s: "
                       f"{said[:200]}")


@contextmanager
def deployment(kind: str, flags: list[str], logs: str) -> Iterator[dict[str, list[str]]]:
    """The servers behind a row group; yields {row: [url to play, urls to flush...]}."""
    def server(name: str, extra: list[str]) -> ServerProcess:
        return ServerProcess(SPEC, [*flags, "--weight-version", name, *extra],
                             log_path=os.path.join(logs, f"{name}.log"))

    def router(name: str, urls: list[str], extra: list[str]) -> ServerProcess:
        # A busy CPU worker answers /health late (it generates a token): the router's 5 s
        # default timed out 4-6 times in a run here (3 in a row drop the worker).
        return ServerProcess(ROUTER, ["--worker-urls", *urls, "--policy", "cache_aware",
                                      "--prometheus-host", "127.0.0.1", "--prometheus-port",
                                      str(free_port()), "--health-check-timeout-secs", "60",
                                      *extra],
                             log_path=os.path.join(logs, f"{name}.log"))

    with ExitStack() as stack:
        if kind == "single":
            s = stack.enter_context(server("single", []))
            yield {"single": [s.url, s.url]}
        elif kind == "dp2":
            s = stack.enter_context(server("dp2", ["--dp-size", "2"]))
            r = stack.enter_context(router("dp2-router", [s.url], ["--dp-aware"]))
            wait_workers(r.url, 2)
            yield {"dp2": [s.url, s.url], "dp2-router": [r.url, s.url]}
        elif kind == "dp2-rr":
            s = stack.enter_context(server("dp2-rr", ["--dp-size", "2",
                                                      "--spec-dp-dispatch", "sglang"]))
            yield {"dp2-rr": [s.url, s.url]}
        elif kind == "tp2":
            s = stack.enter_context(server("tp2", ["--tp-size", "2"]))
            yield {"tp2": [s.url, s.url]}
        else:
            workers = [server(f"worker-{i}", []).launch() for i in range(2)]
            for w in workers:
                stack.enter_context(w)
            r = stack.enter_context(router("router", [w.url for w in workers], []))
            wait_workers(r.url, 2)
            yield {"router": [r.url, *(w.url for w in workers)]}


GROUPS = {"single": ("single",), "dp2": ("dp2", "dp2-router"), "router": ("router",),
          "dp2-rr": ("dp2-rr",), "tp2": ("tp2",)}


def markdown(res: dict) -> str:
    cfg = res["config"]
    head = (f"{cfg['conversations']} conversations x {cfg['turns']} turns, played "
            f"concurrently ({cfg['first_tokens']}-token document, +{cfg['turn_tokens']} "
            f"tokens a turn, {cfg['max_tokens']} new tokens, greedy), {cfg['rounds']} "
            f"round(s); sgl_spec flags: `{cfg['flags']}`. Outputs and shares against "
            f"`single`'s first round.")
    rows = []
    for name, s in res["summary"].items():
        p, diff = s["placement"], s["mismatches"]
        rows.append([name, str(s["completed"]), str(s["failed"]),
                     "n/a" if diff is None else str(len(diff)),
                     "-" if not diff else ", ".join(
                         f"{d['conversation']} t{d['turn']}@{d['position']}" for d in diff[:4]),
                     render.num(s["cached_share"], 100, 1), render.ratio(s["share_ratio"]),
                     ", ".join(f"{w}: {n}" for w, n in p["requests"].items()),
                     f"{p['one_worker']}/{len(p['paths'])}", str(p["moves"])])
    table = render.table(["row", "completed", "failed", "outputs != single",
                          "first difference (turn@token)", "follow-up cached %",
                          "share / single", "requests per worker",
                          "conversations on one worker", "moves"], rows)
    return "\n".join([head, "", *table]) + "\n"


def main(argv: list[str] | None = None) -> None:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.scaleout", __doc__)
    cli.add_common(ap, rounds="play the workload R times on every row, caches flushed in "
                   "between; single's later rounds show how repeatable outputs are "
                   "(default 1)", rounds_default=1)
    ap.add_argument("--conversations", type=int, default=4, metavar="N")
    ap.add_argument("--turns", type=int, default=3, metavar="T")
    ap.add_argument("--first-tokens", type=int, default=500, metavar="K",
                    help="tokens of each conversation's opening document (default 500)")
    ap.add_argument("--turn-tokens", type=int, default=200, metavar="K",
                    help="tokens of new text every later turn adds (default 200)")
    ap.add_argument("--max-tokens", type=int, default=24, metavar="M")
    ap.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), choices=ROWS,
                    metavar="ROW", help=f"rows to play, of {', '.join(ROWS)} (default: "
                    f"{' '.join(DEFAULT_ROWS)}); without single, no comparison")
    ap.add_argument("--flags", default=DEFAULT_FLAGS,
                    help=f"extra sgl_spec.launch_server flags for every server, one string "
                    f"given with '=' (--flags='--spec-mode loopserve'; default {DEFAULT_FLAGS!r})")
    args = ap.parse_args(argv)
    for flag in ("conversations", "turns", "rounds", "max_tokens", "first_tokens"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    try:
        cfg = ChatConfig(args.conversations, args.turns, args.first_tokens, args.turn_tokens,
                         args.max_tokens)
    except ValueError as exc:
        ap.error(str(exc))
    model = cli.model_path(ap, args.model_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    scripts = conversations(tok, cfg, "conv")
    flags = ["--model-path", model, *configset.COMMON_FLAGS, "--sleep-on-idle",
             *shlex.split(args.flags)]
    rows = [r for r in ROWS if r in args.rows]
    meta, watch = cli.start_meta(model, rounds=args.rounds)
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    per_round = args.conversations * args.turns
    bar = tqdm(total=len(rows) * args.rounds * per_round, desc="scaleout", unit="turn")
    played: dict[str, list[Turn]] = {}
    reference: dict[tuple[str, int], Turn] | None = None
    for kind, members in GROUPS.items():
        if not any(r in rows for r in members):
            continue
        with deployment(kind, flags, logs) as urls:
            for row in (r for r in members if r in rows):
                for rnd in range(1, args.rounds + 1):
                    for u in urls[row][1:]:
                        flush_cache(u)
                    bar.set_postfix_str(f"{row} round {rnd}")
                    turns = play(urls[row][0], tok, scripts, args.max_tokens, rnd,
                                 reference, bar)
                    played.setdefault(row, []).extend(turns)
                    if row == "single" and rnd == 1:
                        reference = {(t.conversation, t.turn): t for t in turns if not t.error}
    bar.close()
    ref_share = cached_share([t for t in played.get("single", []) if t.round == 1])
    res = {
        "meta": cli.finish_meta(meta, watch),
        "config": {**asdict(cfg), "rounds": args.rounds, "flags": args.flags, "rows": rows},
        "summary": {r: summarize(v, reference, ref_share, args.rounds * per_round)
                    for r, v in played.items()},
        "played": {r: [asdict(t) for t in v] for r, v in played.items()},
    }
    md = markdown(res)
    cli.write_results(args.out, res, md)
    print(md)


if __name__ == "__main__":
    main()
