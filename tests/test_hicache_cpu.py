"""HiCache (--enable-hierarchical-cache) on CPU: the pure helpers, then a real server.

The server test starts stock ``python -m sglang.launch_server`` (sgl_spec's CPU
patches reach it through the ``.pth`` import hook), fills the small device pool
with a second long prompt so that the first one is evicted to the host tier, and
asserts that the re-request is served from the host with identical output.
"""

from __future__ import annotations

import inspect
import os
import time

import pytest
import requests
import torch

from conftest import EARLY_SERVERS, Early, early_server
from sgl_spec.bench.server import STOCK, tail
from sgl_spec import boot
from sgl_spec.integration.tiers.hicache_cpu import (
    alloc_host_buffer_cpu,
    check_cpu_hicache_io,
    cpu_host_memory_reserve_bytes,
    resolve_cpu_hicache_io,
    transfer_kv_direct,
)

VALID = "--hicache-io-backend direct --hicache-mem-layout layer_first"
cpu_only = pytest.mark.skipif(boot.cuda_host(), reason="CPU-host patches only")


# ---------------------------------------------------------------------------
# Flag resolution
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        (("kernel", "page_first"), ("direct", "layer_first")),  # stock defaults
        (("direct", "page_first"), ("direct", "layer_first")),
        (("kernel", "layer_first"), ("direct", "layer_first")),
        (("direct", "layer_first"), ("direct", "layer_first")),
    ],
    ids=["stock-defaults", "direct+stock-layout", "stock-io+layer_first", "cpu-pair"],
)
def test_resolve_defaults_to_cpu_pair(asked, expected):
    assert resolve_cpu_hicache_io(*asked) == expected


@pytest.mark.parametrize(
    "asked",
    [
        ("kernel_ascend", "layer_first"),
        ("direct", "page_first_direct"),
        ("direct", "page_head"),
        ("kernel", "page_first_kv_split"),
    ],
    ids=lambda pair: "+".join(pair),
)
def test_resolve_rejects_with_valid_flags(asked):
    with pytest.raises(ValueError) as err:
        resolve_cpu_hicache_io(*asked)
    assert VALID in str(err.value)
    assert asked[0] in str(err.value) and asked[1] in str(err.value)


def test_check_accepts_only_cpu_pair():
    check_cpu_hicache_io("direct", "layer_first")
    with pytest.raises(ValueError, match="layer_first"):
        check_cpu_hicache_io("direct", "page_first_direct")


def test_resolve_error_names_the_flags_as_given():
    asked = "--hicache-io-backend kernel --hicache-mem-layout page_head"
    with pytest.raises(ValueError, match=asked):
        resolve_cpu_hicache_io("kernel", "page_head")


def _base_args(model_path: str) -> list[str]:
    return ["--model-path", model_path, "--device", "cpu"]


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--enable-hierarchical-cache"], ("direct", "layer_first")),
        (
            ["--enable-hierarchical-cache", "--hicache-io-backend", "direct"],
            ("direct", "layer_first"),
        ),
        ([], ("kernel", "page_first")),  # HiCache off: flags left alone
    ],
    ids=["hicache-defaults", "hicache-direct-only", "hicache-off"],
)
def test_server_args_resolution_on_cpu(extra, expected, model_path):
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(_base_args(model_path) + extra)
    args.resolve_once()
    fields = ("hicache_io_backend", "hicache_mem_layout")
    assert tuple(resolution_result(args, f) for f in fields) == expected


@cpu_only
@pytest.mark.slow
def test_server_args_resolution_rejects_page_head_on_cpu(model_path):
    from sglang.srt.server_args import prepare_server_args

    hicache = ["--enable-hierarchical-cache", "--hicache-mem-layout", "page_head"]
    args = prepare_server_args(_base_args(model_path) + hicache)
    with pytest.raises(ValueError, match=VALID):
        args.resolve_once()


# ---------------------------------------------------------------------------
# transfer_kv_direct against a per-slot reference
# ---------------------------------------------------------------------------


def _reference_transfer(src_layers, dst_layers, src_indices, dst_indices):
    for src, dst in zip(src_layers, dst_layers):
        for s, d in zip(src_indices.tolist(), dst_indices.tolist()):
            dst[d] = src[s]


