"""What LoopServe's first decode selection keeps of an answer that comes late (issue 47).

Offline, no server: for each probe of the ``late-needles`` preset (a fact with a long
subject, asked in the long style, so the model restates the subject before the value),
exact's greedy answer from HF transformers (float32, the default model) and the decode
step where the fact's value appears; then, from the queries and keys of the prompt and
the answer's first n_d + 1 tokens (``qk_capture``), LoopServe's selection at its first
selection step: the ring of decode steps 0..n_d-1 scores the history
(``sparse.scoring.score_history``, the served code) and each KV head keeps its top B
outside the sink and the recent window (``select_topk``). Reported per probe and score
(``SCORES``): the share of (layer, KV head) pairs whose selection holds every token of
the value. The ``ahead-W`` scores give each position the largest mass of the W positions
before it, the sink's passing nothing on (``scoring.look_ahead``, served as
``--spec-lookahead W``: what follows an attended token, as the value follows the subject
the ring restates).

    python -m sgl_spec.bench.first_selection --out DIR [--seed 0] [--budget 1024]
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
from tqdm import tqdm

from sgl_spec.bench import cli
from sgl_spec.config import DecodeConfig
from sgl_spec.sparse.scoring import look_ahead, score_history, select_topk


SCORES = {
    "mass": lambda mass, lo: mass,  # LoopServe's own
    "ahead-16": lambda mass, lo: look_ahead(mass, 16, lo),  # --spec-lookahead 16
    "ahead-32": lambda mass, lo: look_ahead(mass, 32, lo),
    "ahead-64": lambda mass, lo: look_ahead(mass, 64, lo),
}


def kept_share(layers, prompt_len: int, value_pos: list[int], cfg: DecodeConfig,
               scale: float, scores: dict | None = None) -> dict[str, float]:
    """Per score, the share of (layer, KV head) selections at the first selection step
    that hold every position of ``value_pos``; ``layers`` are ``qk_capture``'s, over the
    prompt and at least ``first_select_step + 1`` answer tokens."""
    step = cfg.first_select_step
    n_keys = prompt_len + step + 1  # the history at that step, its own token included
    q_pos = torch.arange(prompt_len + step - cfg.nd, prompt_len + step)  # the ring
    lo = torch.tensor([cfg.sink])
    hi = torch.tensor([n_keys - cfg.window])
    want = torch.tensor(value_pos)
    scores = SCORES if scores is None else scores
    hits = {name: [] for name in scores}
    for lq in layers:
        mass = score_history(lq.q[q_pos][None], lq.k[:n_keys][None], scale,
                             q_pos[None], torch.tensor([n_keys]))  # [1, Hkv, N]
        for name, fn in scores.items():
            sel = select_topk(fn(mass, lo), cfg.budget, lo, hi)[0]  # [Hkv, B]
            hits[name] += [bool(torch.isin(want, sel[h]).all()) for h in range(sel.shape[0])]
    return {name: sum(h) / len(h) for name, h in hits.items()}


def value_positions(tok, text: str, sentence: str, value: str) -> list[int]:
    """Token positions of ``value`` inside the planted ``sentence`` of ``text``."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    start = text.index(sentence) + sentence.rindex(value)
    end = start + len(value)
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]


def value_step(tok, answer_ids: list[int], value: str) -> int | None:
    """The answer token at which ``value`` first appears (case-insensitive), or None."""
    for s in range(len(answer_ids)):
        if value.lower() in tok.decode(answer_ids[: s + 1]).lower():
            return s
    return None


def probe(model, tok, turn, cfg: DecodeConfig, max_new: int) -> dict:
    from sgl_spec.bench import qk_capture

    text = tok.apply_chat_template([{"role": "user", "content": turn.user_message}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    answer = out[0, len(ids):].tolist()
    step = value_step(tok, answer, turn.fact.value)
    row = {"position": turn.position, "prompt_tokens": len(ids), "value_step": step,
           "answer": tok.decode(answer, skip_special_tokens=True)}
    if len(answer) <= cfg.first_select_step:
        return {**row, "kept": None}
    layers = qk_capture.capture(model, ids + answer[: cfg.first_select_step + 1])
    heads, hidden = model.config.num_attention_heads, model.config.hidden_size
    scale = (getattr(model.config, "head_dim", None) or hidden // heads) ** -0.5
    vpos = value_positions(tok, text, turn.fact.sentence, turn.fact.value)
    return {**row, "kept": kept_share(layers, len(ids), vpos, cfg, scale)}


def markdown(res: dict) -> str:
    c = res["config"]
    names = list(SCORES)
    lines = ["# LoopServe's first selection on late answers", "",
             (f"Model {c['model']}; late-needles seed {c['seed']}; B={c['budget']}, sink "
              f"{c['sink']}, window {c['window']}, the ring of decode steps 0-{c['nd'] - 1} "
              f"selecting at step {c['first_select_step']}. A cell: the share of (layer, KV "
              "head) selections holding every token of the value."), "",
             "| probe | position | exact's value at step | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for name, r in res["probes"].items():
        kept = r["kept"] or {}
        step = "-" if r["value_step"] is None else str(r["value_step"])
        lines.append(f"| {name} | {r['position']} | {step} | "
                     + " | ".join(f"{kept[n]:.2f}" if n in kept else "-" for n in names) + " |")
    late = [r for r in res["probes"].values()
            if r["kept"] and r["value_step"] is not None and r["value_step"] >= c["first_select_step"]]
    if late:
        lines += ["", f"Mean over the {len(late)} probes exact answers after the first selection: "
                  + ", ".join(f"{n} {statistics.mean(r['kept'][n] for r in late):.2f}"
                              for n in names) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.first_selection", __doc__)
    cli.add_common(ap, quick="the first 3 probes")
    ap.add_argument("--seed", type=int, default=0, help="the late-needles preset's seed")
    ap.add_argument("--budget", type=int, default=1024, metavar="B")
    ap.add_argument("--max-new-tokens", type=int, default=48, metavar="N",
                    help="exact's answer length (the value must come within it)")
    args = ap.parse_args(argv)
    if args.budget < 1 or args.max_new_tokens < 1:
        ap.error("--budget and --max-new-tokens must be >= 1")
    model_dir = cli.model_path(ap, args.model_path)
    from sgl_spec.bench import qk_capture
    from sgl_spec.bench.dataset import DatasetConfig, generate

    cfg = DecodeConfig(mode="loopserve", budget=args.budget)
    model, tok = qk_capture.load_model(model_dir)
    convs = generate(dataclasses.replace(DatasetConfig.preset("late-needles"), seed=args.seed),
                     tok)
    if args.quick:
        convs = convs[:3]
    meta, watch = cli.start_meta(model_dir)
    probes = {}
    with torch.inference_mode():
        for conv in tqdm(convs, desc="first selection", unit="probe"):
            probes[conv.name] = probe(model, tok, conv.turns[0], cfg, args.max_new_tokens)
    res = {"meta": cli.finish_meta(meta, watch),
           "config": {"model": model_dir, "seed": args.seed, "budget": cfg.budget,
                      "sink": cfg.sink, "window": cfg.window, "nd": cfg.nd,
                      "first_select_step": cfg.first_select_step,
                      "max_new_tokens": args.max_new_tokens, "scores": list(SCORES)},
           "probes": probes}
    md = markdown(res)
    cli.write_results(args.out, res, md)
    print(md)


if __name__ == "__main__":
    main()
