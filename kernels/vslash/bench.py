"""Benchmark: line-sparse prefill attention vs dense SDPA, same run, same inputs.

    python -m sgl_spec.kernels.vslash.bench --n 6144 --history 6144 --density 0.05 0.1 0.2

The baseline is the call the exact attention backend makes for an extend with a
cached prefix: ``scaled_dot_product_attention`` with the offset causal mask and
``enable_gqa``. Line sets per KV head: local band + sinks + random verticals and
isolated slashes (``--vertical-share`` of the added lines are verticals), sized to
the requested cell density. Reports medians; writes JSON lines with ``--out`` and
prints a table. On a shared machine use ``--threads 1``: a second OpenMP thread
stalls whenever the other core is busy, which swamps the comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.nn.functional import scaled_dot_product_attention

from .lines import LineSet, density, make_lines
from .select import SelectConfig, select_lines


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
    n = q.shape[0]
    pos = torch.arange(history_len, history_len + n)[:, None]
    mask = torch.arange(history_len + n)[None, :] <= pos  # [n, N+n]
    out = scaled_dot_product_attention(
        q.movedim(0, 1).unsqueeze(0), k.movedim(0, 1).unsqueeze(0),
        v.movedim(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True,
    )
    return out.squeeze(0).movedim(1, 0)


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=6144)
    ap.add_argument("--history", type=int, default=6144)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--density", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--vertical-share", type=float, nargs="+", default=[0.5, 0.9])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="append JSON lines here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from . import vslash_attention

    dtype = getattr(torch, args.dtype)
    n, hist = args.n, args.history
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, args.q_heads, args.head_dim, generator=g).to(dtype)
    k = torch.randn(hist + n, args.kv_heads, args.head_dim, generator=g).to(dtype)
    v = torch.randn(hist + n, args.kv_heads, args.head_dim, generator=g).to(dtype)

    base_s = _median_s(lambda: dense_sdpa(q, k, v, hist), args.repeats)
    select_s = _median_s(lambda: select_lines(q, k, hist, SelectConfig()), args.repeats)
    rows = []
    for share, target in ((s, t) for s in args.vertical_share for t in args.density):
        lines = random_lines(args.kv_heads, n, hist, target, 64, 4, seed=1, vertical_share=share)
        sparse_s = _median_s(
            lambda: vslash_attention(q, k, v, lines, hist, impl="torch"), args.repeats
        )
        rows.append({
            "vertical_share": share,
            "n": n, "history": hist, "q_heads": args.q_heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "dtype": args.dtype,
            "density": float(density(lines, n, hist).mean()),
            "verticals_per_head": lines.vertical[0].numel(),
            "slashes_per_head": lines.slash[0].numel(),
            "dense_sdpa_s": base_s, "vslash_torch_s": sparse_s,
            "speedup": base_s / sparse_s, "select_s": select_s,
            "threads": torch.get_num_threads(),
        })
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(f"n={n} N={hist} Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} "
          f"{args.dtype}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"dense SDPA {base_s:.3f} s; select_lines {select_s:.3f} s")
    print(f"{'density':>8} {'verticals':>9} {'slashes':>8} {'vslash s':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['density']:8.3f} {r['verticals_per_head']:9d} {r['slashes_per_head']:8d} "
              f"{r['vslash_torch_s']:9.3f} {r['speedup']:7.2f}x")


if __name__ == "__main__":
    main()
