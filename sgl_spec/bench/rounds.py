"""Round Attention's benchmarks (issue 44): capacity under one device KV byte budget, speed
at a long history, and recall over many rounds; rows stock, exact and round mode.

Rows (one server each, the same model, dtype and chat traffic):

* ``stock``: ``sglang.launch_server`` (torch_native attention);
* ``exact``: sgl_spec exact mode on the turn-tagged tree core (round mode's core);
* ``round-topk``, ``round-fixed``, ``round-adaptive``: ``--spec-rounds`` with that strategy
  (``round``: ``round-topk``).

Workloads (``--workload``):

* ``capacity``: every row gets the same device KV byte budget, ``--budget-conversations``
  conversations of ``--rounds-per-conversation`` rounds at every layer's bytes: stock and
  exact get that many tokens; round mode splits the same bytes into a full pool for the
  layers below L_w and an upper tier of ``--upper-share`` of its slots. ``--conversations``
  chats are played round by round, one after the other, then all ask a question at once:
  the most answers decoding at one time (the client's clock), the retractions (sglang's
  metric), the questions whose history was still cached, output tokens/s. Then, on an emptied cache, one
  more conversation alone: the device KV bytes it holds while its question runs (slots in
  use x bytes per slot, per tier, read from the pool), against exact's and against Eq. 2
  for L_w and its kept share k/T.
* ``speed``: one conversation of at least ``--history`` tokens, then ``--questions``
  questions about its rounds: TTFT and decode tokens/s of each (``--decode-tokens``,
  ignore_eos). Side by side: every row's server is up at once (``--sleep-on-idle``: the
  idle ones leave the cores to the one asked) and each question goes to every row in
  turn, so each ratio compares rows in the same stretch of a shared machine; ``--rounds``
  starts them all that many times. ``--conversations N`` plays N such conversations and
  asks their questions at once (a wave): decode at batch N, and the wave's output tokens/s.
* ``recall``: ``--conversations`` chats of 20-40 rounds (one fact each), then a question
  about a fact of an early, a middle and a recent round each: exact match per position,
  greedy agreement with the exact row, and the kept share k/T.

    python -m sgl_spec.bench.rounds --workload capacity --out DIR
    python -m sgl_spec.bench.rounds --workload speed --rows exact round --rounds 3 --out DIR
    python -m sgl_spec.bench.rounds --workload speed --rows exact round --conversations 4 --out DIR
    python -m sgl_spec.bench.rounds --workload recall --quick --out DIR
    python -m sgl_spec.bench.rounds --workload recall --part 2 6 --out DIR   # a slice of it
    python -m sgl_spec.bench.rounds --pool DIR DIR ... --out DIR           # parts, as one

The full recall preset is hours on a CPU: ``--part A B`` plays its conversations A..B-1
(the same conversations, questions and budget as the whole preset), and ``--pool`` sums
parts of one preset (same model, L_w, rows and seed; no conversation twice) into one
table.

Every row reads L_w from ``--watershed`` or the model's calibrated profile
(``python -m sgl_spec.calibrate watershed``).
"""

from __future__ import annotations

import math
import os
import random
import statistics
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import requests
from tqdm import tqdm

from sgl_spec.bench import cli, configset, round_play, timing
from sgl_spec.bench.provenance import git_label
from sgl_spec.bench.render import cell
from sgl_spec.bench.scoring import exact_match
from sgl_spec.bench.server import SPEC, STOCK, ServerProcess, flush_cache
from sgl_spec.rounds.conversations import conversation

ROWS = ("stock", "exact", "round-topk", "round-fixed", "round-adaptive")
WORKLOADS = ("capacity", "speed", "recall")
DEFAULT_ROWS = {"capacity": ["stock", "exact", "round-topk"],
                "speed": ["stock", "exact", "round-topk"],
                "recall": ["exact", "round-topk", "round-fixed", "round-adaptive"]}
POSITIONS = ("early", "middle", "recent")
QUESTION_TOKENS = 32


