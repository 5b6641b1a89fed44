"""Many-sessions agent workload: conversations over a long document go quiet, their KV is
demoted, and they come back in a shuffled order (issue 17's benchmark).

N conversations each open with a long tool output (a document of ``--doc-tokens`` with
three planted facts: at its begin, middle and end) and a question about one of them; then
every conversation is revisited, in a seeded shuffled order, with short questions about
the other two. The device pool holds about one conversation, so every revisit finds its
history demoted (or dropped). Rows, one server each, all sgl_spec in exact mode so that
only the cache differs:

* ``reference``: a pool that holds everything (never evicted): the answers to match;
* ``recompute``: no HiCache, an evicted history is recomputed;
* ``hicache``: HiCache's full copy in host memory (``--hicache-ratio``);
* ``hicache+file``: the same, plus sglang's ``file`` storage backend (L3);
* ``hicache-tagged``: ``hicache`` on the turn-tagged tree core (``--spec-tree-core
  tagged``), the core every ``krul`` row runs on: Krul against HiCache like for like;
* ``krul``: ``--spec-krul`` (compressed host rows, k8v4) in the same host byte budget;
* ``krul+file``: the same with the ``file`` backend (compressed pages);
* ``krul-int8``: ``--spec-krul-codec int8``, for the accuracy the 4-bit values cost;
* ``krul-recompute``: ``krul`` with ``--spec-krul-profile`` (``--krul-profile FILE``, or
  ``--krul-share F``: a profile that makes the share F): each host copy leaves the
  profile's share unstored and a restore recomputes it while the rest is loaded (not in
  the default rows: this CPU's own calibration chooses share 0);
* ``krul-recompute-pipelined``, ``krul-recompute-serial``: the same with
  ``--spec-krul-restore pipelined`` (the recompute runs while the rest is loaded) and
  ``serial`` (to completion first; ``krul-recompute``, at ``auto``, is that on a CPU); the
  pipelined row is paired with the serial one where both are played: the pair's
  restore-stage ratio is the pipeline's against T_C + T_L.

Every row replays the same prompts: the history's assistant turns are the gold answers,
so TTFTs compare like with like. Per follow-up: TTFT, where its history came from (device,
host, storage, or recomputed: sglang's ``cached_tokens_details``), the answer's exact
match, and whether it equals the reference's answer (greedy agreement). Per row: the
conversations restored without recompute, and, for ``krul``, the bytes each demoted
conversation stores against HiCache's full copy (``GET /sgl_spec/cache``)::

    python -m sgl_spec.bench.sessions --out results/sessions --conversations 5 --doc-tokens 1024
    # ~1 h on a 2-core AVX2 CPU (every row; the defaults, 6 x 4096 tokens, take ~3 h there)

Per follow-up also the server's restore stage (``GET /sgl_spec/cache`` -> ``restore``
around it: ``load_back`` and the copy into the pool, the one part in which a Krul
follow-up and a HiCache one differ), and each Krul row is paired with its HiCache row
follow-up by follow-up (the same conversation, visit and round, both from the host
tier): the spreads of their TTFT and restore-stage ratios.

``--rounds R`` plays every row R times, interleaved, and shows the TTFT spread.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass

import requests
from tqdm import tqdm

from sgl_spec import corpus
from sgl_spec.bench import cli, render, timing
from sgl_spec.bench.dataset import COLOURS, KINDS, OBJECTS, POSITIONS, Fact, draw_values
from sgl_spec.bench.scoring import exact_match
from sgl_spec.bench.server import SPEC, ServerProcess
from sgl_spec.tiers import restore_clock

MAX_NEW_TOKENS = 16
PARTS = ("recompute_seconds", "load_seconds", "overlap_seconds")  # restore_clock's
OPENING = "Here is the output of the document tool. Read it; I will ask about it."
HICACHE = ["--enable-hierarchical-cache", "--hicache-io-backend", "direct",
           "--hicache-mem-layout", "layer_first"]
ROWS = ("reference", "recompute", "hicache", "hicache+file", "krul", "krul+file", "krul-int8",
        "hicache-tagged", "krul-recompute", "krul-recompute-pipelined", "krul-recompute-serial")
DEFAULT_ROWS = ROWS[:-4]


@dataclass(frozen=True)
class Session:
    name: str
    document: str              # with the three facts planted at begin / middle / end
    facts: tuple[Fact, ...]    # in POSITIONS order
    first: int                 # the fact asked in the opening turn; the others at revisits


@dataclass
class Answer:
    session: str
    visit: int                 # 0: the opening turn; 1, 2: revisits
    position: str              # where the asked fact sits in the document
    prompt_tokens: int
    ttft_s: float
    cached: int
    source: str                # device / host / storage / recomputed / new
    text: str
    correct: bool
    # the server's host-tier restore stage during this request (GET /sgl_spec/cache ->
    # restore, before and after): load_back plus the copy into the pool; None without
    # HiCache
    restore_s: float | None = None
    restore_tokens: int | None = None
    # of it, a Krul restore's recompute (T_C), in-line copy (T_L) and the two at once
    restore_parts: dict | None = None


def _plant_at(prose: str, sentences: list[str]) -> str:
    """One sentence in the first, middle and last tenth of ``prose`` (at sentence ends)."""
    cuts = [i + 2 for i in range(len(prose) - 1) if prose[i] == "." and prose[i + 1] in " \n"]
    n = len(prose)
    where = [min(cuts, key=lambda c: abs(c - n * f)) for f in (0.05, 0.5, 0.95)]
    if len(set(where)) < 3:
        raise ValueError("the document has too few sentences to plant three facts")
    out = prose
    for cut, s in sorted(zip(where, sentences), reverse=True):
        out = f"{out[:cut]}{s} {out[cut:]}"
    return out


def sessions(tokenizer, n: int, doc_tokens: int, seed: int) -> list[Session]:
    out = []
    for i in range(n):
        rng = random.Random(seed * 1009 + i)
        prose = corpus.document(tokenizer, doc_tokens - 60, seed=seed * 1009 + i)
        kinds = [rng.choice(sorted(KINDS)) for _ in POSITIONS]
        objects = rng.sample(OBJECTS, 3)
        values = draw_values(rng, kinds, prose)
        facts = tuple(Fact(0, rng.choice(COLOURS), o, k, v)
                      for o, k, v in zip(objects, kinds, values))
        doc = _plant_at(prose, [f.sentence for f in facts])
        out.append(Session(f"s{i}", doc, facts, first=i % 3))
    return out


def plan(sess: list[Session], seed: int) -> list[tuple[int, int]]:
    """(session, visit) in play order: every opening, then the revisits shuffled (a
    session's second revisit after its first)."""
    rng = random.Random(seed)
    revisits = [i for i in range(len(sess)) for _ in (1, 2)]
    rng.shuffle(revisits)
    seen: dict[int, int] = {}
    order = [(i, 0) for i in range(len(sess))]
    for i in revisits:
        seen[i] = seen.get(i, 0) + 1
        order.append((i, seen[i]))
    return order


def asked(s: Session, visit: int) -> int:
    return [s.first, *[j for j in range(3) if j != s.first]][visit]


def messages(s: Session, visit: int) -> list[dict]:
    """The chat up to ``visit``'s question; earlier answers are the gold values."""
    msgs = []
    for v in range(visit + 1):
        q = s.facts[asked(s, v)].question()
        msgs.append({"role": "user", "content": f"{OPENING}\n\n{s.document}\n\n{q}" if v == 0
                     else q})
        if v < visit:
            msgs.append({"role": "assistant", "content": s.facts[asked(s, v)].value})
    return msgs


def n_tokens(tok, msgs: list[dict]) -> int:
    """Tokens of the chat prompt (with the assistant opener) that ``msgs`` make."""
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


def _source(meta: dict, history: int) -> str:
    if history == 0:
        return "new"
    d = meta.get("cached_tokens_details") or {}
    host, storage = int(d.get("host", 0) or 0), int(d.get("storage", 0) or 0)
    cached = int(meta.get("cached_tokens", 0))
    if cached < 0.9 * history:
        return "recomputed"
    return "storage" if storage > 0.5 * history else "host" if host > 0.5 * history else "device"


def ask(url: str, prompt: str) -> tuple[str, float, dict]:
    """Streamed greedy /generate: text, TTFT, the last chunk's meta_info."""
    body = {"text": prompt, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}}
    t0 = time.perf_counter()
    ttft, text, meta = None, "", {}
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None:
                ttft = time.perf_counter() - t0
            text, meta = chunk.get("text", text), chunk.get("meta_info", meta)
    return text, ttft if ttft is not None else time.perf_counter() - t0, meta


