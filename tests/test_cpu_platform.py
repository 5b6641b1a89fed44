"""CPU platform support: the sgl_kernel shim, the import hooks and their gate, the
.pth file."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig

import pytest
import torch

from sgl_spec.boot import cuda_host
from sgl_spec.integration.cpu import sgl_kernel_shim as shim

pytestmark = pytest.mark.skipif(cuda_host(), reason="CPU-host support only")


def _assign_reference(req_pool_indices, req_to_token, start, end, out_cache_loc):
    offset = 0
    for row, s, e in zip(req_pool_indices.tolist(), start.tolist(), end.tolist()):
        req_to_token[row, s:e] = out_cache_loc[offset : offset + e - s]
        offset += e - s


@pytest.mark.parametrize(
    "lens",
    [[(0, 5)], [(3, 4), (0, 7), (10, 10)], [(2, 9), (5, 6), (0, 1), (1, 3)]],
    ids=["one", "ragged-with-empty", "four"],
)
def test_assign_req_to_token_pool_matches_reference(lens):
    gen = torch.Generator().manual_seed(0)
    rows = torch.randperm(8, generator=gen)[: len(lens)]
    start = torch.tensor([s for s, _ in lens])
    end = torch.tensor([e for _, e in lens])
    total = int((end - start).sum())
    locs = torch.randint(0, 1000, (total + 3,), generator=gen)  # extra tail is ignored
    got = torch.full((8, 16), -1, dtype=torch.int32)
    want = got.clone()
    shim.assign_req_to_token_pool_cpu(rows, got, start, end, locs, 16)
    _assign_reference(rows, want, start, end, locs)
    assert torch.equal(got, want)


def test_assign_rejects_offsets_past_the_pool():
    with pytest.raises(ValueError, match="exceeds"):
        shim.assign_req_to_token_pool_cpu(
            torch.tensor([0]), torch.zeros(1, 4, dtype=torch.int32),
            torch.tensor([2]), torch.tensor([6]), torch.arange(4), 4,
        )


def test_copy_all_layer_kv_cache_copies_rows_in_every_buffer():
    bufs = [torch.randn(10, 3, 4), torch.randn(10, 6).to(torch.bfloat16)]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs])
    tgt, src = torch.tensor([1, 7, 4]), torch.tensor([2, 2, 9])
    shim.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for got, old in zip(bufs, before):
        want = old.clone()
        want[tgt] = old[src]
        assert torch.equal(got, want)


def test_other_sgl_kernel_names_fail_only_when_called():
    import sgl_kernel

    fn = sgl_kernel.verify_tree_greedy_cpu  # module-level imports of it must work
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu"):
        fn()
    assert not hasattr(sgl_kernel, "__path__")


def test_hooks_reach_a_fresh_interpreter():
    """sgl_kernel, torchvision and SGLANG_USE_CPU_ENGINE in a new process (as sglang's
    spawned scheduler would be), without importing sgl_spec explicitly."""
    code = (
        "import os, sgl_kernel, torchvision;"
        "print(os.environ['SGLANG_USE_CPU_ENGINE']);"
        "print(sgl_kernel.__file__);"
        "import torchvision.transforms"
    )
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/",
        check=True,
    ).stdout.split()
    assert out[0] == "1"
    assert out[1].endswith(os.path.join("sgl_spec", "integration", "cpu", "sgl_kernel_shim.py"))


def test_interpreter_start_imports_nothing_heavy():
    """The .pth gate costs every Python process of the environment a few imports:
    neither sglang, torch, numpy nor importlib.metadata until sglang is imported."""
    code = ("import sys; heavy = ('sglang', 'torch', 'numpy', 'importlib.metadata', "
            "'sgl_spec.integration'); print([m for m in heavy if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/", check=True).stdout.strip()
    assert out == "[]"


def test_pth_file_is_part_of_the_installed_distribution():
    site = sysconfig.get_paths()["purelib"]
    (dist,) = [
        d for d in importlib.metadata.distributions(path=[site])
        if d.metadata["Name"] == "sgl_spec"
    ]
    files = [str(f) for f in dist.files]
    assert "sgl_spec_cpu.pth" in files  # so `pip uninstall sgl_spec` removes it
    with open(os.path.join(site, "sgl_spec_cpu.pth")) as f:
        assert f.read().strip() == "import sgl_spec.boot"


def test_frontend_gets_chatml_for_the_default_model():
    from sglang.lang.chat_template import get_chat_template_by_model_path

    from sgl_spec.prepare_model import model_dir

    assert get_chat_template_by_model_path(model_dir()).name == "chatml"
