"""Why round mode missed a recall answer: the round selection of a question, replayed.

For questions of the multi-round recall preset (``bench.rounds --workload recall``), runs
the model's layers up to L_w in transformers (float32) over the question's prompt and
scores the earlier rounds as a server does there (``select.piece_peak`` and
``round_scores`` on the question's last ``SCORE_QUERIES`` queries). Per question: the asked
round's rank and share, whether each strategy keeps it (with the last ``--recent`` rounds
and the most attended one, as a server does), and the top rounds with their facts' keys.
With ``--losses``, the questions a round row answered wrong where exact was right (or,
``--which``, every wrong one), and the round whose fact each wrong answer is. A miss then
reads as either

* a *selection miss*: the asked round was not kept, or
* a *misread*: it was kept, and the answer came from another kept round (its key is
  often nearly the asked one).

Neither is certain: the layers below L_w read every round, so a question can be answered
from a round the selection left (what they carried into the question's own tokens).

The served selection reads the pool's keys (bfloat16 by default); float32 ranks can
differ where two rounds' scores are close.

    python -m sgl_spec.bench.round_why --model-path M --watershed 12 --ask 11:recent 10:early
    python -m sgl_spec.bench.round_why --model-path M --watershed 12 --losses RUN [RUN ...]
"""

from __future__ import annotations

import json
import os

import torch
from tqdm import tqdm

from sgl_spec.bench import cli
from sgl_spec.bench.rounds import POSITIONS, recall_preset, recall_set
from sgl_spec.rounds.runtime import SCORE_QUERIES
from sgl_spec.rounds.select import (
    STRATEGIES,
    piece_peak,
    round_scores,
    select,
    strategy,
)

TOP = 4  # rounds listed per question
WHICH = ("lost", "wrong", "all")  # --which: exact right and a round row wrong; any wrong