STORAGE = ["--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete"]
KRUL = ["--spec-krul"]


# Flags the workload sets per row; --server-flags may not set them.
OWNED = ("--model-path", "--max-total-tokens", "--spec-mode", "--enable-hierarchical-cache",
         "--hicache-ratio", "--hicache-io-backend", "--hicache-mem-layout",
         "--hicache-storage-backend", "--hicache-storage-prefetch-policy", "--spec-krul",
         "--spec-krul-codec", "--spec-krul-profile", "--enable-cache-report")


def server_flags(text: str) -> list[str]:
    """``--server-flags`` as a list; ValueError naming a flag the workload owns."""
    flags = shlex.split(text)
    owned = sorted({f.split("=", 1)[0] for f in flags} & set(OWNED))
    if owned:
        raise ValueError(f"--server-flags may not set {', '.join(owned)}: the workload sets "
                         f"them per row (it owns {', '.join(OWNED)})")
    return flags


def row_args(row: str, model: str, device_tokens: int, host_ratio: float,
             total_tokens: int, profile: str | None = None,
             extra: tuple[str, ...] = ()) -> list[str]:
    """Server flags of a row: the same model and mode, only the cache flags differ
    (``extra``, the same for every row, appended)."""
    hicache = HICACHE + ["--hicache-ratio", f"{host_ratio:.3f}"]
    cache = {"recompute": [], "hicache": hicache, "hicache+file": hicache + STORAGE,
             "hicache-tagged": hicache + ["--spec-tree-core", "tagged"],
             "krul": hicache + KRUL, "krul+file": hicache + STORAGE + KRUL,
             "krul-int8": hicache + KRUL + ["--spec-krul-codec", "int8"],
             "krul-recompute": hicache + KRUL + ["--spec-krul-profile", profile or ""],
             **{f"krul-recompute-{how}": hicache + KRUL + [
                 "--spec-krul-profile", profile or "", "--spec-krul-restore", how]
                for how in ("pipelined", "serial")}}
    if row.startswith("krul-recompute") and not profile:
        raise ValueError(f"row {row} needs a restore profile: --krul-profile FILE "
                         "(python -m sgl_spec.calibrate restore writes one) or --krul-share")
    base = ["--model-path", model, "--enable-cache-report", "--sleep-on-idle",
            "--spec-mode", "exact"]
    if row == "reference":
        return base + ["--max-total-tokens", str(total_tokens), *extra]
    if row not in cache:
        raise ValueError(f"unknown row {row!r}; valid: {', '.join(ROWS)}")
    return base + ["--max-total-tokens", str(device_tokens)] + cache[row] + list(extra)


