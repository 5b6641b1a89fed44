"""Micro-benchmark: one LoopServe reselection vs the n_d dense decode steps it covers.

    python -m sgl_spec.bench.reselect [--seq-len 7000] [--json out.json]

Per layer, a reselection scores the history with the ring of n_d queries in one
batched pass (``score_history``, into the buffers a policy reuses), looks ahead
(``look_ahead``, ``--lookahead``) and takes the top-B per KV head, ties to the earlier
position, as ``LoopServePolicy.reselect`` does; the baseline is
n_d dense decode steps of one query, the serving path's (``sparse_decode`` over dense
subsets: the C++ kernel reading the pool in place where it builds). The reselection is
timed twice: on contiguous K/V, and including the gather from a scattered KV pool
through the request's slot list (what the serving path pays). Reports medians and the ratio
reselect / (n_d x dense step); below 1 means reselection is cheaper. Times are
``timing.median_s`` of ``--repeats`` calls after ``WARMUP`` untimed ones. Not a test;
CPU by default.

``parts`` splits the served reselection (keys gathered from the pool) into its calls:
the gather, ``score_history`` and ``select`` as served (the C++ kernel on a CPU), and
beside them the torch path: ``score_history(impl="torch")`` (and, inside it, the logits'
matmul alone: in fp32 as a CPU scores, and in bfloat16 on bfloat16 operands as a GPU
does), ``look_ahead`` and ``select_topk``; and ``look_ahead`` + ``select_topk`` made once
for ``--layers`` layers' scores together, per layer.
"""

from __future__ import annotations

import json

import torch

from sgl_spec.bench import cli
from sgl_spec.bench.timing import median_s
from sgl_spec.kernels.sparse_decode import dense_subsets, sparse_decode
from sgl_spec.config import DecodeConfig
from sgl_spec.sparse.scoring import Scratch, look_ahead, score_history, select, select_topk

WARMUP = 3  # untimed calls before each median


