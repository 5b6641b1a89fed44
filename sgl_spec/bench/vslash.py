"""Benchmark: line-sparse prefill attention (``kernels/vslash``) vs dense SDPA, same inputs.

    python -m sgl_spec.bench.vslash --n 6144 --history 6144 --density 0.05 0.1 0.2

The baseline is one dense call over a cached prefix: ``scaled_dot_product_attention``
with the offset causal mask and ``enable_gqa`` (exact mode's call for extends of
fewer than ``SPLIT_MIN_QUERIES`` new queries; longer ones run the fused split,
``--crossover`` times both). Line sets per KV head: local band + sinks + random verticals and
isolated slashes (``--vertical-share`` of the added lines are verticals), sized to
the requested cell density. Reports medians; writes JSON lines with ``--out`` and
prints a table. On a shared machine use ``--threads 1``: a second OpenMP thread
stalls whenever the other core is busy, which swamps the comparison.

Real-model inputs (``--qk FILE``, written by ``python -m sgl_spec.bench.prefill_mass
--save-qk FILE``; per layer q/k/v after RoPE and the chat's turn boundary):

    python -m sgl_spec.bench.vslash --qk FILE --crossover 256 512 1024 2048
    python -m sgl_spec.bench.vslash --qk FILE --reuse

``--crossover``: per new-token count n, an extend of the first n tokens after
``--history`` cached ones, summed over ``--layers``: one dense SDPA call (with an
offset causal mask over a prefix), the fused history + causal split
(``dense_attention_torch``, what exact mode runs over a prefix from
``SPLIT_MIN_QUERIES`` new queries on, so a too-dense layer too), ``select_lines`` + ``vslash_attention`` (the sparse
prefill's calls) and the serving path itself (``SparsePrefill.extend``);
the smallest n where the sparse path wins is ``--spec-prefill-min-tokens``'s default.
``--reuse``: the chat's second turn selected with and without the first turn's
lines as seeds: selection time, density and recovered mass (full attention).

``--device cuda`` (a lent GPU): the same synthetic inputs on the GPU, the lines through
the Triton kernel (``--impl``) against SDPA's fused kernels; times are CUDA-synchronised.

The line kernel is the torch impl's: the C++ slash kernel where it builds
(``kernels/vslash/cpu_kernel.py``), torch ops only with ``SGLSPEC_CPU_KERNELS=0``.
Every time is ``timing.median_s`` (median of ``--repeats``, no warm-up call).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_spec.bench import cli
from sgl_spec.bench.timing import median_s
from sgl_spec.config import PrefillConfig
from sgl_spec.kernels.vslash import vslash_attention
from sgl_spec.kernels.vslash.lines import LineSet, density, make_lines
from sgl_spec.kernels.vslash.select import SelectConfig, recovered_mass, select_lines


def random_lines(
    num_heads: int,
    n: int,
    history_len: int,
    target: float,
    local: int,
    sink: int,
    seed: int,
    vertical_share: float = 0.5,
) -> LineSet:
    """Band + sink + ``m`` random lines (verticals: ``vertical_share``), m bisected to target."""
    num_keys = history_len + n
    g = torch.Generator().manual_seed(seed)
    perms = [(torch.randperm(num_keys, generator=g), torch.randperm(num_keys, generator=g))
             for _ in range(num_heads)]

    def build(m: int) -> LineSet:
        mv = round(m * vertical_share)
        return make_lines(
            [torch.cat([torch.arange(sink), pv[:mv]]) for pv, _ in perms],
            [torch.cat([torch.arange(local), ps[: m - mv]]) for _, ps in perms],
        )

    lo, hi = 0, 2 * num_keys
    while lo < hi:
        mid = (lo + hi) // 2
        if float(density(build(mid), n, history_len).mean()) < target:
            lo = mid + 1
        else:
            hi = mid
    return build(lo)


def dense_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, history_len: int) -> torch.Tensor:
    """One SDPA call: ``is_causal`` without a prefix, an offset causal mask with one
    (exact mode's call for short extends, ``sgl_spec.attention.extend``)."""
    n, dev = q.shape[0], q.device
    mask = None
    if history_len:
        pos = torch.arange(history_len, history_len + n, device=dev)[:, None]
        mask = torch.arange(history_len + n, device=dev)[None, :] <= pos  # [n, N+n]
    out = scaled_dot_product_attention(
        q.movedim(0, 1).unsqueeze(0), k.movedim(0, 1).unsqueeze(0),
        v.movedim(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True,
        is_causal=mask is None,
    )
    return out.squeeze(0).movedim(1, 0)


def crossover(layers: list[dict], ns: list[int], history: int, alpha: float,
              repeats: int, max_density: float = 0.3, skip_density: float = 0.2) -> list[dict]:
    """Dense vs select + sparse per extend size, summed over the given layers.

    ``serving_s`` times the serving path itself (``SparsePrefill.extend``, a first
    extend, no stored lines): every layer selects; a layer denser than
    ``max_density`` then runs the dense path (exact mode's call, ``exact_extend``)
    instead of the line kernel.
    ``steady_s`` times the same extend again on the same instance: a layer that
    came out denser than ``skip_density`` skips its selection and makes the dense
    call (the state a server reaches after its first long extend). ``split_s`` is
    ``dense_attention_torch`` alone. ``per_layer`` keeps each layer's figures,
    ``fallback_s`` among them: the dense path a layer falls back to.
    """
    from sgl_spec.attention.extend import exact_extend
    from sgl_spec.attention.prefill import SparsePrefill, Turn
    from sgl_spec.config import PrefillConfig
    from sgl_spec.requests import RequestHub
    from sgl_spec.kernels.dense import dense_attention_torch

    cfg = SelectConfig(alpha=alpha)
    rows = []
    for n in ns:
        dense = split = select = sparse = serving = steady = dens = 0.0
        per_layer = []
        for i, lay in enumerate(layers):
            q = lay["q"][history : history + n]
            k, v = lay["k"][: history + n], lay["v"][: history + n]
            d_s = median_s(lambda: dense_sdpa(q, k, v, history), repeats)
            x_s = median_s(lambda: dense_attention_torch(q, k, v, history), repeats)
            s_s = median_s(lambda: select_lines(q, k, history, cfg), repeats)
            lines = select_lines(q, k, history, cfg)
            a_s = median_s(
                lambda: vslash_attention(q, k, v, lines, history, impl="torch"), repeats)
            dl = float(density(lines, n, history).mean())

            def prefill() -> SparsePrefill:
                pc = PrefillConfig(mode="loopserve", alpha=alpha, min_tokens=1,
                                   max_density=max_density, skip_density=skip_density)
                return SparsePrefill(pc, len(layers), hub=RequestHub())

            def serve(sp: SparsePrefill) -> None:
                sp.extend(Turn("bench", history + n, None, False), i, q, k, v, history, None,
                          exact=lambda: exact_extend(q, k, v, history, None))

            srv = median_s(lambda: serve(prefill()), repeats)  # fresh: no state
            warm = prefill()
            serve(warm)
            std = median_s(lambda: serve(warm), repeats)
            dense, split, select = dense + d_s, split + x_s, select + s_s
            sparse, serving, steady = sparse + a_s, serving + srv, steady + std
            dens += dl / len(layers)
            per_layer.append({"layer": lay.get("layer"), "density": dl, "dense_s": d_s,
                              "split_s": x_s, "select_s": s_s, "vslash_s": a_s,
                              "serving_s": srv, "steady_s": std,
                              "fallback_s": x_s if history else d_s})
        rows.append({"n": n, "history": history, "alpha": alpha, "layers": len(layers),
                     "dense_s": dense, "split_s": split, "select_s": select,
                     "vslash_s": sparse,
                     "speedup": dense / (select + sparse), "density": dens,
                     "max_density": max_density, "skip_density": skip_density,
                     "serving_s": serving, "serving_ratio": serving / dense,
                     "steady_s": steady, "steady_ratio": steady / dense,
                     "per_layer": per_layer})
    return rows


DENSITY_BINS = (0.0, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 1.0)


def break_even(per_layer: list[dict]) -> list[dict]:
    """Per density bin, the mean of ``(select + vslash) / fallback`` (does selecting
    pay?) and ``vslash / fallback`` (once selected, do the lines pay?): where they
    cross 1 are ``--spec-prefill-skip-density`` and ``--spec-prefill-max-density``."""
    out = []
    for lo, hi in zip(DENSITY_BINS, DENSITY_BINS[1:]):
        got = [p for p in per_layer if lo <= p["density"] < hi]
        if got:
            out.append({"lo": lo, "hi": hi, "layers": len(got),
                        "select_vslash": statistics.mean(
                            (p["select_s"] + p["vslash_s"]) / p["fallback_s"] for p in got),
                        "vslash": statistics.mean(p["vslash_s"] / p["fallback_s"] for p in got)})
    return out


def reuse(layers: list[dict], boundary: int, alpha: float, repeats: int) -> list[dict]:
    """Second turn of the captured chat, selected without and with turn 1's lines."""
    cfg = SelectConfig(alpha=alpha)
    out = []
    for seeded in (False, True):
        sel = dens = mass = 0.0
        for lay in layers:
            q, k = lay["q"], lay["k"]
            seeds = select_lines(q[:boundary], k[:boundary], 0, cfg) if seeded else None
            q2 = q[boundary:]
            sel += median_s(lambda: select_lines(q2, k, boundary, cfg, seeds=seeds), repeats)
            lines = select_lines(q2, k, boundary, cfg, seeds=seeds)
            dens += float(density(lines, q2.shape[0], boundary).mean()) / len(layers)
            mass += float(recovered_mass(q2, k, lines, boundary).mean()) / len(layers)
        out.append({"seeded": seeded, "alpha": alpha, "history": boundary,
                    "n": layers[0]["q"].shape[0] - boundary, "layers": len(layers),
                    "select_s": sel, "density": dens, "recovered_mass": mass})
    return out


def main_qk(args: argparse.Namespace) -> None:
    data = torch.load(args.qk)
    picked = args.layers or list(range(len(data["layers"])))
    layers = [data["layers"][i] for i in picked]
    if args.crossover:
        for i, lay in zip(picked, layers):
            lay.setdefault("layer", i)
        from sgl_spec.kernels.vslash.cpu_kernel import load_kernel

        kernel = "cpp" if load_kernel() is not None else "torch ops"
        rows = crossover(layers, args.crossover, args.history, args.alpha, args.repeats,
                         args.max_density, args.skip_density)
        print(f"crossover: layers {picked}, history {args.history}, alpha {args.alpha}, "
              f"{torch.get_num_threads()} threads, median of {args.repeats}, line kernel "
              f"{kernel}, max density {args.max_density}, skip density {args.skip_density}")
        print(f"{'n':>6} {'dense s':>8} {'split s':>8} {'select s':>9} {'vslash s':>9} "
              f"{'speedup':>8} {'density':>8} {'serving s':>10} {'serving/dense':>14} "
              f"{'steady s':>9} {'steady/dense':>13}")
        for r in rows:
            print(f"{r['n']:6d} {r['dense_s']:8.3f} {r['split_s']:8.3f} {r['select_s']:9.3f} "
                  f"{r['vslash_s']:9.3f} {r['speedup']:7.2f}x {r['density']:8.3f} "
                  f"{r['serving_s']:10.3f} {r['serving_ratio']:13.2f}x "
                  f"{r['steady_s']:9.3f} {r['steady_ratio']:12.2f}x")
            if args.per_layer:
                for p in r["per_layer"]:
                    print(f"    layer {p['layer']:>2} density {p['density']:.2f} dense "
                          f"{p['dense_s']:.3f} fallback {p['fallback_s']:.3f} select "
                          f"{p['select_s']:.3f} vslash {p['vslash_s']:.3f} "
                          f"(select+vslash)/fallback "
                          f"{(p['select_s'] + p['vslash_s']) / p['fallback_s']:.2f}")
                print("    density bin: (select+vslash)/fallback, vslash/fallback")
                for b in break_even(r["per_layer"]):
                    print(f"    [{b['lo']:.2f}, {b['hi']:.2f}) {b['layers']:3d} layers: "
                          f"{b['select_vslash']:.2f}, {b['vslash']:.2f}")
    else:
        rows = reuse(layers, data["turn_boundary"], args.alpha, args.repeats)
        print(f"reuse: layers {picked}, turn 2 = {rows[0]['n']} tokens over "
              f"{rows[0]['history']}, alpha {args.alpha}, {torch.get_num_threads()} threads")
        print(f"{'seeded':>7} {'select s':>9} {'density':>8} {'recovered mass':>15}")
        for r in rows:
            print(f"{str(r['seeded']):>7} {r['select_s']:9.3f} {r['density']:8.4f} "
                  f"{r['recovered_mass']:15.4f}")
    _append_jsonl(args.out, rows)


def _append_jsonl(path: str | None, rows: list[dict]) -> None:
    """``--out``: one JSON line per row, appended (runs accumulate in one file)."""
    if path:
        with open(path, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = cli.parser("python -m sgl_spec.bench.vslash", __doc__)
    cli.add_common(ap, out="append JSON lines here", out_required=False, out_metavar="FILE",
                   repeats="timed calls per figure (median; default 3)", repeats_default=3,
                   threads="torch threads (0: leave)", model_path=False)
    ap.add_argument("--n", type=int, default=6144)
    ap.add_argument("--history", type=int, help="cached tokens (default 6144; with --qk 0)")
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--density", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--vertical-share", type=float, nargs="+", default=[0.5, 0.9])
    ap.add_argument("--qk", metavar="FILE", help="real-model q/k/v (prefill_mass --save-qk)")
    ap.add_argument("--crossover", type=int, nargs="+", metavar="N",
                    help="with --qk: new-token counts to time dense vs select + sparse")
    ap.add_argument("--reuse", action="store_true", help="with --qk: seeded vs fresh turn 2")
    ap.add_argument("--layers", type=int, nargs="+", help="with --qk: layer ids (default all)")
    ap.add_argument("--alpha", type=float, default=PrefillConfig().alpha,
                    help="selection alpha (default: the served --spec-prefill-alpha, "
                    "%(default)s)")
    ap.add_argument("--max-density", type=float, default=0.3,
                    help="with --crossover: the serving rule's --spec-prefill-max-density")
    ap.add_argument("--skip-density", type=float, default=0.2,
                    help="with --crossover: the serving rule's --spec-prefill-skip-density")
    ap.add_argument("--per-layer", action="store_true",
                    help="with --crossover: each layer, and the break-even per density bin")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the synthetic inputs live (default cpu)")
    ap.add_argument("--impl", choices=["torch", "triton"],
                    help="the line kernel (default: torch on cpu, triton on cuda)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU; valid here: cpu")
    if args.device == "cuda" and args.qk:
        ap.error("--qk runs on cpu only; valid with --device cuda: the synthetic inputs")
    impl = args.impl or ("triton" if args.device == "cuda" else "torch")
    cli.set_threads(args.threads)
    if args.qk:
        if not (args.crossover or args.reuse):
            ap.error("--qk needs --crossover N... or --reuse")
        args.history = args.history or 0
        main_qk(args)
        return
    if args.history is None:
        args.history = 6144

    dtype = getattr(torch, args.dtype)
    n, hist = args.n, args.history
    g = torch.Generator().manual_seed(0)
    dev = args.device
    q = torch.randn(n, args.q_heads, args.head_dim, generator=g).to(dev, dtype)
    k = torch.randn(hist + n, args.kv_heads, args.head_dim, generator=g).to(dev, dtype)
    v = torch.randn(hist + n, args.kv_heads, args.head_dim, generator=g).to(dev, dtype)

    def time_s(fn) -> float:
        if dev == "cpu":
            return median_s(fn, args.repeats)
        return median_s(fn, args.repeats, warmup=1, sync=torch.cuda.synchronize)

    base_s = time_s(lambda: dense_sdpa(q, k, v, hist))
    select_s = time_s(lambda: select_lines(q, k, hist, SelectConfig(alpha=args.alpha)))
    rows = []
    for share, target in ((s, t) for s in args.vertical_share for t in args.density):
        lines = random_lines(args.kv_heads, n, hist, target, 64, 4, seed=1, vertical_share=share)
        sparse_s = time_s(lambda: vslash_attention(q, k, v, lines, hist, impl=impl))
        rows.append({
            "vertical_share": share,
            "n": n, "history": hist, "q_heads": args.q_heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "dtype": args.dtype,
            "density": float(density(lines, n, hist).mean()),
            "verticals_per_head": lines.vertical[0].numel(),
            "slashes_per_head": lines.slash[0].numel(),
            "dense_sdpa_s": base_s, f"vslash_{impl}_s": sparse_s,
            "speedup": base_s / sparse_s, "select_s": select_s,
            "threads": torch.get_num_threads(), "device": dev,
        })
    _append_jsonl(args.out, rows)
    where = torch.cuda.get_device_name() if dev == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"n={n} N={hist} Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} "
          f"{args.dtype}, {where}, median of {args.repeats}, lines: {impl}")
    print(f"dense SDPA {base_s:.3f} s; select_lines {select_s:.3f} s")
    print(f"{'density':>8} {'verticals':>9} {'slashes':>8} {'vslash s':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['density']:8.3f} {r['verticals_per_head']:9d} {r['slashes_per_head']:8d} "
              f"{r[f'vslash_{impl}_s']:9.3f} {r['speedup']:7.2f}x")


if __name__ == "__main__":
    main()
