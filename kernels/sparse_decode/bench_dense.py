"""Benchmark: a dense decode step, torch_native's call against ``dense.dense_decode``.

    python -m sgl_spec.kernels.sparse_decode.bench_dense --history 7168 --threads 1

One step of one request over ``--layers`` layers of the default model's shape
(9 query heads, 3 KV heads, head_dim 64, bf16 KV in a pool with scattered slots):
torch_native's ``_run_sdpa_forward_decode`` (SDPA with one query row and
``enable_gqa``, what exact mode and stock sglang call) against ``dense_decode`` (the
KV head's query heads folded into query rows of one SDPA call). Medians of
``--repeats``; also the relative error of each against a float64 reference.
"""

from __future__ import annotations

import argparse

import torch

from ..vslash.bench import _median_s
from .dense import dense_decode


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    return 1e3 * _median_s(fn, repeats)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=7168, help="tokens attended (default 7168)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.history < 1 or args.layers < 1 or args.q_heads % args.kv_heads:
        ap.error("--history and --layers must be >= 1, --q-heads a multiple of --kv-heads")
    if args.threads:
        torch.set_num_threads(args.threads)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    g = torch.Generator().manual_seed(0)
    n, hq, hkv, d = args.history, args.q_heads, args.kv_heads, args.head_dim
    pool = n + 512
    ks = [torch.randn(pool, hkv, d, generator=g).bfloat16() for _ in range(args.layers)]
    vs = [torch.randn(pool, hkv, d, generator=g).bfloat16() for _ in range(args.layers)]
    req_to_token = torch.randperm(pool, generator=g)[:n].int()[None]
    q = torch.randn(1, hq, d, generator=g).bfloat16()
    scale = d**-0.5
    rows, lens = torch.tensor([0]), torch.tensor([n])
    out = torch.empty_like(q)

    def native():
        for k, v in zip(ks, vs):
            TorchNativeAttnBackend._run_sdpa_forward_decode(
                None, q, out, k, v, req_to_token, rows, lens, scaling=scale, enable_gqa=True)
        return out[0]

    def folded():
        for k, v in zip(ks, vs):
            o = dense_decode(q[0], k, v, req_to_token[0], scale=scale)
        return o

    slots = req_to_token[0].long()
    kk = ks[-1][slots].double().repeat_interleave(hq // hkv, 1)  # [n, Hq, D]
    vv = vs[-1][slots].double().repeat_interleave(hq // hkv, 1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q[0].double(), kk) * scale, -1)
    ref = torch.einsum("hn,nhd->hd", p, vv)

    def err(o: torch.Tensor) -> float:
        return float((o.double() - ref).norm() / ref.norm())

    t_native, t_folded = _median_ms(native, args.repeats), _median_ms(folded, args.repeats)
    print(f"history {n}, {args.layers} layers, Hq={hq} Hkv={hkv} D={d} bf16, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"torch_native decode  {t_native:8.1f} ms/step  rel err vs fp64 {err(native()):.2e}")
    print(f"dense_decode         {t_folded:8.1f} ms/step  rel err vs fp64 {err(folded()):.2e}")
    print(f"speedup {t_native / t_folded:.2f}x")


if __name__ == "__main__":
    main()
