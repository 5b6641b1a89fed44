"""Micro-benchmark: one decode step's attention, stock torch_native against sgl_spec.

    python -m sgl_spec.bench.decode_kernels --out results/decode-kernels \\
        [--histories 512 7168] [--batches 1 4] [--layers 30] [--threads 2] [--device cuda]

Per (history, batch): one decode step of every request over ``--layers`` layers of the
default model's shape (9 query heads, 3 KV heads, head_dim 64, bf16 KV in a pool with
scattered slots, as a server's pool after some churn), through

* ``torch_native``: stock sglang's decode call (SDPA per request, ``enable_gqa``), what
  stock serves and what sgl_spec's exact mode replaced;
* ``exact cpu`` / ``exact torch``: sgl_spec's exact mode, ``sparse_decode`` over dense
  subsets with the C++ kernel or the torch fallback (SDPA's fused kernel);
* ``loopserve cpu``: a sparse step of LoopServe B=``--budget`` (sink 4, window 64 + 16
  decoded tokens), what a selected request attends;
* LoopServe's reselection (``reselect_ms``, below the table): what a step that renews the
  selection adds, every ``nd`` = 16 steps: per layer, the request's keys gathered from the
  pool, scored by the last 16 decoded queries (``sparse.scoring.score_history``) and the
  top B kept (``select_topk``), as ``LoopServePolicy.reselect``; and the mean step of a
  long generation (the sparse step + 1/16 of it);
* ``round cpu``: a round-mode step: layers 1..``--watershed`` over the whole history, the
  layers above over ``--kept-share`` of it (round 0, the kept rounds, the current round;
  here the share as scattered positions), each with the C++ kernel.

``--kv-dtype float32`` times the pool dtype a CPU server uses by default (bfloat16: the
default here, what a GPU server uses).

Reports the median milliseconds of ``--repeats`` after one warm-up, the ratio to
torch_native, and each path's relative error against float64 attention over the same
positions. Writes results.json and results.md. Not a test.

``--device cuda`` (a lent GPU; sglang need not be installed there) times other paths,
since stock sglang decodes through FlashInfer there, which this bench does not load:

* ``dense sdpa``: each request's history gathered from the pool, then torch SDPA
  (``enable_gqa``): a dense baseline of torch's fused kernels, not stock's backend;
* ``exact triton`` / ``loopserve triton``: the Triton kernel over the dense subsets and
  over a LoopServe B=``--budget`` selection, split over the keys as it chooses
  (``triton_impl.auto_num_splits``); ``... (1 split)``: the same calls forced onto the
  one-pass kernel (one program per request and KV head), the split's baseline;
  ``loopserve torch``: the torch fallback;
* where FlashInfer imports, ``exact flashinfer`` / ``loopserve flashinfer``: its paged
  decode over one page list per (request, KV head), planned once per step and run per
  layer (``FlashInferSparseDecode``, as a serving pass does); ``... (plan per layer)``:
  ``sparse_decode(impl="flashinfer")`` per layer, a plan (and its host sync) each time.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch

from sgl_spec.bench import cli, render
from sgl_spec.bench.timing import median_s
from sgl_spec.config import DecodeConfig
from sgl_spec.kernels.sparse_decode import DecodeSubsets, dense_subsets, sparse_decode
from sgl_spec.kernels.sparse_decode.common import check_inputs, check_out, dims_of
from sgl_spec.kernels.sparse_decode.reference import sparse_decode_reference

PATHS = ("torch_native", "exact cpu", "exact torch", "loopserve cpu", "round cpu")
ONE_SPLIT = " (1 split)"  # path suffix: the Triton kernel with num_splits=1
PER_LAYER = " (plan per layer)"  # path suffix: FlashInfer planned at every layer
CUDA_PATHS = ("dense sdpa", "exact triton", f"exact triton{ONE_SPLIT}", "exact flashinfer",
              "loopserve triton", f"loopserve triton{ONE_SPLIT}", "loopserve flashinfer",
              f"loopserve flashinfer{PER_LAYER}", "loopserve torch")


class Tiered(NamedTuple):
    """Round mode's step: layers below ``split`` over ``lower``, the rest over ``upper``."""

    split: int
    lower: DecodeSubsets
    upper: DecodeSubsets