def run(
    seq_len: int, nd: int, budget: int, num_q_heads: int, num_kv_heads: int,
    head_dim: int, dtype: torch.dtype, repeats: int, sink: int = 4, window: int = 64,
    lookahead: int = DecodeConfig.lookahead, layers: int = 30,
) -> dict:
    gen = torch.Generator().manual_seed(0)
    scale = head_dim**-0.5
    pool = seq_len * 2
    k_buf = torch.randn(pool, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buf = torch.randn(pool, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(pool, generator=gen)[:seq_len]  # the request's slot list
    k = k_buf[slots][None]  # [1, N, Hkv, D]: the layout score_history takes
    ring = torch.randn(1, nd, num_q_heads, head_dim, generator=gen).to(dtype)
    q_pos = torch.arange(seq_len - nd, seq_len)[None]
    lo, hi = torch.tensor([sink]), torch.tensor([seq_len - window])
    q1 = torch.randn(1, num_q_heads, head_dim, generator=gen).to(dtype)
    dense = dense_subsets(slots.int()[None], torch.tensor([0]), torch.tensor([seq_len]),
                          num_kv_heads)

    scratch = Scratch()

    def reselect(keys):  # as LoopServePolicy._select
        return select(score_history(ring, keys, scale, q_pos, scratch=scratch), budget, lo, hi,
                      lookahead)

    def dense_step():
        return sparse_decode(q1, k_buf, v_buf, dense, scale=scale)

    rows = {}
    with torch.inference_mode():
        for label, sel_fn, dense_fn in (
            ("K/V laid out", lambda: reselect(k), dense_step),
            ("gather from pool", lambda: reselect(k_buf.index_select(0, slots)[None]),
             dense_step),
        ):
            t_sel = median_s(sel_fn, repeats, WARMUP)
            t_dense = median_s(dense_fn, repeats, WARMUP)
            rows[label] = {
                "reselect_ms": t_sel * 1e3,
                "dense_step_ms": t_dense * 1e3,
                "nd_dense_steps_ms": nd * t_dense * 1e3,
                "ratio": t_sel / (nd * t_dense),
            }
        parts = _parts(ring, k_buf, slots, scale, q_pos, lo, hi, budget, lookahead, layers,
                       scratch, repeats)
    return {
        "parts": parts,
        "config": {
            "seq_len": seq_len, "nd": nd, "budget": budget, "num_q_heads": num_q_heads,
            "num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": str(dtype),
            "lookahead": lookahead, "layers": layers,
            "repeats": repeats, "threads": torch.get_num_threads(),
        },
        "per_layer": rows,
    }


def _parts(ring, k_buf, slots, scale, q_pos, lo, hi, budget, lookahead, layers, scratch,
           repeats) -> dict:
    """Per-layer ms of each call of the served reselection (module docstring)."""
    keys = k_buf.index_select(0, slots)[None]
    mass = score_history(ring, keys, scale, q_pos, scratch=scratch)
    ahead = look_ahead(mass, lookahead, lo)
    _, nd, hq, d = ring.shape
    hkv, n = keys.shape[2], keys.shape[1]
    q = ring[0].float().reshape(nd, hkv, hq // hkv, d).permute(1, 0, 2, 3).reshape(hkv, -1, d)
    kh = keys[0].permute(1, 0, 2).float().contiguous()
    qb, khb = q.bfloat16(), keys[0].permute(1, 0, 2).bfloat16().contiguous()  # as pooled
    many = ahead.expand(layers, -1, -1).contiguous()
    lo_l, hi_l = lo.expand(layers), hi.expand(layers)

    def ms(fn, per=1):
        return median_s(fn, repeats, WARMUP) * 1e3 / per

    out = {
        "gather_ms": ms(lambda: k_buf.index_select(0, slots)),
        "score_history_ms": ms(lambda: score_history(ring, keys, scale, q_pos,
                                                     scratch=scratch)),
        "select_ms": ms(lambda: select(mass, budget, lo, hi, lookahead)),
        "score_history_torch_ms": ms(lambda: score_history(ring, keys, scale, q_pos,
                                                           scratch=scratch, impl="torch")),
        "logits_matmul_fp32_ms": ms(lambda: torch.bmm(q, kh.transpose(1, 2))),
        "logits_matmul_bf16_ms": ms(lambda: torch.bmm(qb, khb.transpose(1, 2))),
        "look_ahead_ms": ms(lambda: look_ahead(mass, lookahead, lo)),
        "select_topk_ms": ms(lambda: select_topk(ahead, budget, lo, hi,
                                                 first_of_ties=lookahead > 0)),
        "layers_batched_look_ahead_select_ms": ms(
            lambda: select_topk(look_ahead(many, lookahead, lo_l), budget, lo_l, hi_l,
                                first_of_ties=lookahead > 0), per=layers),
    }
    out["sum_ms"] = sum(out[k] for k in ("gather_ms", "score_history_ms", "select_ms"))
    out["torch_sum_ms"] = sum(out[k] for k in ("gather_ms", "score_history_torch_ms",
                                               "look_ahead_ms", "select_topk_ms"))
    out["keys"] = n
    return out


def main(argv: list[str] | None = None) -> None:
    ap = cli.parser("python -m sgl_spec.bench.reselect", __doc__)
    ap.add_argument("--seq-len", type=int, default=7000)
    ap.add_argument("--nd", type=int, default=16)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--num-q-heads", type=int, default=9)
    ap.add_argument("--num-kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--lookahead", type=int, default=DecodeConfig.lookahead,
                    help=f"--spec-lookahead (default {DecodeConfig.lookahead}; 0: LoopServe's "
                    "own score)")
    cli.add_common(ap, out=None, repeats="timed calls per figure (median; default 20)",
                   repeats_default=20, threads="torch CPU threads (default 1: stable medians "
                   "on a shared machine; 0: leave torch's default)", threads_default=1,
                   model_path=False)
    ap.add_argument("--layers", type=int, default=30,
                    help="layers whose scores the batched row selects in one call (default 30: "
                    "the default model's)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error("--layers must be >= 1")
    cli.set_threads(args.threads)
    res = run(
        args.seq_len, args.nd, args.budget, args.num_q_heads, args.num_kv_heads,
        args.head_dim, getattr(torch, args.dtype), args.repeats, lookahead=args.lookahead,
        layers=args.layers,
    )
    c = res["config"]
    print(
        f"N={c['seq_len']} nd={c['nd']} B={c['budget']} heads {c['num_q_heads']}/"
        f"{c['num_kv_heads']} D={c['head_dim']} {c['dtype']} threads={c['threads']} "
        f"(medians of {c['repeats']}, one layer)"
    )
    print(f"{'':18} {'reselect ms':>12} {'dense step ms':>14} {'nd steps ms':>12} {'ratio':>7}")
    for label, r in res["per_layer"].items():
        print(
            f"{label:18} {r['reselect_ms']:12.3f} {r['dense_step_ms']:14.3f} "
            f"{r['nd_dense_steps_ms']:12.3f} {r['ratio']:7.3f}"
        )
    p = res["parts"]
    print("\nthe served reselection's calls, ms per layer (keys gathered from the pool):")
    for key, label in (("gather_ms", "gather"), ("score_history_ms", "score_history"),
                       ("select_ms", "select (look-ahead and top-B)"), ("sum_ms", "sum"),
                       ("score_history_torch_ms", "the torch path: score_history"),
                       ("logits_matmul_fp32_ms", "  its logits matmul, fp32"),
                       ("logits_matmul_bf16_ms", "  the same in bfloat16"),
                       ("look_ahead_ms", "  look_ahead"), ("select_topk_ms", "  select_topk"),
                       ("torch_sum_ms", "  sum, with the gather"),
                       ("layers_batched_look_ahead_select_ms",
                        f"look_ahead + select_topk, {c['layers']} layers in one call")):
        print(f"  {label:48} {p[key]:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
