"""Can two layers share their KV? Cross-layer cosine of K and V, and the MiniCache
merge's error, for Krul's pairs and the best pairs of a model (issue 17).

    python -m sgl_spec.bench.layer_similarity --out DIR [--model-path DIR] [--tokens 1500]

Offline (no server): one chat prompt of ``--tokens`` tokens through the model in
transformers (``qk_capture``: K after RoPE, V, bf16 as the served pool); for every
layer pair the mean cosine over tokens and KV heads of K and of V, and for the pairs
Algorithm 1 takes (the model's calibration statistics at the default gamma and
ratio) plus the adjacent pairs of the deep half, the relative L2 error of
``krul.merge`` (retain 0.05); and per layer, the relative L2 error of the int8 codec
(``krul.quant``), the alternative where layers share nothing. Writes ``results.json``
and ``results.md``.
"""

from __future__ import annotations

import itertools
import logging

import torch

from sgl_spec.bench import cli

logger = logging.getLogger(__name__)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine of matching rows of [T, H, D] tensors."""
    a, b = a.float(), b.float()
    return float(((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp(min=1e-6)).mean())


def merge_error(a: torch.Tensor, b: torch.Tensor) -> float:
    from sgl_spec.krul.merge import MergeParams, merge, reconstruction_error

    return reconstruction_error(merge(a, b, MergeParams(retain=0.05)), a, b)


def int8_error(x: torch.Tensor) -> float:
    from sgl_spec.krul.quant import dequantize, quantize

    return float((dequantize(quantize(x), torch.float32) - x.float()).norm() / x.float().norm())


def markdown(res: dict) -> str:
    lines = [f"# Cross-layer KV similarity ({res['meta']['model']}, {res['tokens']} tokens)", "",
             "| pair | why | K cosine | V cosine | merge error K | merge error V |",
             "|---|---|---|---|---|---|"]
    for p in res["pairs"]:
        lines.append(f"| ({p['i']},{p['j']}) | {p['why']} | {p['k_cos']:+.3f} | {p['v_cos']:+.3f} "
                     f"| {p['k_err']:.3f} | {p['v_err']:.3f} |")
    best = res["best_k_cos"]
    lines += ["", f"Highest K cosine of all {res['all_pairs']} pairs: "
              + ", ".join(f"({b['i']},{b['j']}) {b['k_cos']:+.3f}" for b in best)]
    q = res["int8"]
    lines += ["", "int8 rows (per token and head), relative L2 error over the layers: "
              f"K mean {q['k_mean']:.4f} max {q['k_max']:.4f}, V mean {q['v_mean']:.4f} "
              f"max {q['v_max']:.4f}; bytes {q['bytes_ratio']:.3f}x of bf16"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.layer_similarity", __doc__)
    cli.add_common(ap, threads="torch threads (0: leave)")
    ap.add_argument("--tokens", type=int, default=1500, help="prompt tokens (default 1500)")
    ap.add_argument("--seed", type=int, default=0, help="corpus seed")
    args = ap.parse_args(argv)
    if args.tokens < 256:
        ap.error(f"--tokens {args.tokens} is too small; valid: >= 256")
    cli.set_threads(args.threads)
    from sgl_spec.bench.qk_capture import capture, chat_prompt, load_model
    from sgl_spec.config import KrulConfig
    from sgl_spec.krul import calibrate
    from sgl_spec.krul.select import select_pairs

    model_path = cli.model_path(ap, args.model_path)
    model, tokenizer = load_model(model_path)
    prompt = chat_prompt(tokenizer, args.tokens, args.seed)
    meta, watch = cli.start_meta(model_path, threads=torch.get_num_threads())
    layers = capture(model, prompt.ids)
    L = len(layers)
    sim = calibrate.load(calibrate.prepare(model_path))
    kc = KrulConfig()
    chosen = select_pairs(sim.ir_share(), sim.distances(), gamma=kc.gamma, ratio=kc.ratio)
    todo = [(i, j, "Algorithm 1") for i, j in chosen.pairs]
    todo += [(i, i + 1, "adjacent") for i in range(L // 2, L - 1, 3)]
    pairs = [{"i": i, "j": j, "why": why,
              "k_cos": cosine(layers[i].k, layers[j].k), "v_cos": cosine(layers[i].v, layers[j].v),
              "k_err": merge_error(layers[i].k, layers[j].k),
              "v_err": merge_error(layers[i].v, layers[j].v)} for i, j, why in todo]
    allk = sorted(((cosine(layers[i].k, layers[j].k), i, j)
                   for i, j in itertools.combinations(range(L), 2)), reverse=True)
    ke = [int8_error(lay.k) for lay in layers]
    ve = [int8_error(lay.v) for lay in layers]
    d = layers[0].k.shape[-1]
    int8 = {"k": ke, "v": ve, "k_mean": sum(ke) / L, "k_max": max(ke), "v_mean": sum(ve) / L,
            "v_max": max(ve), "bytes_ratio": (d + 2) / (2 * d)}
    res = {"meta": meta, "tokens": len(prompt.ids), "pairs": pairs, "all_pairs": len(allk),
           "int8": int8,
           "best_k_cos": [{"i": i, "j": j, "k_cos": c} for c, i, j in allk[:3]]}
    cli.finish_meta(meta, watch)
    text = markdown(res)
    cli.write_results(args.out, res, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