def _cache(url: str) -> dict:
    r = requests.get(f"{url}/sgl_spec/cache", timeout=60)
    r.raise_for_status()
    return r.json()


def _krul_branches(url: str) -> list[tuple[int, int]]:
    return [(b["krul_stored_bytes"], b["krul_full_bytes"]) for b in _cache(url)["branches"]
            if b.get("krul_full_bytes")]


def play_row(row: str, model: str, tok, sess: list[Session], order, args, log_dir: str,
             bar) -> dict:
    flags = row_args(row, model, args.device_tokens, args.host_ratio,
                     total_tokens=len(sess) * (args.doc_tokens + 400) + 2048,
                     profile=args.krul_profile, extra=tuple(args.extra))
    storage = tempfile.mkdtemp(prefix="sgl-spec-sessions-")
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": storage}
    answers: list[Answer] = []
    branches: list[tuple[int, int]] = []
    krul: dict = {}
    try:
        with ServerProcess(SPEC, flags, env=env,
                           log_path=os.path.join(log_dir, f"server-{row}.log")) as server:
            for i, visit in order:
                s = sess[i]
                prompt = tok.apply_chat_template(messages(s, visit), tokenize=False,
                                                 add_generation_prompt=True)
                # what a revisit can find cached: the previous visit's prompt
                history = n_tokens(tok, messages(s, visit - 1)) if visit else 0
                clock = _cache(server.url)["restore"]
                text, ttft, meta = ask(server.url, prompt)
                stage = restore_clock.delta(_cache(server.url)["restore"], clock)
                fact = s.facts[asked(s, visit)]
                answers.append(Answer(s.name, visit, POSITIONS[asked(s, visit)],
                                      int(meta.get("prompt_tokens", 0)), ttft,
                                      int(meta.get("cached_tokens", 0)), _source(meta, history),
                                      text, exact_match(text, fact.value),
                                      stage and stage["seconds"], stage and stage["tokens"],
                                      stage and {k: stage.get(k) for k in PARTS}))
                bar.set_description(f"{row}: {s.name} visit {visit} {answers[-1].source} "
                                    f"ttft {ttft:.2f}s")
                bar.update()
                if row.startswith("krul") and visit == 0 and i == len(sess) - 1:
                    branches = _krul_branches(server.url)
            if row.startswith("krul"):
                krul = requests.get(f"{server.url}/sgl_spec/cache", timeout=60).json()["krul"]
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    return {"answers": [asdict(a) for a in answers], "krul_branches": branches, "krul": krul}


