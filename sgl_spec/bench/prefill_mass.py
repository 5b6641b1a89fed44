"""Recovered attention mass of LoopServe prefill selection on the default model, per layer.

    python -m sgl_spec.bench.prefill_mass --out DIR [--tokens 4096] [--alphas 0.955 0.98]

Offline (no server): loads the model with HF transformers on CPU, runs one
two-turn chat prompt of ``--tokens`` tokens (``qk_capture.chat_prompt``), captures
every layer's q/k/v after RoPE, and for each alpha selects lines exactly as the
serving backend does (``select_lines`` per KV head, default ``SelectConfig``
apart from alpha). Three scenarios per layer:

* ``prompt``: the whole prompt as one fresh extend (history 0);
* ``turn2``: the second turn as an extend over the cached first turn;
* ``turn2+reuse``: the same, seeded with the lines selected for the first turn
  (``--spec-prefill-reuse``).

Reports per layer the recovered mass on the FULL attention (``recovered_mass``,
all queries, mean over KV heads), the density (selected / causal cells) and the
selection time. Writes ``results.json``, ``results.md`` and ``prefill_mass.png``.
"""

from __future__ import annotations

import logging
import os
import statistics

import torch

from sgl_spec.bench import cli, plots, timing
from sgl_spec.kernels.vslash import SelectConfig, density, recovered_mass, select_lines

logger = logging.getLogger(__name__)

SCENARIOS = ("prompt", "turn2", "turn2+reuse")
PNG = "prefill_mass.png"


def measure_layer(layer, boundary: int, alpha: float) -> dict[str, dict]:
    """The three scenarios of one layer's captured ``LayerQK`` at one alpha."""
    cfg = SelectConfig(alpha=alpha)
    q, k = layer.q, layer.k
    total = q.shape[0]
    turn1 = select_lines(q[:boundary], k[:boundary], 0, cfg)
    cases = {"prompt": (q, k, 0, None), "turn2": (q[boundary:], k, boundary, None),
             "turn2+reuse": (q[boundary:], k, boundary, turn1)}
    out = {}
    for name, (qs, ks, hist, seeds) in cases.items():
        lines, select_s = timing.timed(lambda: select_lines(qs, ks, hist, cfg, seeds=seeds))
        n = total - hist
        out[name] = {
            "recovered_mass": float(recovered_mass(qs, ks, lines, hist).mean()),
            "density": float(density(lines, n, hist).mean()),
            "sampled_coverage": float(lines.sampled_coverage.mean()),
            "select_ms": 1e3 * select_s,
            "lines": sum(v.numel() + s.numel() for v, s in zip(lines.vertical, lines.slash)),
        }
    return out


def summarise(layers: list[dict[str, dict]]) -> dict[str, dict]:
    """Mean / min over layers of each scenario's numbers."""
    out = {}
    for sc in SCENARIOS:
        rows = [lay[sc] for lay in layers]
        out[sc] = {
            "recovered_mass_mean": statistics.fmean(r["recovered_mass"] for r in rows),
            "recovered_mass_min": min(r["recovered_mass"] for r in rows),
            "density_mean": statistics.fmean(r["density"] for r in rows),
            "select_ms_total": sum(r["select_ms"] for r in rows),
        }
    return out


def markdown(res: dict) -> str:
    p = res["prompt"]
    lines = [f"# LoopServe prefill: recovered mass per layer ({p['tokens']} tokens, turn 2 "
             f"from token {p['turn_boundary']})", ""]
    lines += ["| alpha | scenario | mass mean | mass min | density mean | select ms (all layers) |",
              "|---|---|---|---|---|---|"]
    for a, r in res["alphas"].items():
        for sc, s in r["summary"].items():
            lines.append(f"| {a} | {sc} | {s['recovered_mass_mean']:.4f} | "
                         f"{s['recovered_mass_min']:.4f} | {s['density_mean']:.4f} | "
                         f"{s['select_ms_total']:.0f} |")
    for a, r in res["alphas"].items():
        lines += ["", f"## alpha = {a}: per layer (mass / density)", "",
                  "| layer | " + " | ".join(SCENARIOS) + " |", "|---" * (len(SCENARIOS) + 1) + "|"]
        for i, lay in enumerate(r["layers"]):
            cells = [f"{lay[sc]['recovered_mass']:.3f} / {lay[sc]['density']:.3f}"
                     for sc in SCENARIOS]
            lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> str:
    plt = plots.pyplot()
    fig, (ax_m, ax_d) = plt.subplots(1, 2, figsize=(11, 4))
    for a, r in res["alphas"].items():
        for sc, style in zip(SCENARIOS, ("-", "--", ":")):
            xs = range(len(r["layers"]))
            ax_m.plot(xs, [lay[sc]["recovered_mass"] for lay in r["layers"]], style,
                      marker=".", label=f"a={a} {sc}")
            ax_d.plot(xs, [lay[sc]["density"] for lay in r["layers"]], style,
                      marker=".", label=f"a={a} {sc}")
    ax_m.set(xlabel="layer", ylabel="recovered mass (full attention)",
             title="Recovered attention mass")
    ax_d.set(xlabel="layer", ylabel="selected / causal cells", title="Density")
    ax_m.legend(fontsize="x-small")
    return plots.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.prefill_mass", __doc__)
    cli.add_common(ap, threads="torch threads (0: leave)")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens (default 4096)")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.955, 0.98])
    ap.add_argument("--seed", type=int, default=0, help="corpus seed")
    ap.add_argument("--save-qk", metavar="FILE",
                    help="also save the captured q/k/v and the turn boundary (torch.save), "
                    "input of `python -m sgl_spec.bench.vslash --qk FILE`")
    args = ap.parse_args(argv)
    if args.tokens < 256:
        ap.error(f"--tokens {args.tokens} is too small; valid: >= 256")
    if not all(0.0 < a <= 1.0 for a in args.alphas):
        ap.error(f"--alphas {args.alphas} invalid; valid: numbers in (0, 1]")
    cli.set_threads(args.threads)
    from tqdm import tqdm

    from sgl_spec.bench.qk_capture import capture, chat_prompt, load_model

    model_path = cli.model_path(ap, args.model_path)
    model, tokenizer = load_model(model_path)
    prompt = chat_prompt(tokenizer, args.tokens, args.seed)
    layers, capture_s = timing.timed(lambda: capture(model, prompt.ids))
    logger.info("captured %d layers of %d tokens in %.1f s", len(layers), len(prompt.ids),
                capture_s)
    if args.save_qk:
        torch.save({"layers": [lay._asdict() for lay in layers],
                    "turn_boundary": prompt.turn_boundary, "model": model_path}, args.save_qk)
    meta, watch = cli.start_meta(model_path, threads=torch.get_num_threads())
    res = {"meta": meta,
           "prompt": {"tokens": len(prompt.ids), "turn_boundary": prompt.turn_boundary,
                      "seed": args.seed},
           "alphas": {}}
    with tqdm(total=len(args.alphas) * len(layers), unit="layer", dynamic_ncols=True) as bar:
        for a in args.alphas:
            per_layer = []
            for i, lay in enumerate(layers):
                bar.set_description(f"alpha {a} layer {i}")
                per_layer.append(measure_layer(lay, prompt.turn_boundary, a))
                bar.update(1)
            res["alphas"][str(a)] = {"layers": per_layer, "summary": summarise(per_layer)}
    cli.finish_meta(meta, watch)
    text = markdown(res)
    cli.write_results(args.out, res, text)
    plot(res, os.path.join(args.out, PNG))
    print(text.split("\n## ")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
