"""Sparse decode kernels vs the per-head reference, and the reference vs dense attention.

Error metric: ``rel_err(a, ref) = max|a - ref| / max|ref|`` (max-norm relative error);
bounds 1e-3 in fp32, 2e-2 in bf16. Unused pool slots and unused req_to_token entries
are NaN-poisoned, so a kernel that reads a slot outside its subset returns NaN and
fails. The Triton kernel runs under TRITON_INTERPRET=1 on CPU hosts, set below before
triton is imported. When another test module imported triton first (sglang does), the
interpreter cannot be switched on in this process, so the Triton tests run again in a
fresh pytest process (``test_triton_in_a_fresh_process``) and are skipped here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

CUDA = torch.cuda.is_available()
# Triton reads TRITON_INTERPRET when it is first imported.
TRITON_LATE = not CUDA and "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET")
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sgl_spec.kernels.sparse_decode import (  # noqa: E402
    IMPLS,
    DecodeSubsets,
    copy_rows,
    default_impl,
    dense_subsets,
    head_logits,
    history_mass,
    select_top,
    sparse_decode,
)
from sgl_spec.kernels.sparse_decode import cpu_impl  # noqa: E402
from sgl_spec.sparse.scoring import score_history, select  # noqa: E402
from sgl_spec.kernels.sparse_decode.flashinfer_impl import (  # noqa: E402
    build_pages,
    fill_selected,
)
from sgl_spec.kernels.sparse_decode.reference import (  # noqa: E402
    copy_rows_reference,
    head_logits_reference,
    sparse_decode_reference,
)

TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double().cpu(), ref.double().cpu()
    return float((a - ref).abs().max() / ref.abs().max())


@dataclass(frozen=True)
class Case:
    name: str
    group: int  # query heads per KV head
    num_kv_heads: int
    seq_lens: tuple[int, ...]
    sink: int
    window: int  # request b's window is window + 3 * b (ragged)
    budget: int
    ragged_heads: bool = False  # KV head h selects budget - 2h (ragged sel_len)
    head_dim: int = 32

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("gqa1-B16-s4-w8", 1, 2, (40, 73), 4, 8, 16),
    Case("gqa2-B24-s4-w8", 2, 2, (61, 90), 4, 8, 24),
    Case("gqa3-default-heads-D64", 3, 3, (100, 37, 129), 4, 16, 32, head_dim=64),
    Case("gqa4-B8-s2-w4", 4, 1, (50,), 2, 4, 8),
    Case("gqa3-ragged-heads", 3, 3, (80, 45), 4, 8, 12, ragged_heads=True),
    Case("empty-selection", 2, 2, (64, 33), 4, 8, 0),
    Case("sink0", 3, 2, (70, 52), 0, 8, 16),
    Case("short-requests", 2, 2, (3, 1, 9), 4, 8, 16),  # sink/window cover everything
    # Qwen2.5-0.5B's heads (the long-context model): 14 query heads on 2 KV heads.
    Case("gqa7-qwen2.5-heads-D64", 7, 2, (150, 97), 4, 16, 32, head_dim=64),
]


@dataclass
class Batch:
    q: torch.Tensor
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    sel_idx: torch.Tensor
    sel_len: torch.Tensor
    recent_start: torch.Tensor
    sink: int
    scale: float
    dense_k: list[torch.Tensor]  # per request [seq_len, Hkv, D], unpooled copies
    dense_v: list[torch.Tensor]

    def subsets(self) -> DecodeSubsets:
        return DecodeSubsets(self.req_to_token, self.req_pool_indices, self.seq_lens,
                             self.sel_idx, self.sel_len, self.recent_start, self.sink)

    def dense(self) -> DecodeSubsets:
        return dense_subsets(self.req_to_token, self.req_pool_indices, self.seq_lens,
                             self.k_buf.shape[1])

    def to(self, device) -> Batch:
        moved = {
            f: getattr(self, f).to(device)
            for f in ("q", "k_buf", "v_buf", "req_to_token", "req_pool_indices",
                      "seq_lens", "sel_idx", "sel_len", "recent_start")
        }
        return Batch(**moved, sink=self.sink, scale=self.scale,
                     dense_k=self.dense_k, dense_v=self.dense_v)


def make_batch(
    case: Case,
    dtype: torch.dtype,
    seed: int = 0,
    select_all: bool = False,
    layer: int = 0,
) -> Batch:
    """A pool with scattered, NaN-poisoned slots and a random valid subset per head.

    ``seed`` fixes the layout (slots, rows, windows); ``layer`` the values and the
    selection, so batches that differ only in ``layer`` look like two layers of one
    batch. ``select_all``: the selection is every position between sink and window,
    so the subset is the whole history.
    """
    gen = torch.Generator().manual_seed(seed)
    vals = torch.Generator().manual_seed(1000 * seed + layer + 1)
    hkv, d = case.num_kv_heads, case.head_dim
    bsz, total = len(case.seq_lens), sum(case.seq_lens)
    num_slots = total + 17  # unused slots stay NaN
    perm = torch.randperm(num_slots, generator=gen)
    k_buf = torch.full((num_slots, hkv, d), float("nan"), dtype=dtype)
    v_buf = torch.full((num_slots, hkv, d), float("nan"), dtype=dtype)
    poison = int(perm[-1])  # a NaN slot for every unused req_to_token entry
    max_ctx = max(case.seq_lens) + 5
    req_to_token = torch.full((bsz + 3, max_ctx), poison, dtype=torch.int32)
    rows = torch.randperm(bsz + 3, generator=gen)[:bsz]

    dense_k, dense_v, recent, sels = [], [], [], []
    used = 0
    for b, n in enumerate(case.seq_lens):
        slots = perm[used : used + n]
        used += n
        k = torch.randn(n, hkv, d, generator=vals).to(dtype)
        v = torch.randn(n, hkv, d, generator=vals).to(dtype)
        k_buf[slots], v_buf[slots] = k, v
        req_to_token[rows[b], :n] = slots.to(torch.int32)
        dense_k.append(k)
        dense_v.append(v)
        r = max(0, n - case.window - 3 * b)
        recent.append(r)
        sink_end = min(case.sink, n)
        lo, hi = sink_end, max(r, sink_end)
        per_head = []
        for h in range(hkv):
            if select_all:
                per_head.append(torch.arange(lo, hi))
                continue
            want = max(0, case.budget - (2 * h if case.ragged_heads else 0))
            cand = torch.arange(lo, hi)
            pick = torch.randperm(len(cand), generator=vals)[: min(want, len(cand))]
            per_head.append(cand[pick])  # unsorted on purpose
        sels.append(per_head)

    max_sel = max([len(s) for per_head in sels for s in per_head] + [0])
    sel_idx = torch.full((bsz, hkv, max_sel), -1, dtype=torch.int64)
    sel_len = torch.zeros(bsz, hkv, dtype=torch.int64)
    for b, per_head in enumerate(sels):
        for h, s in enumerate(per_head):
            sel_idx[b, h, : len(s)] = s
            sel_len[b, h] = len(s)
    q = torch.randn(bsz, hkv * case.group, d, generator=vals).to(dtype)
    return Batch(
        q, k_buf, v_buf, req_to_token, rows.long(),
        torch.tensor(case.seq_lens, dtype=torch.int64), sel_idx, sel_len,
        torch.tensor(recent, dtype=torch.int64), case.sink, d**-0.5, dense_k, dense_v,
    )


def run_impl(batch: Batch, impl: str, dense: bool = False) -> torch.Tensor:
    sub = batch.dense() if dense else batch.subsets()
    return sparse_decode(batch.q, batch.k_buf, batch.v_buf, sub, scale=batch.scale, impl=impl)


def reference(batch: Batch) -> torch.Tensor:
    return sparse_decode_reference(batch.q, batch.k_buf, batch.v_buf, batch.subsets(),
                                   scale=batch.scale)


def dense_attention(batch: Batch) -> torch.Tensor:
    """Plain full-history attention from the unpooled K/V (torch SDPA, fp32)."""
    outs = []
    for b, (k, v) in enumerate(zip(batch.dense_k, batch.dense_v)):
        q = batch.q[b].float()[:, None, :]  # [Hq, 1, D]
        g = q.shape[0] // k.shape[1]
        kk = k.float().transpose(0, 1).repeat_interleave(g, 0)  # [Hq, N, D]
        vv = v.float().transpose(0, 1).repeat_interleave(g, 0)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(q, kk, vv, scale=batch.scale)[:, 0]
        )
    return torch.stack(outs)


@pytest.fixture(scope="module")
def triton_ready():
    pytest.importorskip("triton")
    if TRITON_LATE:
        pytest.skip("triton was imported without the interpreter; "
                    "test_triton_in_a_fresh_process runs these tests")
    from sgl_spec.kernels.sparse_decode import triton_impl

    assert CUDA or triton_impl._interpreted()


@pytest.mark.skipif(not TRITON_LATE, reason="the Triton tests run in this process")
def test_triton_in_a_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "triton and not fresh_process"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]


# ---------------------------------------------------------------- reference


@pytest.mark.parametrize("case", CASES[:4], ids=str)
@pytest.mark.parametrize("layout", ["recent-only", "sink+select-all+window"])
def test_reference_with_full_subset_is_dense_attention(case, layout):
    batch = make_batch(case, torch.float32, select_all=layout != "recent-only")
    if layout == "recent-only":
        batch.sel_idx = batch.sel_idx[:, :, :0]
        batch.sel_len.zero_()
        batch.recent_start.zero_()
    assert rel_err(reference(batch), dense_attention(batch)) < 1e-5


def test_reference_rejects_overlapping_selection():
    batch = make_batch(CASES[0], torch.float32)
    batch.sel_idx[0, 0, 0] = 0  # inside the sink
    with pytest.raises(AssertionError, match="overlap the sink"):
        reference(batch)
    batch = make_batch(CASES[0], torch.float32)
    batch.sel_idx[0, 0, 1] = batch.sel_idx[0, 0, 0]
    with pytest.raises(AssertionError, match="not unique"):
        reference(batch)


def test_unknown_impl_lists_valid_ones():
    batch = make_batch(CASES[0], torch.float32)
    with pytest.raises(ValueError, match="valid: cpu, torch, triton, flashinfer"):
        run_impl(batch, "cuda")
    assert IMPLS == ("cpu", "torch", "triton", "flashinfer")


# ---------------------------------------------------------------- torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_torch_matches_reference(case, dtype):
    batch = make_batch(case, dtype)
    out = run_impl(batch, "torch")
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert rel_err(out, reference(batch)) <= TOL[dtype]


@pytest.mark.parametrize("case", CASES[:3], ids=str)
def test_torch_full_subset_is_dense_attention(case):
    batch = make_batch(case, torch.float32, select_all=True)
    assert rel_err(run_impl(batch, "torch"), dense_attention(batch)) <= 1e-5


@pytest.mark.parametrize("impl", ["torch", "cpu"])
def test_writes_out(impl):
    batch = make_batch(CASES[2], torch.float32)
    out = torch.empty_like(batch.q)
    res = sparse_decode(batch.q, batch.k_buf, batch.v_buf, batch.subsets(), scale=batch.scale,
                        impl=impl, out=out)
    assert res is out and rel_err(out, reference(batch)) <= 1e-3


@pytest.mark.parametrize("impl", ["torch", None])
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_value_head_dim_may_differ(impl, check):
    """Dv != D: the unchecked later layers size by V's width too, and the default impl
    is the torch one (the C++ kernel takes Dv == D only)."""
    batch = make_batch(CASES[2], torch.float32)
    v_buf = torch.randn(*batch.v_buf.shape[:2], 48, generator=torch.Generator().manual_seed(7))
    sub = batch.subsets()
    want = sparse_decode_reference(batch.q, batch.k_buf, v_buf, sub, scale=batch.scale)
    out = torch.empty(*batch.q.shape[:2], 48)
    got = sparse_decode(batch.q, batch.k_buf, v_buf, sub, scale=batch.scale, impl=impl,
                        out=out, check=check)
    assert got.shape == (*batch.q.shape[:2], 48) and rel_err(got, want) <= 1e-3
    assert default_impl(batch.q, batch.k_buf, v_buf) == "torch"


@pytest.mark.parametrize("impl", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES[:5], ids=str)
def test_dense_subsets_are_dense_attention(impl, case, dtype):
    """Exact mode's call: every row attends its whole history (ragged lengths)."""
    batch = make_batch(case, dtype)
    out = run_impl(batch, impl, dense=True)
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert rel_err(out, dense_attention(batch)) <= TOL[dtype]