def summarize(rows: dict, ref: list[dict] | None) -> dict:
    out = {}
    for name, r in rows.items():
        ans = r["answers"]
        follow = [a for a in ans if a["visit"] > 0]
        first = [a for a in follow if a["visit"] == 1]
        by_pos = {p: [a["correct"] for a in follow if a["position"] == p] for p in POSITIONS}
        agree = None
        if ref is not None:
            pairs = [(a, b) for a, b in zip(ans, ref) if a["visit"] > 0]
            agree = sum(a["text"] == b["text"] for a, b in pairs) / len(pairs)
        restored = [a for a in follow if a["source"] in ("device", "host", "storage")]
        out[name] = {
            "em_by_position": {p: (sum(v) / len(v) if v else None) for p, v in by_pos.items()},
            "em": sum(a["correct"] for a in follow) / len(follow),
            "greedy_agreement": agree,
            "sources": {k: sum(a["source"] == k for a in follow)
                        for k in ("device", "host", "storage", "recomputed")},
            "conversations_restored": len({a["session"] for a in first
                                           if a["source"] in ("device", "host", "storage")}),
            "ttft_restore_s": timing.median(a["ttft_s"] for a in restored),
            "ttft_host_s": timing.median(a["ttft_s"] for a in follow if a["source"] == "host"),
            "ttft_storage_s": timing.median(a["ttft_s"] for a in follow
                                            if a["source"] == "storage"),
            "ttft_device_s": timing.median(a["ttft_s"] for a in follow
                                           if a["source"] == "device"),
            "ttft_recomputed_s": timing.median(a["ttft_s"] for a in follow
                                               if a["source"] == "recomputed"),
            "ttft_follow_up_s": timing.median(a["ttft_s"] for a in follow),
            "restore_stage_host_s": timing.median(a.get("restore_s") for a in follow
                                                  if a["source"] == "host"),
            "krul_stored_over_full": (sum(s for s, _ in r["krul_branches"])
                                      / sum(f for _, f in r["krul_branches"])
                                      if r["krul_branches"] else None),
            # Krul's restore pre-pass over the row (GET /sgl_spec/cache at its end)
            "krul_recompute": {k: r.get("krul", {}).get(k) for k in (
                "recompute_share", "recomputed_restores", "recomputed_token_layers",
                "recompute_seconds")} if r.get("krul") else None,
        }
    return out


