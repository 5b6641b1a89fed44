"""How much of the target's attention the retrieval head's selection covers, per layer.

    python -m sgl_spec.bench.head_fidelity --out DIR [--draft-path DIR] [--prompts 8]

Offline (no server), on harness prompts with >= 4k tokens of history: two-turn chats
of the ``long-turns`` dataset (the first answer written out), each followed by
``--answer-tokens`` greedy tokens of the model's own answer. At every decode step of
that answer (the query at position t), per layer l and KV head h, the target's true
attention ``p_l,h(t, .)`` (softmax per query head, averaged over the group: "group
summed" and normalised) is summed over the positions a method attends:
sink + its B selected positions + the recent window. Methods, at each budget B:

* ``specontext``: the head's top-B (served math, ``sgl_spec.head.model``), one set
  per KV head for every layer, renewed every step;
* ``loopserve``: LoopServe's per-layer selection (Algorithm 3: at step 16 and every
  16 after, the group-summed attention of the last 16 decoded queries), reused until
  the next selection while the window grows;
* ``oracle shared``: the top-B of the layer-averaged true attention (the best any one
  set for all layers can do); ``oracle per layer``: each layer's own top-B.

Steps before 16 are reported apart (``EARLY_METHODS``, the "answer start" table):
LoopServe decodes densely there, while SpeContext's head selects from the first step,
and a short answer (a planted fact's value) is decided in those steps. Writes
``results.json``, ``results.md`` (mean and worst layer per method and budget, at the
answer's start and from step 16, and per layer at each budget) and ``head_fidelity.png``.
"""

from __future__ import annotations

import logging
import os
import statistics

import torch

from sgl_spec.bench import cli, plots

logger = logging.getLogger(__name__)

METHODS = ("specontext", "loopserve", "oracle shared", "oracle per layer")
EARLY_METHODS = ("specontext", "oracle shared", "oracle per layer")  # steps < FIRST_STEP
PNG = "head_fidelity.png"
FIRST_STEP = 16  # LoopServe's first selection; earlier steps are not compared
ND = 16


def prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """Token ids of ``count`` two-turn long-turns chats (turn 1 answered), ready to decode."""
    from sgl_spec.bench import dataset

    cfg = dataset.DatasetConfig.preset("long-turns")
    convs = dataset.generate(cfg, tokenizer)[:count]
    out = []
    for c in convs:
        t1, t2 = c.turns[0], c.turns[1]
        msgs = [{"role": "user", "content": t1.user_message},
                {"role": "assistant", "content": t1.fact.sentence},
                {"role": "user", "content": t2.user_message}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def _cover(p: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """[..., T] attention and [..., T] bool attended -> [...] covered mass."""
    return (p * chosen).sum(-1)


def _topk_mask(scores: torch.Tensor, budget: int, cand: torch.Tensor) -> torch.Tensor:
    """[..., T] bool: the top-``budget`` candidates of ``scores``."""
    s = scores.masked_fill(~cand, float("-inf"))
    idx = s.topk(budget, dim=-1).indices
    return torch.zeros(s.shape, dtype=torch.bool).scatter_(-1, idx, True)


def _shared_covers(p, s, b: int, cand, fixed) -> dict[str, torch.Tensor]:
    """Coverage of the head's top-``b`` and of the two oracles (``EARLY_METHODS``)."""
    return {"specontext": _cover(p, _topk_mask(s, b, cand)[None] | fixed),
            "oracle shared": _cover(p, _topk_mask(p.mean(0), b, cand)[None] | fixed),
            "oracle per layer": _cover(p, _topk_mask(p, b, cand) | fixed)}


@torch.no_grad()
def measure_prompt(model, rec, head, ids: list[int], n_answer: int, budgets, sink: int,
                   window: int, aux_layers) -> dict:
    """Per budget and method: [L] coverage (mean over KV heads and steps) of one prompt."""
    embed = model.get_input_embeddings().weight
    x = torch.tensor(ids)[None]
    rec.start(None)
    gen = model.generate(x, max_new_tokens=n_answer, min_new_tokens=n_answer, do_sample=False)
    full = gen[0]
    p0 = len(ids)
    steps = torch.arange(p0, full.shape[0])
    rec.start(torch.arange(p0, full.shape[0]), per_layer=True)
    out = model(input_ids=full[None], output_hidden_states=True, use_cache=False)
    att = torch.stack(rec.per_layer)  # [L, Hkv, A, T] every answer step
    rec.start(None)
    aux = torch.stack([out.hidden_states[i][0] for i in aux_layers], dim=1)
    keys, qh_prev = head.over_sequence(full, aux, embed)
    T = full.shape[0]
    cols = torch.arange(T)
    cov = {str(b): {m: [] for m in METHODS} for b in budgets}
    early = {str(b): {m: [] for m in EARLY_METHODS} for b in budgets}
    for t in steps.tolist():
        a = t - p0  # answer step
        p = att[:, :, a]  # [L, Hkv, T]
        cand = (cols >= sink) & (cols < t + 1 - window)
        fixed = (cols < sink) | ((cols >= t + 1 - window) & (cols <= t))
        q = head.queries(full[t : t + 1], torch.tensor([t]), qh_prev[t : t + 1], embed)
        s = head.scores(q, keys[None, :t], torch.tensor([t]))[0]  # [Hkv, t]
        s = torch.cat([s, s.new_zeros(s.shape[0], T - t)], -1)
        if a < FIRST_STEP:  # the answer's start: LoopServe is dense here
            for b in budgets:
                for m, v in _shared_covers(p, s, b, cand, fixed).items():
                    early[str(b)][m].append(v)
            continue
        s0 = FIRST_STEP + ((a - FIRST_STEP) // ND) * ND  # the LoopServe selection in force
        t0 = p0 + s0
        obs = att[:, :, s0 - ND + 1 : s0 + 1].sum(2)  # [L, Hkv, T] its last n_d queries
        lcand = (cols >= sink) & (cols < t0 + 1 - window)
        lfixed = (cols < sink) | ((cols >= t0 + 1 - window) & (cols <= t))
        for b in budgets:
            c = cov[str(b)]
            for m, v in _shared_covers(p, s, b, cand, fixed).items():
                c[m].append(v)
            c["loopserve"].append(_cover(p, _topk_mask(obs, b, lcand) | lfixed))
    out = {b: {m: torch.stack(v).mean(dim=(0, 2)).tolist() for m, v in by.items()}
           for b, by in cov.items()}
    out["early"] = {b: {m: torch.stack(v).mean(dim=(0, 2)).tolist() for m, v in by.items()}
                    for b, by in early.items()}
    return out


def summarise(per_prompt: list[dict], budgets, methods=METHODS) -> dict:
    out = {}
    for b in budgets:
        out[str(b)] = {}
        for m in methods:
            layers = torch.tensor([r[str(b)][m] for r in per_prompt]).mean(0).tolist()
            out[str(b)][m] = {"per_layer": layers, "mean": statistics.fmean(layers),
                              "min": min(layers), "worst_layer": layers.index(min(layers))}
    return out


def markdown(res: dict) -> str:
    s, meta = res["summary"], res["setup"]
    lines = [f"# Retrieval head fidelity ({meta['prompts']} prompts of "
             f"{meta['prompt_tokens_min']}-{meta['prompt_tokens_max']} tokens, "
             f"{meta['answer_tokens']} answer tokens)", "",
             "Share of the target's attention (per layer and KV head, group averaged) "
             "on the attended positions: sink + B selected + recent window. Mean over "
             "layers (worst layer).", "", f"## From step {FIRST_STEP} on", "",
             "| B | " + " | ".join(METHODS) + " |", "|---" * (len(METHODS) + 1) + "|"]
    for b, by in s.items():
        lines.append(f"| {b} | " + " | ".join(
            f"{by[m]['mean']:.3f} ({by[m]['min']:.3f}, L{by[m]['worst_layer']})"
            for m in METHODS) + " |")
    e = res.get("summary_early")
    if e:
        lines += ["", f"## The answer's start (steps 0-{FIRST_STEP - 1}; LoopServe is dense there)",
                  "", "| B | " + " | ".join(EARLY_METHODS) + " |",
                  "|---" * (len(EARLY_METHODS) + 1) + "|"]
        for b, by in e.items():
            lines.append(f"| {b} | " + " | ".join(
                f"{by[m]['mean']:.3f} ({by[m]['min']:.3f}, L{by[m]['worst_layer']})"
                for m in EARLY_METHODS) + " |")
    for b, by in s.items():
        lines += ["", f"## B = {b}, per layer", "", "| layer | " + " | ".join(METHODS) + " |",
                  "|---" * (len(METHODS) + 1) + "|"]
        for i in range(len(by[METHODS[0]]["per_layer"])):
            lines.append(f"| {i} | " + " | ".join(f"{by[m]['per_layer'][i]:.3f}"
                                                  for m in METHODS) + " |")
    lines += ["", f"Head: `{meta['draft_path']}`; model `{res['meta']['model']}`; run "
              f"{res['meta']['duration_s'] / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> str:
    plt = plots.pyplot()
    budgets = list(res["summary"])
    fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4), squeeze=False)
    for ax, b in zip(axes[0], budgets):
        for m in METHODS:
            ys = res["summary"][b][m]["per_layer"]
            ax.plot(range(len(ys)), ys, marker=".", label=m)
        ax.set(xlabel="layer", ylabel="attention mass covered", title=f"B = {b}")
    plots.finish_axes(*axes[0], ylim_zero=False)
    return plots.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.head_fidelity", __doc__)
    cli.add_common(ap, quick="2 prompts, B = 1024 only", threads="torch threads (0: leave)")
    ap.add_argument("--draft-path", help="the head (default: the one prepared for the "
                    "model, trained if missing)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts (default 8)")
    ap.add_argument("--answer-tokens", type=int, default=48,
                    help="greedy answer tokens per prompt (default 48)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.budgets = 2, [1024]
    if args.answer_tokens <= FIRST_STEP or args.prompts < 1:
        ap.error(f"--answer-tokens must exceed {FIRST_STEP} and --prompts be >= 1")
    cli.set_threads(args.threads)
    from tqdm import tqdm

    from sgl_spec.head import eagle3
    from sgl_spec.head.model import RetrievalHead
    from sgl_spec.head.train import load_target
    from sgl_spec.train_head import prepare

    model_path = cli.model_path(ap, args.model_path)
    draft = args.draft_path or prepare(model_path)
    cfg, weights, n_aux = eagle3.load(draft)
    model, tok, rec = load_target(model_path)
    aux_layers = cfg.resolve_aux_layers(model.config.num_hidden_layers)
    head = RetrievalHead(cfg, weights, n_aux)
    meta, watch = cli.start_meta(model_path, threads=torch.get_num_threads())
    ids = prompts(tok, args.prompts, 0)
    per_prompt = []
    for p in tqdm(ids, desc="head fidelity", unit="prompt"):
        per_prompt.append(measure_prompt(model, rec, head, p, args.answer_tokens,
                                         args.budgets, args.sink, args.window, aux_layers))
    lens = [len(p) for p in ids]
    res = {"meta": cli.finish_meta(meta, watch),
           "setup": {"draft_path": draft, "prompts": len(ids), "prompt_tokens_min": min(lens),
                     "prompt_tokens_max": max(lens), "answer_tokens": args.answer_tokens,
                     "budgets": args.budgets, "sink": args.sink, "window": args.window},
           "summary": summarise(per_prompt, args.budgets),
           "summary_early": summarise([r["early"] for r in per_prompt], args.budgets,
                                      EARLY_METHODS),
           "per_prompt": per_prompt}
    text = markdown(res)
    cli.write_results(args.out, res, text)
    plot(res, os.path.join(args.out, PNG))
    print(text.split("\n## B = ")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