def _setup(history: int, batch: int, layers: int, hq: int, hkv: int, d: int, seed: int = 0,
           device: str = "cpu", dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator(device).manual_seed(seed)
    pool = batch * history + 64

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    ks = [randn(pool, hkv, d) for _ in range(layers)]
    vs = [randn(pool, hkv, d) for _ in range(layers)]
    perm = torch.randperm(pool, generator=g, device=device)[: batch * history]
    return ks, vs, perm.int().view(batch, history), randn(batch, hq, d)


def _sparse(r2t, rows, seq, hkv, budget, sink=4, window=80, seed=1) -> DecodeSubsets:
    g = torch.Generator().manual_seed(seed)
    n = int(seq[0])
    recent = n - window
    sel = torch.stack([torch.stack([torch.randperm(recent - sink, generator=g)[:budget].sort()
                                    .values + sink for _ in range(hkv)]) for _ in rows])
    dev = r2t.device
    return DecodeSubsets(r2t, rows, seq, sel.to(dev), torch.full((len(rows), hkv), budget,
                                                                   device=dev),
                         torch.full((len(rows),), recent, device=dev), sink)


def _measure(base: str, base_fn, subsets: dict, dense: DecodeSubsets, q, ks, vs, scale: float,
             repeats: int, history: int, batch: int, warmup: int = 1, sync=None,
             graph: bool = False) -> dict:
    """Time ``base_fn`` and ``sparse_decode`` over each of ``subsets`` (path "<name>
    <impl>", or "<name> triton (1 split)") across the layers, and each one's error
    against float64 attention. ``graph``: also each step captured in a CUDA graph and
    replayed (sglang decodes so on a GPU), for the paths that can be captured."""
    out = torch.empty_like(q)

    def ours(path, captured=False):
        impl, sub = path.split()[1], subsets[path]
        if isinstance(sub, Tiered):  # round mode
            split, lower, upper = sub
            return lambda: [sparse_decode(q, k, v, lower if i < split else upper, scale=scale,
                                          impl=impl, out=out, check=i in (0, split))
                            for i, (k, v) in enumerate(zip(ks, vs))][-1]
        if path.endswith(ONE_SPLIT):
            return lambda: _one_pass(q, ks, vs, sub, scale, out, check=not captured)
        if impl == "flashinfer" and not path.endswith(PER_LAYER):
            from sgl_spec.kernels.sparse_decode.flashinfer_impl import FlashInferSparseDecode

            runner = FlashInferSparseDecode(q.device)  # kept, as a serving loop keeps it
            if captured:  # planned before the capture, as sglang plans before a replay
                _plan(runner, q, ks[0], sub, scale)
                return lambda: _run_layers(runner, q, ks, vs, sub, out)
            return lambda: _planned_once(runner, q, ks, vs, sub, scale, out)
        # As a serving pass: the first layer checks the inputs, the others do not.
        return lambda: [sparse_decode(q, k, v, sub, scale=scale, impl=impl, out=out,
                                      check=i == 0 and not captured)
                        for i, (k, v) in enumerate(zip(ks, vs))][-1]

    fns = {base: base_fn, **{p: ours(p) for p in subsets}}
    ms = {p: 1e3 * median_s(fn, repeats, warmup=warmup, sync=sync) for p, fn in fns.items()}
    ms_graph = {}
    if graph:
        graph_fns = {base: base_fn, **{p: ours(p, captured=True) for p in subsets
                                       if not p.endswith(PER_LAYER) and "torch" not in p}}
        for p, fn in graph_fns.items():
            try:
                replay = _captured(fn)
                ms_graph[p] = 1e3 * median_s(replay, repeats, warmup=warmup, sync=sync)
            except Exception as exc:  # a path with a host sync cannot be captured
                ms_graph[p] = None
                print(f"{p}: not captured ({type(exc).__name__}: {exc})"[:300])
    errs, refs = {}, {}
    for p, fn in fns.items():
        sub = subsets.get(p, dense)
        sub = sub.upper if isinstance(sub, Tiered) else sub  # round: the last layer's
        if id(sub) not in refs:  # paths over the same subsets share one (slow) reference
            # The reference computes in float64 from fp32 copies of the same values.
            refs[id(sub)] = sparse_decode_reference(q.float(), ks[-1].float(), vs[-1].float(),
                                                    sub, scale=scale).double()
        ref = refs[id(sub)]
        got = fn().double()
        errs[p] = float((got - ref).norm() / ref.norm())
    res = {"history": history, "batch": batch, "layers": len(ks), "ms": ms,
           f"vs_{base.replace(' ', '_')}": {p: ms[p] / ms[base] for p in ms}, "rel_err": errs}
    if graph:
        res["ms_graph"] = ms_graph
    return res


def _captured(fn):
    """``fn`` captured in a CUDA graph (after warm-up on a side stream); its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _one_pass(q, ks, vs, sub: DecodeSubsets, scale: float, out, check=True) -> torch.Tensor:
    """The Triton kernel forced to one split, with ``sparse_decode``'s first-layer checks
    (so it pays what the auto-split path pays on top of the kernels)."""
    from sgl_spec.kernels.sparse_decode.triton_impl import sparse_decode_triton

    for i, (k, v) in enumerate(zip(ks, vs)):
        if i == 0 and check:
            dims = check_inputs(q, k, v, sub)
            check_out(out, q, dims)
        else:
            dims = dims_of(q, k, v, sub)
        sparse_decode_triton(q, k, v, sub, dims, scale=scale, out=out, num_splits=1)
    return out


def _planned_once(runner, q, ks, vs, sub: DecodeSubsets, scale: float, out) -> torch.Tensor:
    """FlashInfer as a serving pass drives it: one plan for the step, one run per layer."""
    _plan(runner, q, ks[0], sub, scale)
    return _run_layers(runner, q, ks, vs, sub, out)


def _plan(runner, q, k, sub: DecodeSubsets, scale: float) -> None:
    runner.plan(sub, num_q_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[2],
                scale=scale, q_dtype=q.dtype, kv_dtype=k.dtype)


def _run_layers(runner, q, ks, vs, sub: DecodeSubsets, out) -> torch.Tensor:
    for k, v in zip(ks, vs):
        runner.run(q, k, v, sub.sel_idx, out=out)
    return out


def _has_flashinfer() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def run_point(history: int, batch: int, layers: int, budget: int, repeats: int,
              hq: int = 9, hkv: int = 3, d: int = 64, dtype: torch.dtype = torch.bfloat16,
              watershed: int = 12, kept_share: float = 0.15) -> dict:
    from sgl_spec.integration.standalone import torch_native_decode

    ks, vs, r2t, q = _setup(history, batch, layers, hq, hkv, d, dtype=dtype)
    rows, seq = torch.arange(batch), torch.full((batch,), history)
    scale = d**-0.5
    dense = dense_subsets(r2t, rows, seq, hkv)
    subsets = {"exact cpu": dense, "exact torch": dense}
    if history > budget + 4 + 80:
        subsets["loopserve cpu"] = _sparse(r2t, rows, seq, hkv, budget)
    kept = int(kept_share * history) - 4 - 80
    if 0 < watershed < layers and kept > 0:
        subsets["round cpu"] = Tiered(watershed, dense, _sparse(r2t, rows, seq, hkv, kept))
    out = torch.empty_like(q)

    def native():
        for k, v in zip(ks, vs):
            torch_native_decode(q, out, k, v, r2t, rows, seq, scale)
        return out

    res = _measure("torch_native", native, subsets, dense, q, ks, vs, scale, repeats,
                   history, batch)
    if "loopserve cpu" in subsets:
        res["reselect_ms"] = 1e3 * median_s(_reselect(ks, r2t, rows, seq, hq, budget, scale),
                                            repeats, warmup=1)
    return res


RESELECT_EVERY = DecodeConfig.nd  # LoopServe's n_d: steps between reselections


def _reselect(ks, r2t, rows, seq, hq: int, budget: int, scale: float, nd: int = RESELECT_EVERY,
              sink: int = 4, window: int = 80):
    """One LoopServe reselection of every layer, as ``LoopServePolicy.reselect`` makes it
    (the keys gathered as ``Decoder`` gathers them for rows on scattered slots)."""
    from sgl_spec.sparse.scoring import score_history, select_topk

    n, d = int(seq[0]), ks[0].shape[2]
    g = torch.Generator().manual_seed(2)
    ring = torch.randn(len(rows), nd, hq, d, generator=g)
    q_pos = torch.arange(n - nd, n)[None].expand(len(rows), -1)
    slots = r2t[rows, :n].long()
    lo, hi = torch.full((len(rows),), sink), torch.full((len(rows),), n - window)

    def step():
        for k in ks:
            keys = k.index_select(0, slots.reshape(-1)).view(len(rows), n, *k.shape[1:])
            select_topk(score_history(ring, keys, scale, q_pos, seq), budget, lo, hi)
    return step


def run_point_cuda(history: int, batch: int, layers: int, budget: int, repeats: int,
                   hq: int = 9, hkv: int = 3, d: int = 64, graph: bool = False) -> dict:
    """The ``--device cuda`` paths (module doc); times with CUDA synchronisation."""
    ks, vs, r2t, q = _setup(history, batch, layers, hq, hkv, d, device="cuda")
    rows = torch.arange(batch, device="cuda")
    seq = torch.full((batch,), history, device="cuda")
    scale = d**-0.5
    dense = dense_subsets(r2t, rows, seq, hkv)
    fi = _has_flashinfer()
    subsets = {"exact triton": dense, f"exact triton{ONE_SPLIT}": dense}
    if fi:
        subsets["exact flashinfer"] = dense
    if history > budget + 4 + 80:
        sparse = _sparse(r2t, rows, seq, hkv, budget)
        subsets |= {"loopserve triton": sparse, f"loopserve triton{ONE_SPLIT}": sparse,
                    "loopserve torch": sparse}
        if fi:
            subsets |= {"loopserve flashinfer": sparse, f"loopserve flashinfer{PER_LAYER}": sparse}
    out = torch.empty_like(q)

    def sdpa():
        for k, v in zip(ks, vs):
            slots = r2t.long()  # [B, T]
            kb, vb = k[slots].transpose(1, 2), v[slots].transpose(1, 2)  # [B, Hkv, T, D]
            out.copy_(torch.nn.functional.scaled_dot_product_attention(
                q[:, :, None], kb, vb, scale=scale, enable_gqa=True)[:, :, 0])
        return out

    return _measure("dense sdpa", sdpa, subsets, dense, q, ks, vs, scale, repeats, history,
                    batch, warmup=2, sync=torch.cuda.synchronize, graph=graph)


def markdown(res: dict) -> str:
    rows = []
    c = res["config"]
    cuda = c.get("device") == "cuda"
    base, paths = ("dense sdpa", CUDA_PATHS) if cuda else ("torch_native", PATHS)
    graph = any("ms_graph" in pt for pt in res["points"])
    for pt in res["points"]:
        for p in paths:
            if p in pt["ms"]:
                row = [str(pt["history"]), str(pt["batch"]), p,
                       render.num(pt["ms"][p], digits=2),
                       render.ratio(pt[f"vs_{base.replace(' ', '_')}"][p])]
                if graph:
                    g, g0 = pt["ms_graph"].get(p), pt["ms_graph"].get(base)
                    row += ["-" if g is None else render.num(g, digits=2),
                            "-" if g is None or not g0 else render.ratio(g / g0)]
                rows.append(row + [f"{pt['rel_err'][p]:.1e}"])
    where = c.get("gpu") if cuda else f"{c['threads']} threads"
    kv = {"bfloat16": "bf16", "float32": "fp32"}.get(c.get("kv_dtype", "bfloat16"))
    head = (f"One decode step, {c['layers']} layers, 9/3 heads, head_dim 64, {kv} KV, "
            f"{where}, median of {c['repeats']}.")
    if not cuda and c.get("watershed"):
        head += (f" Round: layers 1-{c['watershed']} dense, the rest over "
                 f"{c['kept_share']:.0%} of the history.")
    cols = ["history", "batch", "path", "ms / step", f"vs {base}"]
    if graph:
        cols += ["ms / step, CUDA graph", f"vs {base}, graph"]
    notes = []
    for pt in res["points"]:
        if "reselect_ms" in pt:
            sparse, exact = pt["ms"]["loopserve cpu"], pt["ms"]["exact cpu"]
            mean = sparse + pt["reselect_ms"] / RESELECT_EVERY
            notes.append(f"- LoopServe at {pt['history']} x {pt['batch']}: a reselection "
                         f"(every {RESELECT_EVERY} steps) adds {pt['reselect_ms']:.1f} ms; a long "
                         f"generation's mean step {mean:.2f} ms, {mean / exact:.2f}x exact "
                         "cpu's")
    return "\n".join([head, "", *render.table(cols + ["rel. err (fp64)"], rows),
                      *([""] + notes if notes else [])]) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = cli.parser("python -m sgl_spec.bench.decode_kernels", __doc__)
    cli.add_common(ap, repeats="timed steps per figure (median; default 5)", repeats_default=5,
                   threads="torch CPU threads (default 0: leave torch's default)",
                   model_path=False)
    ap.add_argument("--histories", type=int, nargs="+", default=[512, 7168])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--kv-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the KV pool's dtype (a CPU server's default is float32)")
    ap.add_argument("--watershed", type=int, default=None,
                    help="round cpu: layers attending the whole history (L_w; default 0.4 "
                         "of --layers; 0: no round row)")
    ap.add_argument("--kept-share", type=float, default=0.15,
                    help="round cpu: the share of the history the upper layers attend (k/T)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="with --device cuda: also time each step captured in a CUDA graph "
                         "and replayed, as sglang decodes on a GPU")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu (default): stock's torch_native against the C++ kernel; "
                         "cuda: the Triton and torch paths against gathered SDPA")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU; valid here: cpu")
    if min(args.histories + args.batches + [args.layers, args.repeats, args.budget]) < 1:
        ap.error("--histories, --batches, --layers, --repeats and --budget must be >= 1")
    if args.watershed is None:
        args.watershed = round(0.4 * args.layers)
    if not 0 <= args.watershed < args.layers or not 0 < args.kept_share <= 1:
        ap.error(f"--watershed must be in 0..{args.layers - 1} and --kept-share in (0, 1]")
    cli.set_threads(args.threads)
    point = run_point_cuda if args.device == "cuda" else run_point
    config = {"layers": args.layers, "repeats": args.repeats, "budget": args.budget,
              "threads": torch.get_num_threads(), "device": args.device,
              "kv_dtype": args.kv_dtype}
    if args.device == "cpu":
        config |= {"watershed": args.watershed, "kept_share": args.kept_share}
        extra = {"dtype": getattr(torch, args.kv_dtype), "watershed": args.watershed,
                 "kept_share": args.kept_share}
    elif args.kv_dtype != "bfloat16":
        ap.error("--kv-dtype float32 is timed on cpu only")
    if args.device == "cuda":
        config["gpu"] = torch.cuda.get_device_name()
    if args.cuda_graph and args.device != "cuda":
        ap.error("--cuda-graph needs --device cuda")
    if args.device == "cuda":
        extra = {"graph": True} if args.cuda_graph else {}
    res = {"config": config,
           "points": [point(h, b, args.layers, args.budget, args.repeats, **extra)
                      for h in args.histories for b in args.batches]}
    md = markdown(res)
    cli.write_results(args.out, res, md)
    print(md)


if __name__ == "__main__":
    main()