# ---------------------------------------------------------------- cpu (C++)


def test_cpu_kernel_builds_and_is_the_default():
    """The C++ kernel builds here (g++ and ninja, pyproject's ``ninja``) and
    ``impl=None`` takes it for the shapes it is instantiated for."""
    assert cpu_impl.load_kernel() is not None
    batch = make_batch(CASES[2], torch.bfloat16)
    assert default_impl(batch.q, batch.k_buf, batch.v_buf) == "cpu"
    odd = torch.zeros(1, 2, 48)  # head_dim 48: not instantiated
    assert default_impl(odd, torch.zeros(4, 1, 48), torch.zeros(4, 1, 48)) == "torch"
    nine = torch.zeros(1, 9, 64)  # 9 query heads per KV head
    assert default_impl(nine, torch.zeros(4, 1, 64), torch.zeros(4, 1, 64)) == "torch"
    with pytest.raises(ValueError, match="valid impls otherwise: torch"):
        sparse_decode(odd, torch.zeros(4, 1, 48), torch.zeros(4, 1, 48),
                      dense_subsets(torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1).long(),
                                    torch.ones(1).long(), 1), scale=1.0, impl="cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_matches_reference(case, dtype):
    batch = make_batch(case, dtype)
    out = run_impl(batch, "cpu")
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert rel_err(out, reference(batch)) <= TOL.get(dtype, 2e-2)