def n_tokens(tok, messages) -> int:
    """Tokens of ``messages`` rendered by the model's chat template (with the assistant
    header a request adds)."""
    text = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


def row_name(row: str) -> str:
    return "round-topk" if row == "round" else row


def row_server(row: str, model: str, budget_tokens: int, watershed: int, layers: int,
               upper_share: float, extra: list[str], log_path: str) -> ServerProcess:
    """The row's server: ``budget_tokens`` tokens of every layer's KV bytes, split into
    tiers for round mode (the same bytes)."""
    common = ["--model-path", model, "--enable-cache-report", "--enable-metrics", *extra]
    if row == "stock":
        return ServerProcess(STOCK, [*common, *configset.LAUNCHERS["stock"].flags,
                                     "--max-total-tokens", str(budget_tokens)],
                             log_path=log_path)
    if row == "exact":
        return ServerProcess(SPEC, [*common, "--spec-tree-core", "tagged",
                                    "--max-total-tokens", str(budget_tokens)], log_path=log_path)
    full, upper = tier_sizes(budget_tokens, watershed, layers, upper_share)
    return ServerProcess(SPEC, [*common, "--spec-rounds", "--spec-round-watershed",
                                str(watershed), "--spec-round-strategy", row.split("-", 1)[1],
                                "--max-total-tokens", str(full),
                                "--spec-round-upper-tokens", str(upper)], log_path=log_path)


def tier_sizes(budget_tokens: int, watershed: int, layers: int, share: float
               ) -> tuple[int, int]:
    """(full slots, upper slots) whose bytes equal ``budget_tokens`` at every layer, the
    upper tier holding ``share`` of the full pool's slots."""
    full = int(budget_tokens * layers / (watershed + share * (layers - watershed)))
    return full, max(1, int(share * full))


def _cache(url: str) -> dict:
    return requests.get(url + "/sgl_spec/cache", timeout=60).json()


# ---- workloads -------------------------------------------------------------------------
def probe_one(url: str, row: str, conv) -> dict:
    """One conversation alone on an emptied cache, its question sampled for the device KV
    bytes in use (``Watch``: slots in use x bytes per slot, per tier, read from the pool):
    what one conversation costs, and round mode's kept share k/T for it."""
    flush_cache(url)
    round_play.history(url, conv)
    before = _cache(url).get("tiers")
    with round_play.Watch(url, every_s=0.05, pool=True) as watch:
        reply = round_play.ask(url, list(conv.messages), QUESTION_TOKENS, ignore_eos=True)
    after = _cache(url).get("tiers")
    share = None
    if before and after and after["tokens_seen"] > before["tokens_seen"]:
        share = (after["tokens_kept"] - before["tokens_kept"]) / (
            after["tokens_seen"] - before["tokens_seen"])
    return {"bytes": watch.peak_bytes, "sample": watch.peak_sample, "kept_share": share,
            "prompt_tokens": reply.prompt_tokens, "tiers": after,
            "pool": _cache(url).get("pool")}


def play_capacity(server: ServerProcess, row: str, convs, bar, probe_conv=None) -> dict:
    url = server.url
    for c in convs:  # one chat after the other; the budget keeps what it can of them
        round_play.history(url, c)
        bar.update(c.rounds)
    before = _cache(url).get("tiers") if row != "stock" else None
    with round_play.Watch(url) as watch, ThreadPoolExecutor(len(convs)) as pool:
        t0 = timing.Stopwatch()
        replies = list(pool.map(lambda c: round_play.ask(url, list(c.messages),
                                                         QUESTION_TOKENS, ignore_eos=True),
                                convs))
        wall = t0.elapsed()
    bar.update(len(convs))
    probe = probe_one(url, row, probe_conv) if probe_conv is not None and row != "stock" \
        else None
    bar.update(probe_conv.rounds + 1 if probe_conv is not None else 0)
    after = _cache(url).get("tiers") if row != "stock" else None
    hist = [r.prompt_tokens for r in replies]
    kept_share = None
    if before is not None and after is not None:
        seen = after["tokens_seen"] - before["tokens_seen"]
        kept_share = (after["tokens_kept"] - before["tokens_kept"]) / seen if seen else None
    return {
        "conversations": len(convs), "peak_running": round_play.peak_overlap(replies),
        "retracted": watch.retracted,
        "history_cached": sum(r.cached_tokens >= 0.9 * r.prompt_tokens for r in replies),
        "output_tok_s": sum(r.completion_tokens for r in replies) / wall, "wall_s": wall,
        "ttft_s": [r.ttft_s for r in replies], "prompt_tokens": hist,
        "kept_share": kept_share, "probe": probe,
        "bytes_per_conversation": probe and probe["bytes"],
    }