def forced_profile(model: str, share: float, path: str) -> str:
    """A restore profile (the format ``calibrate restore`` writes) for ``model`` whose
    ``share`` field fixes the recompute share at ``share`` (``restore_cost.host_share``),
    for a serial and a pipelined restore alike; its costs are made up. Written to
    ``path``."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"--krul-share {share}: valid 0 <= share <= 1")
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    layers = c["num_hidden_layers"]
    shape = {"num_layers": layers, "kv_heads": c.get("num_key_value_heads",
                                                     c["num_attention_heads"]),
             "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]}
    prof = {"format": 1, "model": os.path.basename(model), "hardware": "made up",
            "device": "cpu", "dtype": "float32", "tokens": 4096, "codec": "k8v4",
            "shape": shape, "repeats": 1, "recompute_s": 1e-6,
            "tiers": {"host": {"load_s": 1e-6}}, "share": share}
    with open(path, "w") as f:
        json.dump(prof, f, indent=1)
    return path


def counterpart(row: str, played=()) -> str:
    """The row a Krul row is paired with: ``krul-recompute-pipelined`` with the serial
    form where that was played; else the HiCache row of the same tiers, a full copy, on
    the same (tagged) tree core where ``hicache-tagged`` was played."""
    if row == "krul-recompute-pipelined" and "krul-recompute-serial" in played:
        return "krul-recompute-serial"
    if row.endswith("+file"):
        return "hicache+file"
    return "hicache-tagged" if "hicache-tagged" in played else "hicache"


def paired(played: dict, row: str, other: str, source: str = "host") -> dict:
    """``row`` against ``other`` follow-up by follow-up: the same conversation's same
    visit in the same round, where both restored their history from ``source``. Per
    pair, the ratio of TTFTs and of the server's restore stages (the one part in which a
    Krul follow-up and a HiCache one differ); their spreads, and the stage's medians."""
    ttft, stage, mine, theirs = [], [], [], []
    parts: dict[str, list[float]] = {}
    for a_round, b_round in zip(played[row], played[other]):
        b_by = {(b["session"], b["visit"]): b for b in b_round["answers"]}
        for a in a_round["answers"]:
            b = b_by.get((a["session"], a["visit"]))
            if a["visit"] == 0 or b is None or a["source"] != source or b["source"] != source:
                continue
            ttft.append(a["ttft_s"] / b["ttft_s"])
            if a.get("restore_s") and b.get("restore_s"):
                stage.append(a["restore_s"] / b["restore_s"])
                mine.append(a["restore_s"])
                theirs.append(b["restore_s"])
                for k, x in (a.get("restore_parts") or {}).items():
                    parts.setdefault(k, []).append(x)
    sp = timing.spread
    return {"source": source, "pairs": len(ttft), "ttft_ratio": sp(ttft),
            "stage_ratio": sp(stage), "stage_s": sp(mine), "other_stage_s": sp(theirs),
            "parts_s": {k: sp(v) for k, v in parts.items()}}