def test_cpu_long_lists_split_across_threads():
    """Lists longer than the kernel's 256-entry chunks are split and merged exactly,
    with very different lengths in one batch."""
    case = Case("long-ragged", 3, 3, (1500, 7, 700, 300), 4, 64, 400, head_dim=64)
    batch = make_batch(case, torch.bfloat16)
    assert rel_err(run_impl(batch, "cpu"), reference(batch)) <= 2e-2
    assert rel_err(run_impl(batch, "cpu", dense=True), dense_attention(batch)) <= 2e-2


def test_cpu_kernel_rejects_bad_inputs():
    mod = cpu_impl.load_kernel()
    batch = make_batch(CASES[2], torch.float32)
    sub = batch.subsets()
    args = (sub.req_to_token, sub.rows, sub.seq_lens, sub.sel_idx, sub.sel_len)
    with pytest.raises(RuntimeError, match="recent_start < seq_len"):
        mod.decode(batch.q.contiguous(), batch.k_buf, batch.v_buf, *args, sub.seq_lens, 4)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        mod.decode(batch.q.double(), batch.k_buf, batch.v_buf, *args, sub.recent_start, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("d,group", [(64, 3), (32, 1), (128, 8), (64, 7)])
def test_head_logits_kernel_matches_reference(dtype, d, group):
    """The retrieval head's logits read in place from the pool equal a float64 gather,
    for ragged rows (padded with -inf to N, chunk edges crossed), every instantiated
    head size and fp32/bf16/fp16 keys."""
    g = torch.Generator().manual_seed(d + group)
    hkv, slots = 2, 3000
    keys = torch.randn(slots, hkv, d, generator=g).to(dtype)
    r2t = torch.randperm(slots, generator=g)[:2 * 1400].view(2, 1400).int()
    rows, n_keys, n = torch.tensor([1, 0, 1]), torch.tensor([1300, 1, 257]), 1320
    q = torch.randn(3, hkv * group, d, generator=g)
    got = head_logits(q, keys, r2t, rows, n_keys, n)
    assert got is not None and got.shape == (3, hkv, group, n)
    ref = head_logits_reference(q, keys, r2t, rows, n_keys, n)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got)) and bool((got[~fin] == float("-inf")).all())
    assert torch.allclose(got[fin], ref[fin], rtol=1e-4, atol=1e-4)


