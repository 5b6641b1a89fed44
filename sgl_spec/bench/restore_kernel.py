"""Micro-benchmark: writing a restored history from Krul's host rows into the KV pool.

    python -m sgl_spec.bench.restore_kernel --out results/restore-kernel \\
        [--tokens 4096] [--layers 30] [--codecs k8v4 int8] [--threads 1 2] [--repeats 7]

Per codec and thread count, one restore of ``--tokens`` tokens x ``--layers`` layers of the
default model's KV shape (3 KV heads, head_dim 64, bf16 pool, scattered slots), layer by
layer as HiCache's loader calls it:

* ``full copy``: the host rows in the pool's dtype gathered and written into the slots,
  what a stock host tier's load does on this CPU (``host[idx]`` then ``pool[slots] = ...``);
* ``codec, torch``: Krul's codec decoding to float32 temporaries, then the indexed write
  (``RowStore.get`` + write: the path before ``kernels.dequant``);
* ``codec, one pass``: ``kernels.dequant.dequant_scatter``, the C++ kernel
  (``RowStore.get_into``).

And what else a Krul follow-up pays that HiCache's does not, per codec:

* ``verify: checksum, gathered``: the restore's check of the stored rows as it was (every
  row gathered, copied to bytes, then hashed: ``Arena.checksum_ref``);
* ``verify: checksum, in place``: runs of consecutive rows hashed where they lie
  (``Arena.checksum``, what a restore runs);
* ``estimator: rows, gathered`` / ``estimator: rows, in place``: Krul's estimator observing
  one query row of a follow-up at every layer over the whole history
  (``observe.KrulObserver``; a turn of 128 new tokens observes one row, a shorter one
  none), over keys gathered from the pool, and read in place by the C++ kernel (what it
  runs on CPU).

Median, min and max milliseconds of ``--repeats`` after a warm-up; each path's pool rows
are checked equal to the torch path's, the two checksums equal. Writes results.json and
results.md. Not a test.
"""

from __future__ import annotations

import torch

from sgl_spec.bench import cli, render
from sgl_spec.bench.timing import samples_s, spread
from sgl_spec.tiers.arena import Arena
from sgl_spec.krul.codec import FullStore, RowStore, codec_class

H, D = 3, 64