def markdown(res: dict) -> str:
    s = res["summary"]
    cfg = res["config"]
    head = (f"{cfg['conversations']} conversations, a {cfg['doc_tokens']}-token document "
            f"each, {2 * cfg['conversations']} follow-ups in a shuffled order; device pool "
            f"{cfg['device_tokens']} tokens, host {cfg['host_ratio']:.2f}x of it (every row "
            f"but reference); {cfg['rounds']} round(s). Medians over follow-ups (and rounds).")
    rows = []
    for name in res["rows"]:
        r = s[name]
        em = " / ".join(render.num(r["em_by_position"][p], 100, 0) for p in POSITIONS)
        src = r["sources"]
        rows.append([name, em, render.num(r["greedy_agreement"], 100, 0),
                     f"{src['device']} / {src['host']} / {src['storage']} / {src['recomputed']}",
                     str(r["conversations_restored"]),
                     render.num(r["ttft_device_s"], 1e3, 0),
                     render.num(r["ttft_host_s"], 1e3, 0),
                     render.num(r.get("restore_stage_host_s"), 1e3, 1),
                     render.num(r["ttft_storage_s"], 1e3, 0),
                     render.num(r["ttft_recomputed_s"], 1e3, 0),
                     render.ratio(r["krul_stored_over_full"])])
    table = render.table(
        ["row", "EM % begin / middle / end", "follow-ups answered as reference %",
         "follow-ups from device / host / storage / recomputed",
         f"conversations restored (of {cfg['conversations']})",
         "TTFT ms: device", "host", "its restore stage", "storage", "recomputed",
         "stored / full copy"], rows)
    spread = []
    for name, v in res.get("ttft_rounds", {}).items():
        spread.append(f"- {name}: per round, host / storage / recomputed TTFT (ms): " + ", ".join(
            " / ".join(render.num(x, 1e3, 0) for x in r) for r in v))
    for key, p in res.get("paired", {}).items():
        name, other = key.split(" vs ")
        if not p["pairs"]:
            continue
        stage = (f"; restore stage {render.spread_cell(p['stage_ratio'])}x "
                 f"(median {render.num(p['stage_s'][1], 1e3, 1)} ms against "
                 f"{render.num(p['other_stage_s'][1], 1e3, 1)} ms)"
                 if p["stage_ratio"] else "")
        spread.append(f"- {name} against {other}, the same follow-up and round, both from "
                      f"the {p['source']} tier ({p['pairs']} pairs), min / median / max: TTFT "
                      f"{render.spread_cell(p['ttft_ratio'])}x{stage}")
        ps = p.get("parts_s") or {}
        if ps.get("recompute_seconds") and ps["recompute_seconds"][1]:
            spread.append(f"  - {name}'s restore stage, medians: "
                          + ", ".join(f"{label} {render.num(ps[k][1], 1e3, 1)} ms" for label, k
                                      in (("T_C", "recompute_seconds"),
                                          ("copy T_L", "load_seconds"),
                                          ("ran at once", "overlap_seconds")) if ps.get(k)))
    for name in res["rows"]:
        k = s[name].get("krul_recompute")
        if k and k["recomputed_restores"]:
            spread.append(f"- {name}: recompute share {k['recompute_share']:.3f}; "
                          f"{k['recomputed_restores']} restores recomputed "
                          f"{k['recomputed_token_layers']} token-layers in "
                          f"{k['recompute_seconds']:.2f} s")
    return "\n".join([head, "", *table, "", *spread]) + "\n"