def losses(run_dir: str, which: str = "lost", preset: dict | None = None) -> list[dict]:
    """The questions of a recall run (``bench.rounds --out``) that a round row answered
    wrong and exact right (``which`` "lost"), that a round row answered wrong ("wrong"),
    or every one ("all"): [{conv, position, rows: {row: its wrong answer}}]. ValueError
    where the run's config differs from ``preset``'s keys (another preset or L_w: its
    questions would be replayed on other conversations)."""
    if which not in WHICH:
        raise ValueError(f"which {which!r} is invalid; valid: {', '.join(WHICH)}")
    with open(os.path.join(run_dir, "results.json")) as f:
        res = json.load(f)
    cfg = res["config"]
    if bad := [f"{k} {cfg.get(k)} (here {v})" for k, v in (preset or {}).items()
               if cfg.get(k) != v]:
        raise ValueError(f"{run_dir} played another preset: {', '.join(bad)}; pass the "
                         "run's own --watershed, --seed and --quick")
    first = (cfg.get("part") or [0])[0]
    played = {row: runs[0]["answers"] for row, runs in res["played"].items()}
    if "exact" not in played:
        raise ValueError(f"{run_dir}: no exact row to compare with")
    out: dict[tuple[int, str], dict] = {}
    for row, answers in played.items():
        for i, (a, ref) in enumerate(zip(answers, played["exact"], strict=True)):
            key = (first + i // len(POSITIONS), a["position"])
            if which == "all":
                out.setdefault(key, {"conv": key[0], "position": key[1], "rows": {}})
            if row != "exact" and not a["em"] and (ref["em"] or which != "lost"):
                out.setdefault(key, {"conv": key[0], "position": key[1], "rows": {}})
                out[key]["rows"][row] = a["text"]
    return sorted(out.values(), key=lambda d: (d["conv"], POSITIONS.index(d["position"])))


def parse_ask(s: str) -> dict:
    conv, _, pos = s.partition(":")
    if not conv.isdigit() or pos not in POSITIONS:
        raise ValueError(f"--ask {s!r}: want CONV:POSITION, POSITION one of "
                         f"{', '.join(POSITIONS)}")
    return {"conv": int(conv), "position": pos, "rows": {}}


def load_lower(model_path: str, watershed: int):
    """(model with only its first ``watershed`` layers, tokenizer), float32, q/k captured."""
    from sgl_spec.bench import qk_capture

    model, tok = qk_capture.load_model(model_path)
    if not 1 <= watershed < model.config.num_hidden_layers:
        raise ValueError(f"--watershed {watershed}: valid 1..{model.config.num_hidden_layers - 1}")
    model.model.layers = model.model.layers[:watershed]
    model.config.num_hidden_layers = watershed
    return model, tok


def explain(model, tok, conv, asks, position: str, recent: int) -> dict:
    """The selection at L_w (the model's last layer) for ``conv``'s question at
    ``position``."""
    from sgl_spec.bench import qk_capture
    from sgl_spec.cache.turn_format import derive
    from sgl_spec.rounds.watershed import round_spans

    msgs, gold = next((m, g) for p, m, g in asks if p == position)
    values = [f.value for f in conv.facts]
    asked = values.index(gold)  # 0-based: round asked + 1
    text = tok.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    spans = round_spans(ids, derive(tok))
    if len(spans) != conv.rounds:
        raise RuntimeError(f"the template yields {len(spans)} rounds, the chat has {conv.rounds}")
    lw = qk_capture.capture(model, ids)[-1]
    q = lw.q[max(spans[-1][1], len(ids) - SCORE_QUERIES):]
    peak = piece_peak(q, lw.k, spans, lw.q.shape[-1] ** -0.5)
    share = round_scores(peak, [[i] for i in range(len(spans))])
    share = share / share.sum().clamp_min(1e-30)
    order = torch.argsort(share, descending=True).tolist()
    picked = {s: select(share, strategy(s), recent) for s in STRATEGIES}
    return {"rounds": conv.rounds, "tokens": len(ids), "asked_round": asked + 1,
            "asked_key": conv.facts[asked].key, "asked_rank": order.index(asked) + 1,
            "asked_share": float(share[asked]),
            "kept": {s: asked in p for s, p in picked.items()},
            "picked": {s: [i + 1 for i in p] for s, p in picked.items()},
            "top": [{"round": i + 1, "share": float(share[i]), "key": conv.facts[i].key}
                    for i in order[:TOP]],
            "value_round": {v: i + 1 for i, v in enumerate(values)}}


def verdict(q: dict) -> dict[str, str]:
    """Per row that lost the question: selection miss or misread (and from which round)."""
    out = {}
    for row, text in q["rows"].items():
        how = row.removeprefix("round-")
        src = q["value_round"].get(text.strip())
        where = f"round {src}'s value" if src else "no round's value"
        if how in q["kept"] and not q["kept"][how]:
            out[row] = f"selection miss ({where})"
        else:
            out[row] = f"misread: {where}" + (" (kept)" if src and how in q["picked"]
                                              and src in q["picked"][how] else "")
    return out


def markdown(res: dict) -> str:
    kept_by = f"kept by {' / '.join(STRATEGIES)}"
    lines = [f"# Round selection replayed at L_w {res['watershed']} (float32)", "",
             f"Model {res['model']}; recent rounds always kept: {res['recent']}.", "",
             f"| conv | position | asked round (rank, share) | {kept_by} | top rounds | lost by |",
             "|---|---|---|---|---|---|"]
    for q in res["questions"]:
        top = "; ".join(f"{t['round']} ({t['share']:.3f}, {t['key']})" for t in q["top"])
        kept = " / ".join("yes" if q["kept"][s] else "no" for s in STRATEGIES)
        lost = "; ".join(f"{r}: {v}" for r, v in q["verdict"].items()) or "-"
        lines.append(f"| {q['conv']} | {q['position']} | {q['asked_round']} of {q['rounds']} "
                     f"({q['asked_rank']}, {q['asked_share']:.3f}): {q['asked_key']} | "
                     f"{kept} | {top} | {lost} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.round_why", __doc__)
    cli.add_common(ap, out="write results.json and results.md here", out_required=False,
                   quick="the --quick preset's conversations")
    ap.add_argument("--watershed", type=int, required=True, metavar="L_W")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--ask", nargs="+", metavar="CONV:POSITION",
                       help=f"questions to replay (POSITION: {', '.join(POSITIONS)})")
    group.add_argument("--losses", nargs="+", metavar="RUN",
                       help="replay the questions of these recall runs (bench.rounds --out) "
                       "that --which picks")
    ap.add_argument("--which", choices=WHICH, default="lost",
                    help="with --losses: lost (a round row wrong where exact was right; the "
                    "default), wrong (a round row wrong), all")
    ap.add_argument("--recent", type=int, default=1, metavar="N",
                    help="rounds before the question always kept (--spec-round-recent)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n, rr, round_tokens = recall_preset(args.quick)
    preset = {"watershed": args.watershed, "seed": args.seed, "conversations": n,
              "rounds_range": list(rr), "round_tokens": list(round_tokens)}
    try:
        qs = ([parse_ask(s) for s in args.ask] if args.ask else
              [q for run in args.losses for q in losses(run, args.which, preset)])
    except (ValueError, OSError, KeyError) as e:
        ap.error(str(e))
    if args.recent < 0:
        ap.error("--recent must be >= 0")
    model_path = cli.model_path(ap, args.model_path)
    if bad := [q["conv"] for q in qs if q["conv"] >= n]:
        ap.error(f"conversation(s) {bad} outside the preset's 0..{n - 1}")
    try:
        model, tok = load_lower(model_path, args.watershed)
    except ValueError as e:
        ap.error(str(e))
    convs = recall_set(tok, n, rr, round_tokens, args.seed)
    for q in tqdm(qs, desc="round_why: questions", unit="q"):
        q.update(explain(model, tok, *convs[q["conv"]], q["position"], args.recent))
        q["verdict"] = verdict(q)
    res = {"model": model_path, "watershed": args.watershed, "recent": args.recent,
           "seed": args.seed, "questions": qs}
    md = markdown(res)
    if args.out:
        cli.write_results(args.out, res, md)
    print(md)


if __name__ == "__main__":
    main()