def turn_order(rows: list[str], j: int) -> list[str]:
    """The rows in the order question ``j`` is asked of them: rotated by one per question,
    so every row goes first (after the idlest stretch) as often as the others."""
    k = j % len(rows)
    return rows[k:] + rows[:k]


def play_speed(servers: dict[str, ServerProcess], convs, warmups, waves, tokens: int,
               bar) -> dict[str, dict]:
    """Side by side: every conversation's history played on every row's server, one
    untimed question each, then each wave (one question per conversation, asked at once)
    sent to every row in turn (the order rotating per wave), so that a wave's rows meet
    the same stretch of a shared machine."""
    for server in servers.values():
        for conv, warmup in zip(convs, warmups, strict=True):
            round_play.history(server.url, conv)
            round_play.ask(server.url, warmup, 8, ignore_eos=True)
            bar.update(conv.rounds)
    rows = list(servers)
    out: dict[str, list[dict]] = {row: [] for row in rows}
    waves_out: dict[str, list[dict]] = {row: [] for row in rows}
    with ThreadPoolExecutor(len(convs)) as pool:
        for j, wave in enumerate(waves):
            for row in turn_order(rows, j):
                url = servers[row].url
                t0 = timing.clock()
                replies = list(pool.map(
                    lambda msgs: round_play.ask(url, msgs, tokens, ignore_eos=True), wave))
                wall = timing.clock() - t0
                out[row] += [{"ttft_s": r.ttft_s, "decode_tok_s": r.decode_tok_s,
                              "prompt_tokens": r.prompt_tokens,
                              "cached_tokens": r.cached_tokens} for r in replies]
                waves_out[row].append({"output_tok_s": sum(r.completion_tokens
                                                           for r in replies) / wall,
                                       "decoding_at_once": round_play.peak_overlap(replies)})
                bar.update(len(wave))
    return {row: {"questions": out[row], "waves": waves_out[row],
                  "kept_share": None if row == "stock"
                  else (_cache(servers[row].url).get("tiers") or {}).get("kept_share")}
            for row in rows}


def asked_selection(selections: list[dict], rid: str | None, asked: int) -> dict | None:
    """From the server's newest selections (``GET /sgl_spec/cache`` -> tiers ->
    last_selections), request ``rid``'s: the candidate rounds' shares, the rounds kept,
    whether the asked round was kept and its rank among the candidates; None where the
    server made none for it."""
    sel = next((x for x in reversed(selections) if x["rid"] == rid), None)
    if sel is None:
        return None
    out = {"kept": sel["kept"], "asked_kept": asked in sel["kept"]}
    if sel["share"] is not None and asked in sel["rounds"]:
        share = dict(zip(sel["rounds"], sel["share"], strict=True))
        out.update(share=share, asked_share=share[asked],
                   asked_rank=1 + sum(v > share[asked] for v in share.values()))
    return out


def play_recall(server: ServerProcess, row: str, convs, bar) -> dict:
    out = []
    for conv, asks in convs:
        round_play.history(server.url, conv)
        bar.update(conv.rounds)
        values = [f.value for f in conv.facts]
        for pos, msgs, gold in asks:
            r = round_play.ask(server.url, msgs, QUESTION_TOKENS)
            a = {"position": pos, "text": r.text, "gold": gold,
                 "em": exact_match(r.text, gold), "asked_round": values.index(gold) + 1}
            if row.startswith("round-"):
                sels = (_cache(server.url).get("tiers") or {}).get("last_selections") or []
                a["selection"] = asked_selection(sels, r.rid, a["asked_round"])
            out.append(a)
            bar.update()
    tiers = _cache(server.url).get("tiers") if row != "stock" else None
    return {"answers": out, "kept_share": tiers and tiers["kept_share"],
            "tokens_seen": tiers and tiers.get("tokens_seen")}


