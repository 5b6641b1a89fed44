"""Tune the Triton sparse decode's split rule on a GPU: every (programs per SM, minimum
blocks per split) pair of a grid, timed on the same points as ``decode_kernels --device
cuda`` (30 layers, 9/3 heads, head_dim 64, bf16 KV; exact over the whole history and a
LoopServe B=``--budget`` selection), the auto rule's choice made under each pair.

    python -m sgl_spec.bench.split_tune --out results/split-tune      # a CUDA GPU

Writes ``results.json`` and ``results.md``: ms per step for each pair and point, each
over the current defaults' (``triton_impl.PROGRAMS_PER_SM``, ``MIN_SPLIT_BLOCKS``), and
the pair with the lowest geometric mean over the points.
"""

from __future__ import annotations

import math

import torch

from sgl_spec.bench import cli, render
from sgl_spec.bench.decode_kernels import _setup, _sparse
from sgl_spec.bench.timing import median_s
from sgl_spec.kernels.sparse_decode import dense_subsets, sparse_decode


def time_point(history: int, batch: int, layers: int, budget: int, repeats: int,
               pairs: list[tuple[int, int]]) -> dict:
    from sgl_spec.kernels.sparse_decode import triton_impl

    ks, vs, r2t, q = _setup(history, batch, layers, 9, 3, 64, device="cuda")
    rows = torch.arange(batch, device="cuda")
    seq = torch.full((batch,), history, device="cuda")
    subsets = {"exact": dense_subsets(r2t, rows, seq, 3),
               "loopserve": _sparse(r2t, rows, seq, 3, budget)}
    out = torch.empty_like(q)
    saved = triton_impl.PROGRAMS_PER_SM, triton_impl.MIN_SPLIT_BLOCKS
    ms: dict[str, dict[str, float]] = {}
    try:
        for pps, minb in pairs:
            triton_impl.PROGRAMS_PER_SM, triton_impl.MIN_SPLIT_BLOCKS = pps, minb
            key = f"{pps}x{minb}"
            ms[key] = {}
            for name, sub in subsets.items():
                def step(sub=sub):
                    for i, (k, v) in enumerate(zip(ks, vs)):
                        sparse_decode(q, k, v, sub, scale=0.125, impl="triton", out=out,
                                      check=i == 0)
                ms[key][name] = 1e3 * median_s(step, repeats, warmup=2,
                                               sync=torch.cuda.synchronize)
    finally:
        triton_impl.PROGRAMS_PER_SM, triton_impl.MIN_SPLIT_BLOCKS = saved
    return {"history": history, "batch": batch, "ms": ms}


def markdown(res: dict) -> str:
    c = res["config"]
    default = c["default"]
    cols = [f"{p['history']}/{p['batch']} {n}" for p in res["points"] for n in ("exact",
                                                                              "loopserve")]
    rows = []
    for pair in c["pairs"]:
        cells = [render.num(p["ms"][pair][n], digits=2) for p in res["points"]
                 for n in ("exact", "loopserve")]
        rows.append([pair + (" (default)" if pair == default else ""), *cells,
                     render.ratio(res["geomean_vs_default"][pair])])
    head = (f"ms per decode step ({c['layers']} layers, 9/3 heads, head_dim 64, bf16 KV), "
            f"{c['gpu']}, median of {c['repeats']}; columns history/batch and path; rows "
            "programs per SM x minimum blocks per split.")
    return "\n".join([head, "", *render.table(["pair", *cols, "geomean vs default"], rows),
                      "", f"Best: {res['best']}."]) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = cli.parser("python -m sgl_spec.bench.split_tune", __doc__)
    cli.add_common(ap, repeats="timed steps per figure (median; default 10)",
                   repeats_default=10, model_path=False)
    ap.add_argument("--histories", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--min-blocks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--budget", type=int, default=1024)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the Triton kernel compiled); none here")
    if min(args.histories + args.batches + args.programs_per_sm + args.min_blocks) < 1:
        ap.error("--histories, --batches, --programs-per-sm and --min-blocks must be >= 1")
    from sgl_spec.kernels.sparse_decode import triton_impl

    pairs = [(p, m) for p in args.programs_per_sm for m in args.min_blocks]
    default = f"{triton_impl.PROGRAMS_PER_SM}x{triton_impl.MIN_SPLIT_BLOCKS}"
    points = [time_point(h, b, args.layers, args.budget, args.repeats, pairs)
              for h in args.histories for b in args.batches]
    keys = [f"{p}x{m}" for p, m in pairs]
    geo = {}
    for k in keys:
        logs = [math.log(p["ms"][k][n] / p["ms"].get(default, p["ms"][k])[n])
                for p in points for n in ("exact", "loopserve")]
        geo[k] = math.exp(sum(logs) / len(logs))
    res = {"config": {"layers": args.layers, "repeats": args.repeats, "budget": args.budget,
                      "gpu": torch.cuda.get_device_name(), "pairs": keys, "default": default},
           "points": points, "geomean_vs_default": geo, "best": min(geo, key=geo.get)}
    md = markdown(res)
    cli.write_results(args.out, res, md)
    print(md)


if __name__ == "__main__":
    main()