def test_head_logits_kernel_declines_or_rejects():
    """Shapes the kernel is not built for fall back (None); bad calls are refused."""
    r2t = torch.arange(8, dtype=torch.int32)[None]
    one = torch.tensor([0])
    assert head_logits(torch.zeros(1, 9, 64), torch.zeros(8, 1, 64), r2t, one,
                       torch.tensor([4]), 4) is None  # 9 query heads per KV head
    mod = cpu_impl.load_kernel()
    with pytest.raises(RuntimeError, match="n_keys <= N"):
        mod.head_scores(torch.zeros(1, 2, 64), torch.zeros(8, 1, 64), r2t, one,
                        torch.tensor([6]), 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("d,group,n_q", [(64, 3, 16), (32, 1, 5), (128, 8, 3), (64, 7, 64)])
def test_history_mass_kernel_matches_the_torch_path(dtype, d, group, n_q):
    """LoopServe's and SnapKV's scoring in C++ equals the torch path (itself checked
    against a float64 softmax in test_sparse_policies) for every instantiated head size,
    16-bit and fp32 keys, query slots not a multiple of 8, ragged rows whose padding is
    never read, unfilled ring entries (-1), causal queries, and chunk edges crossed."""
    g = torch.Generator().manual_seed(d + group + n_q)
    hkv, big_n = 2, 1100
    keys = torch.randn(3, big_n, hkv, d, generator=g).to(dtype)
    lens = torch.tensor([big_n, 300, 257])
    keys[1, 300:] = float("nan")  # padding: never read into a score
    keys[2, 257:] = float("nan")
    q = torch.randn(3, n_q, hkv * group, d, generator=g)
    q_pos = (lens[:, None] - n_q + torch.arange(n_q)).clamp(min=-1)
    q_pos[0, 0] = -1  # an unfilled ring entry
    got = history_mass(q, keys, d**-0.5, q_pos, lens)
    assert got is not None and got.shape == (3, hkv, big_n) and not torch.isnan(got).any()
    want = score_history(q, keys.float().nan_to_num(), d**-0.5, q_pos, lens, impl="torch")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert bool((got[1, :, 300:] == 0).all()) and bool((got[2, :, 257:] == 0).all())
    # Each used query head pays a total mass of 1.
    used = (q_pos >= 0).sum(dim=1) * group * hkv
    torch.testing.assert_close(got.sum(dim=(1, 2)), used.float(), rtol=1e-4, atol=1e-4)
    assert torch.equal(score_history(q, keys, d**-0.5, q_pos, lens), got)  # auto: the kernel


@pytest.mark.parametrize("width", [0, 1, 16])
def test_select_top_kernel_equals_look_ahead_and_topk(width):
    """The selection in C++ (look-ahead, then the top B of [lo, hi), earlier positions
    first among ties) equals torch's look_ahead + select_topk(first_of_ties) exactly,
    on scores with plateaus (ties at the budget's edge) and on random scores, for rows
    with their own sink end and window start; too few candidates are refused."""
    g = torch.Generator().manual_seed(width)
    plateaus = torch.randint(0, 6, (2, 3, 900), generator=g).float()
    random = torch.rand(2, 3, 900, generator=g)
    lo, hi = torch.tensor([4, 0]), torch.tensor([836, 600])
    for scores in (plateaus, random):
        got = select_top(scores, lo, hi, 200, width)
        want = select(scores, 200, lo, hi, width, impl="torch")
        assert got is not None and torch.equal(got, want)
        assert torch.equal(select(scores, 200, lo, hi, width), got)  # auto: the kernel
    with pytest.raises(RuntimeError, match="candidates"):
        cpu_impl.load_kernel().select_top(random, lo, torch.tensor([100, 600]), 200, width)


def test_scoring_kernels_decline_what_they_are_not_built_for():
    """Head sizes without an instance and non-CPU-float inputs fall back (None) to the
    torch path."""
    q, k = torch.zeros(1, 2, 3, 48), torch.zeros(1, 10, 1, 48)
    assert history_mass(q, k, 1.0, None, None) is None
    assert score_history(q, k, 1.0).shape == (1, 1, 10)  # the torch path
    assert history_mass(q[..., :32], k.double()[..., :32], 1.0, None, None) is None
    assert select_top(torch.zeros(1, 1, 8).double(), torch.tensor([0]), torch.tensor([8]),
                      2, 0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_copy_rows_kernel_matches_reference(dtype):
    """Elastic loads: the one-call C++ copy of K and V rows equals index_select +
    index_copy_, and leaves the other rows untouched; out-of-range rows are refused."""
    g = torch.Generator().manual_seed(0)
    pool_k, pool_v = (torch.randn(500, 3, 64, generator=g).to(dtype) for _ in range(2))
    stage = [torch.randn(40, 3, 64, generator=g).to(dtype) for _ in range(2)]
    want = [t.clone() for t in stage]
    dst = torch.randperm(120, generator=g)[:50]
    src = torch.randint(0, 1500, (50,), generator=g)
    copy_rows(*stage, pool_k, pool_v, dst, src)
    copy_rows_reference(*want, pool_k, pool_v, dst, src)
    assert torch.equal(stage[0], want[0]) and torch.equal(stage[1], want[1])
    with pytest.raises(RuntimeError, match="out of range"):
        copy_rows(*stage, pool_k, pool_v, torch.tensor([120]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="out of range"):
        copy_rows(*stage, pool_k, pool_v, torch.tensor([0]), torch.tensor([1500]))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_copy_rows_from_a_host_pool_cuda(pinned):
    """An offloaded layer: the pool in host memory, staging and indices on the GPU. A
    pinned pool takes the Triton kernel (read in place), a pageable one the reference
    (gathered on the host); both equal the reference on one device."""
    g = torch.Generator().manual_seed(1)
    pool = [torch.randn(700, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2)]
    host = [t.pin_memory() if pinned else t for t in pool]
    stage = [torch.randn(64, 2, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(2)]
    want = [t.cpu() for t in stage]
    dst, src = torch.randperm(128, generator=g)[:90], torch.randint(0, 1400, (90,), generator=g)
    copy_rows(*stage, *host, dst.cuda(), src.cuda())
    copy_rows_reference(*want, *pool, dst, src)
    assert torch.equal(stage[0].cpu(), want[0]) and torch.equal(stage[1].cpu(), want[1])


# ---------------------------------------------------------------- triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [0, 1, 45, 200])
def test_triton_copy_rows_matches_reference(triton_ready, dtype, rows):
    """The elastic loads' Triton kernel (device pool; on a GPU also a pinned host pool,
    read in place) equals index_select + index_copy_ and leaves other rows alone."""
    from sgl_spec.kernels.sparse_decode.triton_copy import copy_rows_triton

    g = torch.Generator().manual_seed(rows)
    pool = [torch.randn(300, 3, 48, generator=g).to(dtype) for _ in range(2)]
    stage0 = [torch.randn(80, 3, 48, generator=g).to(dtype) for _ in range(2)]
    dst = torch.randperm(240, generator=g)[:rows]
    src = torch.randint(0, 900, (rows,), generator=g)
    want = [t.clone() for t in stage0]
    copy_rows_reference(*want, *pool, dst, src)
    dev = "cuda" if CUDA else "cpu"
    pools = [[t.to(dev) for t in pool]] + ([[t.pin_memory() for t in pool]] if CUDA else [])
    for p in pools:
        stage = [t.to(dev) for t in stage0]
        copy_rows_triton(*stage, *p, dst.to(dev), src.to(dev))
        assert torch.equal(stage[0].cpu(), want[0]) and torch.equal(stage[1].cpu(), want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_matches_reference(triton_ready, case, dtype):
    batch = make_batch(case, dtype, seed=1)
    ref = reference(batch)
    out = run_impl(batch.to("cuda") if CUDA else batch, "triton")
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert rel_err(out, ref) <= TOL[dtype]


def test_triton_full_subset_is_dense_attention(triton_ready):
    batch = make_batch(CASES[2], torch.float32, select_all=True)
    out = run_impl(batch.to("cuda") if CUDA else batch, "triton")
    assert rel_err(out, dense_attention(batch)) <= 1e-5


# ---------------------------------------------------------------- triton, split over keys

# Subsets of several blocks (BLOCK_N = 64 at group 1, 16 at group 7), so several splits
# get work; the last, 2-3 token request leaves every split but the first empty.
SPLIT_CASES = [
    Case("gqa1-long-select", 1, 2, (200, 150, 3), 4, 8, 160),
    Case("gqa7-ragged-heads-D64", 7, 2, (150, 97, 2), 4, 16, 64, ragged_heads=True,
         head_dim=64),
]


def run_triton(batch: Batch, num_splits: int | None, dense: bool = False) -> torch.Tensor:
    from sgl_spec.kernels.sparse_decode.common import check_inputs
    from sgl_spec.kernels.sparse_decode.triton_impl import sparse_decode_triton

    batch = batch.to("cuda") if CUDA else batch
    sub = batch.dense() if dense else batch.subsets()
    dims = check_inputs(batch.q, batch.k_buf, batch.v_buf, sub)
    out = torch.full_like(batch.q, float("nan"))
    return sparse_decode_triton(batch.q, batch.k_buf, batch.v_buf, sub, dims,
                                scale=batch.scale, out=out, num_splits=num_splits)


def subset_sizes(batch: Batch) -> torch.Tensor:  # [B, Hkv]: positions each pair attends
    sink_end = batch.seq_lens.clamp(max=batch.sink)
    recent = torch.maximum(batch.recent_start, sink_end)
    return (sink_end + batch.seq_lens - recent)[:, None] + batch.sel_len


@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
@pytest.mark.parametrize(("num_splits", "dtype"), [
    pytest.param(2, torch.float32, id="2splits-fp32"),
    pytest.param(3, torch.bfloat16, id="3splits-bf16"),
    pytest.param(7, torch.float32, id="7splits-fp32"),
    pytest.param(7, torch.bfloat16, id="7splits-bf16"),
])
def test_triton_splits_match_reference(triton_ready, num_splits, dtype, case):
    from sgl_spec.kernels.sparse_decode.triton_impl import block_n_for

    batch = make_batch(case, dtype, seed=4)
    sizes, block_n = subset_sizes(batch), block_n_for(case.group)
    assert int(sizes.max()) > 2 * block_n  # several splits get work
    assert int(sizes.min()) <= block_n  # splits after the first get none
    out = run_triton(batch, num_splits)
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert rel_err(out, reference(batch)) <= TOL[dtype]


@pytest.mark.parametrize("num_splits", [3, 7, None], ids=lambda n: f"{n or 'auto'}splits")
def test_triton_splits_dense_subsets_are_dense_attention(triton_ready, num_splits):
    """Long dense lists; auto picks 4 splits for this one request (132 SMs assumed
    under the interpreter: 264 programs wanted, 605 // (4 blocks of 32) = 4 allowed)."""
    from sgl_spec.kernels.sparse_decode import triton_impl

    case = Case("gqa4-dense-600", 4, 1, (600,), 0, 8, 0)
    batch = make_batch(case, torch.float32, seed=5)
    if num_splits is None and not CUDA:
        assert triton_impl.auto_num_splits(1, 605, triton_impl.block_n_for(4)) == 4
    assert rel_err(run_triton(batch, num_splits, dense=True), dense_attention(batch)) <= 1e-5


@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda n: f"{n}splits")
def test_triton_empty_subset_writes_zeros(triton_ready, num_splits):
    """A row with seq_len 0 (outside the contract: a padded batch row) attends nothing:
    every split's LSE is -inf and the merge writes zeros, not NaN; the other rows are
    unaffected."""
    from sgl_spec.kernels.sparse_decode import take_rows

    batch = make_batch(SPLIT_CASES[0], torch.float32, seed=6)
    batch.seq_lens[2] = 0
    batch.recent_start[2] = 0
    batch.sel_len[2] = 0
    out = run_triton(batch, num_splits).cpu()
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    keep = torch.tensor([0, 1])
    want = sparse_decode_reference(batch.q[keep], batch.k_buf, batch.v_buf,
                                   take_rows(batch.subsets(), keep), scale=batch.scale)
    assert rel_err(out[keep], want) <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_split_merge_matches_reference(triton_ready, dtype):
    """The merge kernel alone: 37 splits (three 16-split chunks), empty splits (-inf LSE,
    zero partials) scattered, and one (request, head) with every split empty."""
    from sgl_spec.kernels.sparse_decode.reference import merge_splits_reference
    from sgl_spec.kernels.sparse_decode.triton_impl import merge_splits

    gen = torch.Generator().manual_seed(7)
    part = torch.randn(2, 3, 37, 40, generator=gen)
    lse = 5 * torch.randn(2, 3, 37, generator=gen)
    empty = torch.rand(2, 3, 37, generator=gen) < 0.3
    empty[1, 2] = True
    lse[empty] = float("-inf")
    part[empty] = 0.0
    want = merge_splits_reference(part, lse)
    dev = "cuda" if CUDA else "cpu"
    out = merge_splits(part.to(dev), lse.to(dev), torch.empty(2, 3, 40, dtype=dtype, device=dev))
    assert torch.isfinite(out).all() and torch.equal(out[1, 2].cpu(), torch.zeros(40, dtype=dtype))
    assert rel_err(out, want) <= TOL[dtype]


def test_triton_split_count_rule(triton_ready):
    from sgl_spec.kernels.sparse_decode.triton_impl import MAX_SPLITS, auto_num_splits

    # B * Hkv = 3: 264 programs on 132 SMs wanted, a 128k context allows 1024 splits.
    assert auto_num_splits(3, 131072, 32, num_sms=132) == 88
    assert auto_num_splits(24, 131072, 32, num_sms=132) == 11
    assert auto_num_splits(264, 131072, 32, num_sms=132) == 1  # the one-pass kernel
    assert auto_num_splits(3072, 131072, 32, num_sms=132) == 1
    assert auto_num_splits(3, 400, 32, num_sms=132) == 3  # >= 4 blocks of 32 each
    assert auto_num_splits(3, 100, 32, num_sms=132) == 1
    assert auto_num_splits(1, 10**7, 16, num_sms=132) == MAX_SPLITS
    batch = make_batch(CASES[0], torch.float32)
    for bad in (0, MAX_SPLITS + 1):
        with pytest.raises(ValueError, match=r"num_splits must be None \(auto\) or in"):
            run_triton(batch, bad)


# ---------------------------------------------------------------- flashinfer


@pytest.mark.parametrize("case", CASES, ids=str)
def test_flashinfer_page_lists_match_reference(case):
    """The FlashInfer path's page layout, checked on CPU by attending each list in torch."""
    batch = make_batch(case, torch.float32, seed=2)
    hkv, g = case.num_kv_heads, case.group
    pages = build_pages(batch.subsets(), hkv)
    fill_selected(pages, batch.req_to_token, batch.sel_idx, hkv)
    k_pages = batch.k_buf.reshape(-1, batch.k_buf.shape[-1])  # [slots * Hkv, D]
    v_pages = batch.v_buf.reshape(-1, batch.v_buf.shape[-1])
    out = torch.empty_like(batch.q)
    for p in range(len(pages.indptr) - 1):
        b, h = divmod(p, hkv)
        ids = pages.indices[pages.indptr[p] : pages.indptr[p + 1]].long()
        qh = batch.q[b, h * g : (h + 1) * g]
        probs = torch.softmax(qh @ k_pages[ids].T * batch.scale, dim=-1)
        out[b, h * g : (h + 1) * g] = probs @ v_pages[ids]
    assert rel_err(out, reference(batch)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_flashinfer_matches_reference(case, dtype):
    pytest.importorskip("flashinfer")
    batch = make_batch(case, dtype, seed=3)
    out = run_impl(batch.to("cuda"), "flashinfer")
    assert rel_err(out, reference(batch)) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_flashinfer_plan_once_run_per_layer():
    pytest.importorskip("flashinfer")
    from sgl_spec.kernels.sparse_decode.flashinfer_impl import FlashInferSparseDecode

    case = CASES[2]
    layers = [make_batch(case, torch.bfloat16, seed=10, layer=i) for i in range(3)]
    # One layout and selection lengths (as the policies guarantee), per-layer
    # values and selections.
    for lb in layers[1:]:
        assert torch.equal(lb.sel_len, layers[0].sel_len)
        assert torch.equal(lb.req_to_token, layers[0].req_to_token)
        assert not torch.equal(lb.sel_idx, layers[0].sel_idx)
    runner = FlashInferSparseDecode("cuda")
    first = layers[0].to("cuda")
    runner.plan(
        first.subsets(), num_q_heads=first.q.shape[1],
        num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, scale=first.scale,
        q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
    )
    for lb in layers:
        gpu = lb.to("cuda")
        out = torch.empty_like(gpu.q)
        runner.run(gpu.q, gpu.k_buf, gpu.v_buf, gpu.sel_idx, out=out)
        assert rel_err(out, reference(lb)) <= 2e-2