def recall_preset(quick: bool, conversations: int | None = None
                  ) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """The recall preset's conversations, (lo, hi) rounds and (lo, hi) prose tokens per
    round (8k-16k tokens of history: the long-context model's); ``--quick``: three short."""
    if quick:
        return conversations or 3, (20, 24), (60, 120)
    return conversations or 18, (20, 40), (300, 420)


def recall_set(tok, n: int, rounds: tuple[int, int], round_tokens: tuple[int, int],
               seed: int):
    """``n`` conversations of ``rounds`` (lo, hi) rounds, each with a question about an
    early, a middle and a recent round's fact: [(conv, [(position, messages, gold)])]."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        conv = conversation(tok, rng.randint(*rounds), round_tokens, seed=seed * 7919 + i)
        k = conv.rounds
        picks = {"early": rng.randint(1, max(1, k // 5)),
                 "middle": rng.randint(2 * k // 5 + 1, 3 * k // 5),
                 "recent": rng.randint(k - 1, k)}
        asks = []
        for pos in POSITIONS:
            fact = conv.facts[picks[pos] - 1]
            msgs = [*conv.messages[:-1], {"role": "user", "content":
                                          f"What is the {fact.key}? Answer with the number."}]
            asks.append((pos, msgs, fact.value))
        out.append((conv, asks))
    return out


# ---- summary ---------------------------------------------------------------------------
def summarize(workload: str, played: dict, layers: int, watershed: int) -> dict:
    out = {}
    ref = played.get("exact")
    for row, runs in played.items():
        if workload == "capacity":
            r = runs[0]
            out[row] = {k: r[k] for k in ("peak_running", "retracted",
                                          "history_cached", "output_tok_s",
                                          "bytes_per_conversation", "kept_share")}
            out[row]["conversations"] = r["conversations"]
            out[row]["output_tok_s_rounds"] = timing.spread(x["output_tok_s"] for x in runs)
            probe = r["probe"]
            if probe and probe["kept_share"] is not None:
                out[row]["probe_kept_share"] = probe["kept_share"]
                out[row]["eq2_share"] = watershed / layers + probe["kept_share"] * (
                    1 - watershed / layers)
        elif workload == "speed":
            qs = [q for run in runs for q in run["questions"]]
            ws = [w for run in runs for w in run["waves"]]
            out[row] = {"ttft_s": timing.spread(q["ttft_s"] for q in qs),
                        "decode_tok_s": timing.spread(q["decode_tok_s"] for q in qs),
                        "output_tok_s": timing.spread(w["output_tok_s"] for w in ws),
                        "decoding_at_once": max(w["decoding_at_once"] for w in ws),
                        "history_tokens": min(q["prompt_tokens"] for q in qs),
                        "kept_share": runs[0]["kept_share"]}
        else:
            ans = runs[0]["answers"]
            em = {p: 100 * statistics.mean(a["em"] for a in ans if a["position"] == p)
                  for p in POSITIONS}
            agree = None
            if ref is not None:
                agree = sum(a["text"] == b["text"] for a, b in
                            zip(ans, ref[0]["answers"], strict=True)) / len(ans)
            sel = [a for a in ans if a.get("selection")]  # all, or a run that kept none
            kept = {p: 100 * statistics.mean(a["selection"]["asked_kept"] for a in sel
                                             if a["position"] == p) for p in POSITIONS} \
                if len(sel) == len(ans) else None
            out[row] = {"em": em, "greedy_agreement": agree, "n": len(ans),
                        "kept_share": runs[0]["kept_share"], "asked_kept": kept}
    base = out.get("exact")
    for row, s in out.items():
        if base is None or row == "exact":
            continue
        if workload == "capacity":
            s["running_vs_exact"] = s["peak_running"] / max(1, base["peak_running"])
            s["tok_s_vs_exact"] = s["output_tok_s"] / base["output_tok_s"]
            if s["bytes_per_conversation"] and base["bytes_per_conversation"]:
                s["bytes_vs_exact"] = s["bytes_per_conversation"] / base["bytes_per_conversation"]
                if s.get("eq2_share"):
                    s["bytes_vs_eq2"] = s["bytes_vs_exact"] / s["eq2_share"]
        elif workload == "speed":
            s["decode_vs_exact"] = timing.ratio_spread(
                [q["decode_tok_s"] for run in played[row] for q in run["questions"]],
                [q["decode_tok_s"] for run in played["exact"] for q in run["questions"]])
            s["output_vs_exact"] = timing.ratio_spread(
                [w["output_tok_s"] for run in played[row] for w in run["waves"]],
                [w["output_tok_s"] for run in played["exact"] for w in run["waves"]])
            s["ttft_vs_exact"] = timing.ratio_spread(
                [q["ttft_s"] for run in played[row] for q in run["questions"]],
                [q["ttft_s"] for run in played["exact"] for q in run["questions"]])
        else:
            s["em_vs_exact"] = {p: s["em"][p] - base["em"][p] for p in POSITIONS}
    return out


def pooled_share(parts: list[dict]) -> float | None:
    """k/T over parts: weighted by the tokens each part's selections saw where every part
    recorded them, else the parts' plain mean (runs before ``tokens_seen`` was kept)."""
    shares = [p.get("kept_share") for p in parts]
    if any(s is None for s in shares):
        return None
    seen = [p.get("tokens_seen") for p in parts]
    if all(seen):
        return sum(s * n for s, n in zip(shares, seen, strict=True)) / sum(seen)
    return statistics.mean(shares)