def run(codec: str, tokens: int, layers: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n = tokens * layers
    store = codec_class(codec)(n, H, D, torch.bfloat16)
    full = FullStore(n, H, D, torch.bfloat16)
    rows = torch.randperm(n, generator=g)  # rows of a history are scattered in the arena
    k, v = (torch.randn(n, H, D, generator=g).bfloat16() for _ in range(2))
    store.put(rows, k, v)
    full.put(rows, k, v)
    slots = torch.randperm(2 * tokens, generator=g)[:tokens]
    pools = {p: (torch.zeros(2 * tokens, H, D, dtype=torch.bfloat16),
                 torch.zeros(2 * tokens, H, D, dtype=torch.bfloat16))
             for p in ("full copy", "codec, torch", "codec, one pass")}

    def layer_rows(layer):
        return rows[layer * tokens:(layer + 1) * tokens]

    def full_copy():
        pk, pv = pools["full copy"]
        for layer in range(layers):
            kk, vv = full.get(layer_rows(layer))
            pk[slots], pv[slots] = kk, vv

    def codec_torch():
        pk, pv = pools["codec, torch"]
        for layer in range(layers):  # the base class's get + indexed write
            RowStore.get_into(store, layer_rows(layer), pk, pv, slots)

    def one_pass():
        pk, pv = pools["codec, one pass"]
        for layer in range(layers):
            store.get_into(layer_rows(layer), pk, pv, slots)

    arena = Arena(tokens, layers, tokens * layers, H, D, torch.bfloat16, codec=codec)
    held = arena.alloc(tokens)  # consecutive rows, as a fresh arena hands them out
    for layer in range(layers):
        arena.write(layer, held, k[:tokens], v[:tokens])
    gathered, in_place = _estimator(tokens, layers, slots, pools["full copy"][0])
    paths = {"full copy": full_copy, "codec, torch": codec_torch, "codec, one pass": one_pass,
             "verify: checksum, gathered": lambda: arena.checksum_ref(held),
             "verify: checksum, in place": lambda: arena.checksum(held),
             "estimator: rows, gathered": gathered, "estimator: rows, in place": in_place}
    ms = {p: [1e3 * s for s in samples_s(fn, repeats, warmup=1)] for p, fn in paths.items()}
    same = all(torch.equal(pools["codec, torch"][i], pools["codec, one pass"][i])
               for i in range(2))
    return {"codec": codec, "threads": torch.get_num_threads(), "tokens": tokens,
            "layers": layers, "ms": {p: spread(x)._asdict() for p, x in ms.items()},
            "one_pass_equals_torch": same,
            "checksums_equal": arena.checksum(held) == arena.checksum_ref(held)}


def _estimator(tokens: int, layers: int, slots: torch.Tensor, k_buf: torch.Tensor):
    """Two callables: the estimator's one row of a 30-token follow-up over ``tokens`` keys
    at every layer (observed as a 128-token turn is), over gathered keys and read in
    place."""
    from sgl_spec.attention.batch import BatchView
    from sgl_spec.attention.observe import KrulObserver, ObserveConfig

    new = 30
    r2t = torch.zeros(1, tokens, dtype=torch.int32)
    r2t[0] = slots.int()
    view = BatchView("extend", ("follow-up",), (tokens,), (0,), (new,), True, r2t,
                     torch.tensor([0]), torch.tensor([tokens]),
                     torch.zeros(new, dtype=torch.int64), slots[tokens - new:].long())
    q = torch.randn(new, 3 * H, D).bfloat16()

    def play(in_place: bool):
        obs = KrulObserver(layers, ObserveConfig(tokens_per_row=new, worker=False))
        plan = obs.plan(view)
        if not in_place:
            plan = plan._replace(req_to_token=None)
        for layer in range(layers):
            obs.run(plan, layer, q, k_buf, D ** -0.5,
                    lambda i: k_buf.index_select(0, slots.long()))

    return (lambda: play(False)), (lambda: play(True))


def markdown(res: dict) -> str:
    rows = []
    for pt in res["points"]:
        base = pt["ms"]["full copy"]["median"]
        for p, s in pt["ms"].items():
            rows.append([pt["codec"], str(pt["threads"]), p,
                         f"{render.num(s['median'], digits=1)} ({render.num(s['min'], digits=1)}"
                         f"-{render.num(s['max'], digits=1)})", render.ratio(s["median"] / base)])
    c = res["config"]
    head = (f"One restore of {c['tokens']} tokens x {c['layers']} layers (3 KV heads, head_dim "
            f"64, bf16 pool) written layer by layer, median (min-max) of {c['repeats']}.")
    return "\n".join([head, "", *render.table(
        ["codec", "threads", "path", "ms", "vs full copy"], rows), "",
        "Checksums equal (in place = gathered): " + ", ".join(
            f"{pt['codec']}: {pt['checksums_equal']}" for pt in res["points"])]) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = cli.parser("python -m sgl_spec.bench.restore_kernel", __doc__)
    cli.add_common(ap, repeats="timed restores per figure (default 7)", repeats_default=7,
                   model_path=False)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--codecs", nargs="+", default=["k8v4", "int8"],
                    help="quantized codecs (krul.codec), default k8v4 int8")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="torch CPU threads, one figure each (default 1 2)")
    args = ap.parse_args(argv)
    for c in args.codecs:
        if c == "full":
            ap.error("--codecs: full has no decoding to time; valid: int8, k8v4")
        try:
            codec_class(c)
        except ValueError as e:
            ap.error(f"--codecs: {e}")
    if min([args.tokens, args.layers, args.repeats, *args.threads]) < 1:
        ap.error("--tokens, --layers, --repeats and --threads must be >= 1")
    meta, watch = cli.start_meta("none (the default model's KV shape, random values)")
    points = []
    for threads in args.threads:
        cli.set_threads(threads)
        for codec in args.codecs:
            points.append(run(codec, args.tokens, args.layers, args.repeats))
            print(f"{codec}, {threads} threads: done", flush=True)
    res = {"meta": cli.finish_meta(meta, watch),
           "config": {"tokens": args.tokens, "layers": args.layers, "repeats": args.repeats},
           "points": points}
    md = markdown(res)
    cli.write_results(args.out, res, md)
    print(md)


if __name__ == "__main__":
    main()
