"""Micro-benchmark: exact mode's three extend calls over a cached prefix, and its pick.

    python -m sgl_spec.bench.extend --out DIR [--points 24:3069 40:4096 1024:1024 3000:64]

Per point (cached prefix : new tokens), one layer of the default model's shape (9/3
heads, head dim 64, ``--dtype``) is timed through each call of
``sgl_spec.attention.extend``: ``padded`` (torch_native's fused causal call over the
whole sequence), ``split`` (two fused calls merged by log-sum-exp) and ``masked`` (one
SDPA call with the offset causal mask). The ``pick`` column is ``extend_call``'s choice
and ``pick / best`` its time over the fastest call's (1.0 where the rule picks the
fastest). Times are ``timing.median_s`` of ``--repeats`` after one warm-up call; the
points run ``--rounds`` times, interleaved, and each figure is the median over rounds with
its spread. Writes ``results.json`` and ``results.md``. Not a test; CPU.
"""

from __future__ import annotations

from functools import partial

import torch
from tqdm import tqdm

from sgl_spec.attention import extend
from sgl_spec.attention.extend import CALLS
from sgl_spec.bench import cli, render
from sgl_spec.bench.timing import interleaved, median_s, spread

DEFAULT_POINTS = ("24:3069", "40:4096", "128:1024", "512:1024", "1024:1024", "3000:256",
                  "3000:64", "40:256")


def parse_point(text: str) -> tuple[int, int]:
    try:
        prefix, new = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"a point is PREFIX:NEW (two integers), got {text!r}") from None
    if prefix < 0 or new < 1:
        raise ValueError(f"a point needs PREFIX >= 0 and NEW >= 1, got {text!r}")
    return prefix, new


def run(points: list[tuple[int, int]], dtype: torch.dtype, repeats: int, rounds: int,
        num_q_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64) -> dict:
    gen = torch.Generator().manual_seed(0)
    scale = head_dim**-0.5
    inputs = {}
    for prefix, new in points:
        q = torch.randn(new, num_q_heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(prefix + new, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(prefix + new, num_kv_heads, head_dim, generator=gen).to(dtype)
        inputs[prefix, new] = (q, k, v)
    times: dict[tuple[int, int], dict[str, list[float]]] = {p: {c: [] for c in CALLS}
                                                            for p in points}

    bar = tqdm(total=rounds * len(points), desc="extend points", unit="point")

    def one(point, _round):
        q, k, v = inputs[point]
        for name in CALLS:
            fn = partial(extend.exact_extend, q, k, v, point[0], scale, call=name)
            times[point][name].append(1e3 * median_s(fn, repeats, warmup=1))
        bar.update()

    interleaved(points, rounds, one)
    bar.close()
    rows = []
    for (prefix, new), by_call in times.items():
        q, k, v = inputs[prefix, new]
        ms = {c: spread(xs) for c, xs in by_call.items()}
        pick = extend.extend_call(q, k, v, prefix)
        best = min(CALLS, key=lambda c: ms[c].median)
        rows.append({"prefix": prefix, "new": new, "ms": {c: list(s) for c, s in ms.items()},
                     "pick": pick, "best": best,
                     "pick_over_best": ms[pick].median / ms[best].median})
    return {"config": {"dtype": str(dtype).removeprefix("torch."), "repeats": repeats,
                       "rounds": rounds, "threads": torch.get_num_threads(),
                       "heads": [num_q_heads, num_kv_heads], "head_dim": head_dim,
                       "pad_max_prefix_share": extend.PAD_MAX_PREFIX_SHARE,
                       "split_min_queries": extend.SPLIT_MIN_QUERIES},
            "points": rows}


def markdown(res: dict) -> str:
    c = res["config"]
    head = (f"One layer, heads {c['heads'][0]}/{c['heads'][1]}, head dim {c['head_dim']}, "
            f"{c['dtype']}, {c['threads']} threads; ms, median (min-max) over {c['rounds']} "
            f"rounds of medians of {c['repeats']}.")
    rows = [[str(r["prefix"]), str(r["new"]), *(render.cell(r["ms"][n]) for n in CALLS),
             r["pick"], render.ratio(r["pick_over_best"])] for r in res["points"]]
    return "\n".join([head, "", *render.table(["prefix", "new", *CALLS, "pick", "pick / best"],
                                              rows), ""])


def main(argv: list[str] | None = None) -> None:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.extend", __doc__)
    ap.add_argument("--points", nargs="+", default=list(DEFAULT_POINTS), metavar="PREFIX:NEW",
                    help="cached prefix and new tokens of each extend (default: "
                    + " ".join(DEFAULT_POINTS) + ")")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="q/k/v dtype (default bfloat16: a server's on this CPU)")
    cli.add_common(ap, repeats="timed calls per figure (median; default 5)", repeats_default=5,
                   rounds="times every point runs, interleaved (default 3)", rounds_default=3,
                   threads="torch CPU threads (0: torch's default, as a server)",
                   model_path=False)
    args = ap.parse_args(argv)
    try:
        points = [parse_point(p) for p in args.points]
    except ValueError as e:
        ap.error(str(e))
    if args.repeats < 1 or args.rounds < 1:
        ap.error("--repeats and --rounds must be >= 1")
    cli.set_threads(args.threads)
    meta, watch = cli.start_meta("synthetic")
    res = run(points, getattr(torch, args.dtype), args.repeats, args.rounds)
    res["meta"] = cli.finish_meta(meta, watch)
    text = markdown(res)
    cli.write_results(args.out, res, text)
    print(text)


if __name__ == "__main__":
    main()