def main(argv: list[str] | None = None) -> None:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.sessions", __doc__)
    cli.add_common(ap, rounds=cli.ROUNDS_HELP, rounds_default=1)
    ap.add_argument("--conversations", type=int, default=6, metavar="N")
    ap.add_argument("--doc-tokens", type=int, default=4096, metavar="T",
                    help="tokens of each conversation's document (default 4096)")
    ap.add_argument("--device-tokens", type=int, default=None, metavar="T",
                    help="--max-total-tokens of the pressured rows (default: one "
                    "conversation and a quarter)")
    ap.add_argument("--host-conversations", type=float, default=2.0, metavar="C",
                    help="host budget: HiCache's full copy holds about C conversations "
                    "(default 2); --hicache-ratio follows")
    ap.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), choices=ROWS,
                    metavar="ROW", help=f"rows to play, in this order (default: "
                    f"{', '.join(DEFAULT_ROWS)}; also: {', '.join(ROWS[len(DEFAULT_ROWS):])}); "
                    "without reference, no greedy agreement is reported")
    ap.add_argument("--krul-profile", metavar="FILE", default=None,
                    help="the krul-recompute rows' --spec-krul-profile")
    ap.add_argument("--krul-share", type=float, default=None, metavar="F",
                    help="instead of --krul-profile: a made-up profile whose host tier "
                    "makes the recompute share F (0 < F <= 1) for this model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-flags", default="", metavar="'FLAGS'",
                    help="sglang/sgl_spec flags appended to every row's, one string (e.g. "
                    "--server-flags='--dtype float32': a CPU without AVX512-BF16 runs bf16 "
                    "GEMMs ~4.5x slower; the KV pool is then float32 too, and Krul's "
                    "stored / full copy is against a float32 copy)")
    args = ap.parse_args(argv)
    try:
        args.extra = server_flags(args.server_flags)
    except ValueError as exc:
        ap.error(str(exc))
    for flag in ("conversations", "doc_tokens", "rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    model = cli.model_path(ap, args.model_path, tokens=args.doc_tokens + 256)
    if args.krul_share is not None:
        if args.krul_profile:
            ap.error("--krul-share and --krul-profile: give one")
        if not 0 < args.krul_share <= 1:
            ap.error("--krul-share must be in (0, 1]")
        os.makedirs(args.out, exist_ok=True)
        args.krul_profile = forced_profile(model, args.krul_share,
                                           os.path.join(args.out, "restore-profile.json"))
    if any(r.startswith("krul-recompute") for r in args.rows):
        from sgl_spec.krul.restore_cost import read_profile

        if not args.krul_profile:
            ap.error("the krul-recompute rows need --krul-profile FILE or --krul-share F")
        try:
            read_profile(args.krul_profile)
        except (OSError, ValueError) as exc:
            ap.error(f"--krul-profile: {exc}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    sess = sessions(tok, args.conversations, args.doc_tokens, args.seed)
    order = plan(sess, args.seed)
    conv = max(n_tokens(tok, messages(s, 2)) for s in sess) + MAX_NEW_TOKENS
    args.device_tokens = args.device_tokens or int(conv * 1.25)
    args.host_ratio = max(1.01, args.host_conversations * conv / args.device_tokens)
    meta, watch = cli.start_meta(model, rounds=args.rounds)
    os.makedirs(args.out, exist_ok=True)
    rows = list(dict.fromkeys(args.rows))
    bar = tqdm(total=len(rows) * args.rounds * len(order), desc="sessions", unit="turn")
    played = timing.interleaved(rows, args.rounds, lambda r, _i: play_row(
        r, model, tok, sess, order, args, args.out, bar))
    bar.close()
    firsts = {r: v[0] for r, v in played.items()}
    ref = firsts["reference"]["answers"] if "reference" in firsts else None
    summary = summarize(firsts, ref)
    res = {
        "meta": cli.finish_meta(meta, watch),
        "config": {"conversations": args.conversations, "doc_tokens": args.doc_tokens,
                   "conversation_tokens": conv, "device_tokens": args.device_tokens,
                   "host_ratio": args.host_ratio, "rounds": args.rounds, "seed": args.seed,
                   "server_flags": args.extra},
        "rows": rows,
        "summary": summary,
        "paired": {f"{r} vs {counterpart(r, played)}": paired(played, r, counterpart(r, played))
                   for r in rows if r.startswith("krul") and counterpart(r, played) in played},
        "ttft_rounds": {r: [[summarize({r: p}, None)[r][k] for k in
                             ("ttft_host_s", "ttft_storage_s", "ttft_recomputed_s")] for p in v]
                        for r, v in played.items()},
        "played": played,
    }
    md = markdown(res)
    cli.write_results(args.out, res, md)
    print(md)


if __name__ == "__main__":
    main()