def pool_recall(dirs: list[str]) -> dict:
    """The recall runs in ``dirs`` (parts of one preset) as one result: their answers
    joined per row, summarised again. Raises ValueError on runs that do not belong
    together."""
    import json

    runs = []
    for d in dirs:
        with open(os.path.join(d, "results.json")) as f:
            runs.append(json.load(f))
    if any(r["workload"] != "recall" for r in runs):
        raise ValueError("--pool takes recall runs only")
    same = ("model", "layers", "watershed", "rows", "seed", "round_tokens", "conversations")
    first = runs[0]["config"]
    for d, r in zip(dirs, runs, strict=True):
        diff = [k for k in same if r["config"].get(k) != first.get(k)]
        if diff:
            raise ValueError(f"{d} differs from {dirs[0]} in {', '.join(diff)}")
    seen: set[int] = set()
    for d, r in zip(dirs, runs, strict=True):
        lo, hi = r["config"].get("part") or (0, r["config"]["conversations"])
        if seen & set(range(lo, hi)):
            raise ValueError(f"{d} plays conversations another run played")
        seen |= set(range(lo, hi))
    played = {row: [{"answers": [a for r in runs for a in r["played"][row][0]["answers"]],
                     "kept_share": pooled_share([r["played"][row][0] for r in runs])}]
              for row in first["rows"]}
    cfg = dict(first, part=sorted(seen), pooled=dirs)
    return {"meta": {"git": [r["meta"].get("git") for r in runs],
                     "pooled": [r["meta"] for r in runs]}, "workload": "recall",
            "config": cfg, "summary": summarize("recall", played, first["layers"],
                                                first["watershed"]),
            "played": played}