@pytest.mark.parametrize("page_size", [1, 4], ids=["page1", "page4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_transfer_kv_direct_matches_reference(page_size, dtype):
    gen = torch.Generator().manual_seed(0)
    num_layers, src_slots, dst_slots, heads, dim = 3, 64, 48, 3, 8
    src = [
        torch.randn(src_slots, heads, dim, generator=gen).to(dtype)
        for _ in range(num_layers)
    ]
    # NaN-poisoned destination: rows the copy does not target must stay NaN.
    nan = float("nan")
    dst = [torch.full((dst_slots, heads, dim), nan, dtype=dtype) for _ in src]
    expected = [d.clone() for d in dst]
    src_pages = torch.randperm(src_slots // page_size, generator=gen)[:5]
    dst_pages = torch.randperm(dst_slots // page_size, generator=gen)[:5]
    offsets = torch.arange(page_size)
    src_idx = (src_pages[:, None] * page_size + offsets).reshape(-1)
    dst_idx = (dst_pages[:, None] * page_size + offsets).reshape(-1)

    transfer_kv_direct(src, dst, src_idx, dst_idx, page_size)
    _reference_transfer(src, expected, src_idx, dst_idx)

    for got, want in zip(dst, expected):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    untouched = torch.ones(dst_slots, dtype=torch.bool)
    untouched[dst_idx] = False
    assert dst[0][untouched].isnan().all()


def test_transfer_kv_direct_copies_into_strided_views():
    # The host pool passes per-layer views of one [2, layers, slots, ...] buffer.
    host = torch.zeros(2, 2, 16, 1, 4)
    device = [torch.arange(64.0).view(16, 1, 4) + 100 * i for i in range(4)]
    dst = [host[0, 0], host[0, 1], host[1, 0], host[1, 1]]
    transfer_kv_direct(device, dst, torch.tensor([3, 5]), torch.tensor([0, 9]), 1)
    assert torch.equal(host[1, 1, 9], device[3][5])
    assert torch.equal(host[0, 0, 0], device[0][3])
    assert host[0, 0, 1:9].abs().sum() == 0


def test_transfer_kv_direct_empty_is_noop():
    dst = [torch.zeros(4, 1, 2)]
    empty = torch.empty(0, dtype=torch.int64)
    transfer_kv_direct([torch.ones(4, 1, 2)], dst, empty, empty, 1)
    assert dst[0].sum() == 0


@pytest.mark.parametrize(
    ("n_src_layers", "src_idx", "dst_idx", "page_size", "match"),
    [
        (2, [0], [0], 1, "layers"),
        (1, [0, 1], [0], 1, "slots"),
        (1, [0, 1, 2], [0, 1, 2], 2, "pages"),
    ],
    ids=["layer-count", "slot-count", "partial-page"],
)
def test_transfer_kv_direct_rejects_bad_arguments(
    n_src_layers, src_idx, dst_idx, page_size, match
):
    src = [torch.ones(4, 1, 2)] * n_src_layers
    with pytest.raises(ValueError, match=match):
        transfer_kv_direct(
            src,
            [torch.zeros(4, 1, 2)],
            torch.tensor(src_idx),
            torch.tensor(dst_idx),
            page_size,
        )


# ---------------------------------------------------------------------------
# Host allocation and the applied patches (in this process, via the .pth hook)
# ---------------------------------------------------------------------------


class _RecordingAllocator:
    def __init__(self):
        self.calls = []

    def allocate(self, dims, dtype, device):
        self.calls.append((dims, dtype, device))
        return torch.zeros(dims, dtype=dtype)


def test_alloc_host_buffer_cpu_uses_the_pool_allocator_without_pinning():
    allocator = _RecordingAllocator()
    buf = alloc_host_buffer_cpu(
        (2, 3, 8, 1, 4), torch.bfloat16, "cpu", pin_memory=True, allocator=allocator
    )
    assert allocator.calls == [((2, 3, 8, 1, 4), torch.bfloat16, "cpu")]
    assert buf.shape == (2, 3, 8, 1, 4) and buf.dtype == torch.bfloat16
    assert not buf.is_pinned()


GIB = 1024**3


@pytest.mark.parametrize(
    ("total", "reserve"),
    [(24 * GIB, 24 * GIB // 10), (64 * GIB, 64 * GIB // 10), (512 * GIB, 10 * GIB)],
    ids=["24GiB", "64GiB", "512GiB-capped"],
)
def test_cpu_host_memory_reserve(total, reserve):
    assert cpu_host_memory_reserve_bytes(total) == reserve


def test_cpu_host_memory_reserve_rejects_nonpositive():
    with pytest.raises(ValueError, match="positive"):
        cpu_host_memory_reserve_bytes(0)


@cpu_only
def test_host_pool_modules_are_patched():
    from sglang.srt.mem_cache.pool_host import base, common, mha

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    reserve = base.HICACHE_HOST_MEMORY_RESERVE_BYTES
    assert reserve == cpu_host_memory_reserve_bytes(total) <= 10 * GIB

    assert common.ALLOC_MEMORY_FUNCS["cpu"] is alloc_host_buffer_cpu
    # Pools that key the table by a torch.device get the same function.
    assert common.ALLOC_MEMORY_FUNCS[torch.device("cpu")] is alloc_host_buffer_cpu
    buf = common.ALLOC_MEMORY_FUNCS["cpu"](
        (2, 2, 8, 1, 4),
        dtype=torch.bfloat16,
        device="cpu",
        pin_memory=True,
        allocator=common.HostTensorAllocator(),
    )
    assert buf.shape == (2, 2, 8, 1, 4)
    buf.fill_(1)  # mmap-backed and writable
    assert mha.transfer_kv_direct is transfer_kv_direct
    with pytest.raises(RuntimeError, match=VALID):
        mha.transfer_kv_per_layer()


# ---------------------------------------------------------------------------
# Real server: evict to host, restore, same output
# ---------------------------------------------------------------------------

PROMPT_TOKENS = 900
MAX_NEW_TOKENS = 8


def _docstrings(module) -> str:
    parts = [inspect.getdoc(module) or ""]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            parts.append(f"{name}: {inspect.getdoc(obj) or ''}")
    return "\n\n".join(parts)


def _chat_prompt(module, tokenizer) -> str:
    ids = tokenizer.encode(_docstrings(module))
    assert len(ids) >= PROMPT_TOKENS, f"{module.__name__} docstrings too short"
    body = tokenizer.decode(ids[:PROMPT_TOKENS])
    return (
        f"<|im_start|>user\n{body}\n\nSummarize the text above in one sentence."
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def _generate(url: str, text: str) -> tuple[str, dict, float]:
    body = {
        "text": text,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS},
    }
    start = time.perf_counter()
    resp = requests.post(f"{url}/generate", json=body, timeout=300)
    resp.raise_for_status()
    out = resp.json()
    return out["text"], out["meta_info"], time.perf_counter() - start


def _hicache_flags(model_path: str) -> list[str]:
    return [
        "--model-path", model_path,
        "--device", "cpu",
        "--attention-backend", "torch_native",
        # Room for one 900-token request: the next one evicts it to the host.
        "--max-total-tokens", "1200",
        "--enable-hierarchical-cache",
        "--hicache-io-backend", "direct",
        "--hicache-mem-layout", "layer_first",
        "--hicache-ratio", "2",
        "--enable-cache-report",
        "--sleep-on-idle",
    ]  # fmt: skip


if not boot.cuda_host():  # launched early (conftest), with the session's servers
    EARLY_SERVERS["hicache_server"] = Early(STOCK, _hicache_flags, host_tier=True)


@pytest.fixture(scope="module")
def hicache_server(model_path):
    yield from early_server("hicache_server", model_path)


@pytest.mark.server
@pytest.mark.slow
@cpu_only
def test_evicted_prompt_is_restored_from_host(hicache_server, model_path):
    import argparse
    import logging

    from transformers import AutoTokenizer

    url, log_path = hicache_server.url, hicache_server.log_path
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    first_prompt = _chat_prompt(argparse, tokenizer)
    evicting_prompt = _chat_prompt(logging, tokenizer)

    first_text, first_meta, recompute_s = _generate(url, first_prompt)
    assert first_meta["cached_tokens"] < 16, first_meta  # cold: nothing cached
    # 1200 slots cannot hold both: the first prompt's KV leaves the device pool
    # (write-through already copied it to the host pool).
    _, evict_meta, _ = _generate(url, evicting_prompt)
    assert evict_meta["cached_tokens"] < 16, evict_meta

    again_text, again_meta, restore_s = _generate(url, first_prompt)
    log_tail = tail(log_path)
    assert again_meta["cached_tokens"] > PROMPT_TOKENS // 2, (again_meta, log_tail)
    details = again_meta.get("cached_tokens_details") or {}
    assert details.get("host", 0) > PROMPT_TOKENS // 2, (again_meta, log_tail)
    assert again_text == first_text
    print(
        f"recompute {recompute_s:.2f} s, restore from host {restore_s:.2f} s, "
        f"cached {again_meta['cached_tokens']} ({details})"
    )