def markdown(res: dict) -> str:
    w, s = res["workload"], res["summary"]
    lines = [f"# Round Attention: {w}", "",
             f"Model {res['config']['model']}, L_w {res['config']['watershed']} of "
             f"{res['config']['layers']}, rows {', '.join(s)}; "
             f"git {git_label(res['meta'].get('git'))}.",
             ""]
    if w == "capacity":
        c = res["config"]
        lines += [f"Budget: {c['budget_tokens']} tokens at every layer; {c['conversations']} "
                  f"conversations of {c['rounds_per_conversation']} rounds asked at once "
                  f"(upper tier {c['upper_share']} of round mode's full pool).", "",
                  "| row | decoding at once | retracted | histories cached | "
                  "output tok/s | vs exact | KV bytes / conv | vs exact | Eq. 2 | k/T |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row, r in s.items():
            lines.append(
                f"| {row} | {r['peak_running']} / {r['conversations']} | {r['retracted']} | "
                f"{r['history_cached']} | {cell(r['output_tok_s_rounds'])} | "
                f"{cell(r.get('tok_s_vs_exact'))} | "
                f"{cell(r['bytes_per_conversation'], ',.0f')} | "
                f"{cell(r.get('bytes_vs_exact'), '.3f')} | {cell(r.get('eq2_share'), '.3f')} | "
                f"{cell(r.get('probe_kept_share'), '.3f')} |")
    elif w == "speed":
        c = res["config"]
        lines += [f"{c.get('conversations', 1)} conversation(s) of >= {c['history_tokens']} "
                  f"tokens, {c['questions']} waves of one question each "
                  f"({c.get('decode_tokens', 64)} tokens), side by side.", "",
                  "| row | at once | TTFT s | decode tok/s | output tok/s | TTFT vs exact | "
                  "decode vs exact | output vs exact | kept k/T |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row, r in s.items():
            lines.append(f"| {row} | {r.get('decoding_at_once', 1)} | {cell(r['ttft_s'])} | "
                         f"{cell(r['decode_tok_s'])} | {cell(r.get('output_tok_s'))} | "
                         f"{cell(r.get('ttft_vs_exact'))} | {cell(r.get('decode_vs_exact'))} | "
                         f"{cell(r.get('output_vs_exact'))} | {cell(r['kept_share'], '.3f')} |")
    else:
        c = res["config"]
        played = c.get("part") or [0, c["conversations"]]
        played = (f"{len(played)} of them" if len(played) != 2 or "pooled" in c
                  else f"numbers {played[0]}-{played[1] - 1}")
        n = next(iter(s.values()))["n"] // len(POSITIONS)
        lines += [f"Preset: {c['conversations']} conversations of {c['rounds_range'][0]}-"
                  f"{c['rounds_range'][1]} rounds (seed {c['seed']}); played {played}: "
                  f"{n} question(s) per position.", "",
                  ("| row | EM early / middle / recent | vs exact | greedy = exact | k/T | "
                   "asked round kept |"),
                  "|---|---|---|---|---|---|"]
        for row, r in s.items():
            lines.append(f"| {row} | {cell(r['em'])} | {cell(r.get('em_vs_exact'), 'd')} | "
                         f"{cell(r['greedy_agreement'])} | {cell(r['kept_share'], '.3f')} | "
                         f"{cell(r.get('asked_kept'))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.rounds", __doc__)
    cli.add_common(ap, quick="a few small conversations (minutes)", rounds=cli.ROUNDS_HELP,
                   rounds_default=1)
    ap.add_argument("--workload", choices=WORKLOADS, required=True)
    ap.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                    choices=[*ROWS, "round"], help=f"rows, in order (valid: {', '.join(ROWS)}, "
                    "round = round-topk; default per workload)")
    ap.add_argument("--watershed", type=int, default=0, metavar="L_W",
                    help="L_w (default: the model's calibrated profile)")
    ap.add_argument("--conversations", type=int, default=None, metavar="N",
                    help="capacity: chats played (default 8); speed: conversations whose "
                    "questions are asked at once (default 1); recall: chats (default 18)")
    ap.add_argument("--budget-conversations", type=float, default=5.0, metavar="C",
                    help="capacity: the device KV budget, in conversations (default 5)")
    ap.add_argument("--rounds-per-conversation", type=int, default=20, metavar="R")
    ap.add_argument("--upper-share", type=float, default=0.3, metavar="F",
                    help="capacity: round mode's upper tier, a share of its full pool")
    ap.add_argument("--history", type=int, default=6000, metavar="T",
                    help="speed: tokens of the conversation's history (default 6000)")
    ap.add_argument("--questions", type=int, default=8, metavar="Q",
                    help="speed: questions asked of every row, side by side (default 8)")
    ap.add_argument("--decode-tokens", type=int, default=128, metavar="N",
                    help="speed: tokens decoded per question (default 128)")
    ap.add_argument("--round-tokens", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                    help="prose tokens of a round's user turn (default 60 120; recall 300 420: "
                    "8k-16k tokens of history, for the long-context model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--part", type=int, nargs=2, default=None, metavar=("A", "B"),
                    help="recall: play only the preset's conversations A..B-1 (pool the "
                    "parts with --pool)")
    ap.add_argument("--pool", nargs="+", default=None, metavar="DIR",
                    help="sum the recall results of these runs (parts of one preset) "
                    "into --out, and run nothing")
    ap.add_argument("--server-flags", default="", metavar="'FLAGS'",
                    help="flags appended to every row's server, one string")
    args = ap.parse_args(argv)
    if args.pool:
        try:
            res = pool_recall(args.pool)
        except ValueError as e:
            ap.error(str(e))
        md = markdown(res)
        cli.write_results(args.out, res, md)
        print(md)
        return
    if args.part is not None and (args.workload != "recall" or not
                                  0 <= args.part[0] < args.part[1]):
        ap.error("--part A B needs --workload recall and 0 <= A < B")
    if args.round_tokens is None:
        args.round_tokens = recall_preset(args.quick)[2] if args.workload == "recall" \
            else (60, 120)
    rows = [row_name(r) for r in (args.rows or DEFAULT_ROWS[args.workload])]
    rows = list(dict.fromkeys(rows))
    if args.workload != "capacity" and "exact" not in rows:
        ap.error("--rows needs exact: every ratio is against it")
    if args.decode_tokens < 2:
        ap.error("--decode-tokens must be >= 2 (a decode rate needs two tokens)")
    for flag in ("rounds", "questions", "rounds_per_conversation"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not 0 < args.upper_share <= 1:
        ap.error("--upper-share must be in (0, 1]")
    model = cli.model_path(ap, args.model_path)
    import json
    import shlex

    from transformers import AutoTokenizer

    with open(os.path.join(model, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    lw = args.watershed
    if not lw:
        from sgl_spec.rounds import watershed

        prof = watershed.load(watershed.prepare(model))
        lw = prof["watershed"]
        if lw is None:
            ap.error(f"the calibration of {model} found no watershed; pass --watershed")
        for row in rows:  # a server would serve exact here
            if row.startswith("round-") and (weak := watershed.weak_selection(
                    prof, row.split("-", 1)[1])):
                ap.error(f"{weak}; pass --watershed to measure round mode at a layer anyway")
    tok = AutoTokenizer.from_pretrained(model)
    extra = shlex.split(args.server_flags)
    q = args.quick
    cfg = {"model": model, "layers": layers, "watershed": lw, "rows": rows, "seed": args.seed,
           "server_flags": extra, "round_tokens": list(args.round_tokens)}
    if args.workload == "capacity":
        n = args.conversations or (4 if q else 8)
        budget_convs = 2.5 if q else args.budget_conversations
        rounds = 8 if q else args.rounds_per_conversation
        convs = [conversation(tok, rounds, tuple(args.round_tokens), seed=args.seed * 997 + i)
                 for i in range(n)]
        conv_tokens = max(n_tokens(tok, c.messages) for c in convs)
        budget = int(budget_convs * (conv_tokens + QUESTION_TOKENS))
        cfg.update(conversations=n, budget_conversations=budget_convs,
                   rounds_per_conversation=rounds, budget_tokens=budget,
                   conversation_tokens=conv_tokens, upper_share=args.upper_share,
                   tiers=tier_sizes(budget, lw, layers, args.upper_share))
        probe_conv = conversation(tok, rounds, tuple(args.round_tokens), seed=args.seed * 997 + n)
        total = len(rows) * args.rounds * (n + 1) * (rounds + 1)
        work = lambda server, row, bar: play_capacity(server, row, convs, bar,  # noqa: E731
                                                      probe_conv)
    elif args.workload == "speed":
        history = 1500 if q else args.history
        per_round = sum(args.round_tokens) / 2 + 24
        rounds = max(4, math.ceil(history / per_round))
        n = args.conversations or 1
        convs = [conversation(tok, rounds, tuple(args.round_tokens), seed=args.seed + c)
                 for c in range(n)]
        nq = 2 if q else args.questions
        rng = random.Random(args.seed)

        def ask_about(conv, i):
            return [*conv.messages[:-1], {"role": "user", "content":
                    f"What is the {conv.facts[i].key}? Answer with the number."}]

        # per conversation, one question per round drawn (a new prompt each: its TTFT is a
        # new question's), the first one the untimed warm-up; wave j asks every
        # conversation's question j at once
        asked = [[ask_about(c, i) for i in rng.sample(range(rounds), min(nq + 1, rounds))]
                 for c in convs]
        warmups = [a[0] for a in asked]
        waves = [list(w) for w in zip(*(a[1:] for a in asked))]
        tokens = 32 if q else args.decode_tokens
        cfg.update(history_rounds=rounds, questions=len(waves), conversations=n,
                   decode_tokens=tokens,
                   history_tokens=min(n_tokens(tok, c.messages) for c in convs))
        budget = int(1.5 * sum(n_tokens(tok, c.messages) for c in convs)) + 2048
        total = args.rounds * len(rows) * n * (rounds + len(waves))
    else:
        n, rr, _ = recall_preset(q, args.conversations)
        convs = recall_set(tok, n, rr, tuple(args.round_tokens), args.seed)
        longest = max(n_tokens(tok, c.messages) for c, _ in convs)
        budget = int(longest * 2) + 2048  # the whole preset's, so parts run alike
        part = args.part or (0, n)
        if part[1] > n:
            ap.error(f"--part {part[0]} {part[1]}: the preset has {n} conversations")
        convs = convs[part[0]:part[1]]
        cfg.update(conversations=n, rounds_range=list(rr), longest_history=longest,
                   part=list(part))
        total = len(rows) * args.rounds * sum(c.rounds + len(a) for c, a in convs)
        work = lambda server, row, bar: play_recall(server, row, convs, bar)  # noqa: E731
    meta, watch = cli.start_meta(model, rounds=args.rounds, workload=args.workload)
    os.makedirs(args.out, exist_ok=True)
    share = args.upper_share if args.workload == "capacity" else 1.0
    bar = tqdm(total=total, desc=f"rounds {args.workload}", unit="req")

    def run(row: str, i: int) -> dict:
        bar.set_description(f"rounds {args.workload}: {row}")
        log = os.path.join(args.out, f"server-{row}-{i}.log")
        with row_server(row, model, budget, lw, layers, share, extra, log) as server:
            return work(server, row, bar)

    def side_by_side(i: int) -> dict[str, dict]:
        bar.set_description(f"rounds {args.workload}: start {i + 1}")
        with ExitStack() as stack:
            servers = {row: row_server(row, model, budget, lw, layers, share,
                                       [*extra, "--sleep-on-idle"],
                                       os.path.join(args.out, f"server-{row}-{i}.log"))
                       for row in rows}
            for server in servers.values():
                stack.callback(server.stop)
                server.launch()
            for server in servers.values():
                server.start()
            return play_speed(servers, convs, warmups, waves, tokens, bar)

    if args.workload == "speed":  # all rows' servers up at once, each question side by side
        starts = [side_by_side(i) for i in range(args.rounds)]
        played = {row: [s[row] for s in starts] for row in rows}
    else:
        played = timing.interleaved(rows, args.rounds, run)
    bar.close()
    res = {"meta": cli.finish_meta(meta, watch), "workload": args.workload, "config": cfg,
           "summary": summarize(args.workload, played, layers, lw), "played": played}
    md = markdown(res)
    cli.write_results(args.out, res, md)
    print(md)


if __name__ == "__main__":
    main()
