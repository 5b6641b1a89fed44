"""HiCache (``--enable-hierarchical-cache``) on hosts without CUDA.

Stock sglang 0.5.23 cannot build the host tier on CPU: the default host allocator
``cudaHostRegister``s the pool (``Torch not compiled with CUDA enabled``), and
``pool_host/mha.py`` binds its KV transfer ops from ``sgl_kernel.kvcacheio`` only on
CUDA/HIP/XPU. On a CPU host the "device" pool is ordinary memory too, so a
device<->host transfer is one index copy per layer; the ``direct`` I/O backend with
the ``layer_first`` host layout needs nothing else. The other I/O backends and
layouts need CUDA kernels (``kernel``) or a page-major copy we do not supply.

:mod:`.hooks` calls the ``patch_*``/``register_*`` functions
below right after the named sglang module executes, on CPU hosts only, with the
module object; each says in its docstring what it replaces and why:

* ``mem_cache.pool_host.common``: :func:`patch_pool_host_common` (allocation)
* ``mem_cache.pool_host.base``: :func:`patch_pool_host_base` (RAM reserve)
* ``mem_cache.pool_host.mha``: :func:`patch_pool_host_mha` (transfer ops)
* ``managers.cache_controller``: :func:`patch_cache_controller` (a check only)
* ``arg_groups.resolution_hooks``: :func:`register_cpu_hicache_defaults` (flags)

The cache controller needs no replacement: it takes its streams and events from
``sglang.srt.utils.get_device_module()``, which is ``torch.cpu`` here, whose
``Stream``/``Event`` are no-ops (``Event.query()`` is always True). That is exact,
not an approximation: on CPU every copy completes before ``submit_*`` returns.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

logger = logging.getLogger(__name__)

CPU_IO_BACKEND = "direct"
CPU_MEM_LAYOUT = "layer_first"
# sglang's own defaults (arg_groups/fields/memory.py); unusable on CPU, so they
# are read as "not chosen" and replaced by the CPU pair.
_STOCK_IO_BACKEND = "kernel"
_STOCK_MEM_LAYOUT = "page_first"
_VALID_FLAGS = (
    f"--hicache-io-backend {CPU_IO_BACKEND} --hicache-mem-layout {CPU_MEM_LAYOUT}"
)

# The names pool_host/mha.py binds from sgl_kernel.kvcacheio on CUDA/HIP/XPU.
_MHA_KVCACHEIO_OPS = (
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
)


# ---------------------------------------------------------------------------
# Pure helpers (no sglang imports; unit-tested without a server)
# ---------------------------------------------------------------------------


def resolve_cpu_hicache_io(io_backend: str, mem_layout: str) -> tuple[str, str]:
    """The (io backend, host layout) pair HiCache uses on CPU for the given flags.

    sglang's defaults (``kernel``, ``page_first``) are replaced by ``direct`` and
    ``layer_first``: the kernel backend needs CUDA kernels, and page-major host
    layouts need copies this CPU port does not provide. Any other choice raises a
    ``ValueError`` naming the valid flags.
    """
    io = CPU_IO_BACKEND if io_backend == _STOCK_IO_BACKEND else io_backend
    layout = CPU_MEM_LAYOUT if mem_layout == _STOCK_MEM_LAYOUT else mem_layout
    if (io, layout) != (CPU_IO_BACKEND, CPU_MEM_LAYOUT):
        raise _unsupported(io_backend, mem_layout)
    return io, layout


def check_cpu_hicache_io(io_backend: str, mem_layout: str, context: str = "") -> None:
    """Raise ``ValueError`` unless the pair is the one HiCache supports on CPU."""
    if (io_backend, mem_layout) != (CPU_IO_BACKEND, CPU_MEM_LAYOUT):
        raise _unsupported(io_backend, mem_layout, context)


def _unsupported(io_backend: str, mem_layout: str, context: str = "") -> ValueError:
    return ValueError(
        f"HiCache on CPU supports only {_VALID_FLAGS} (the defaults on CPU); got "
        f"--hicache-io-backend {io_backend} --hicache-mem-layout {mem_layout}"
        f"{context}. The 'kernel' and 'kernel_ascend' backends need CUDA/NPU "
        "kernels, and page-major host layouts have no CPU copy."
    )


def transfer_kv_direct(
    src_layers: list[torch.Tensor],  # per layer [src_slots, head_num, head_dim]
    dst_layers: list[torch.Tensor],  # per layer [dst_slots, head_num, head_dim]
    src_indices: torch.Tensor,  # [n] int, CPU; slots read in every src layer
    dst_indices: torch.Tensor,  # [n] int, CPU; slots written in every dst layer
    page_size: int,
) -> None:
    """``dst_layers[i][dst_indices] = src_layers[i][src_indices]`` for every ``i``.

    The CPU stand-in for ``sgl_kernel.kvcacheio.transfer_kv_direct`` (the CUDA op
    copies the same rows page by page). Mutates ``dst_layers`` in place; reads and
    writes memory the device and host pools own. Slot ids are whole pages, so
    ``n`` is a multiple of ``page_size``. Layers must share dtype and row shape.
    """
    if len(src_layers) != len(dst_layers):
        raise ValueError(
            f"transfer_kv_direct: {len(src_layers)} source layers but "
            f"{len(dst_layers)} destination layers"
        )
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(
            f"transfer_kv_direct: {src_indices.numel()} source slots but "
            f"{dst_indices.numel()} destination slots"
        )
    if page_size <= 0 or src_indices.numel() % page_size:
        raise ValueError(
            f"transfer_kv_direct: {src_indices.numel()} slots is not a whole "
            f"number of pages of {page_size}"
        )
    if src_indices.numel() == 0:
        return
    src_idx = src_indices.to(device="cpu", dtype=torch.int64)
    dst_idx = dst_indices.to(device="cpu", dtype=torch.int64)
    for src, dst in zip(src_layers, dst_layers):
        dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))


def alloc_host_buffer_cpu(
    dims: tuple,
    dtype: torch.dtype,
    device: str,
    pin_memory: bool,
    allocator,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    """A host-pool buffer from the pool's allocator, never page-locked.

    Same signature as the entries of ``pool_host.common.ALLOC_MEMORY_FUNCS``.
    ``pin_memory`` and ``registration_granularity_bytes`` only matter for DMA from
    an accelerator, which a CPU host has none of; the buffer is owned by the
    returned tensor (the allocator's mmap/shm is released with it).
    """
    del pin_memory, registration_granularity_bytes
    if allocator is None:
        return torch.empty(dims, dtype=dtype, device=device)
    return allocator.allocate(dims, dtype=dtype, device=device)


def cpu_host_memory_reserve_bytes(total_bytes: int) -> int:
    """Host RAM HiCache leaves free on a CPU host: a tenth of RAM, at most 10 GiB.

    sglang reserves a flat 10 GiB, sized for GPU servers with hundreds of GB of
    RAM. On a CPU host the model and the device KV pool already live in that RAM
    (and are counted as used when the host pool is sized), so a flat 10 GiB on a
    24 GB machine refuses any host pool once other processes hold a few GB.
    """
    if total_bytes <= 0:
        raise ValueError(f"total host memory must be positive, got {total_bytes}")
    return min(10 * 1024**3, total_bytes // 10)


def _unavailable_on_cpu(name: str) -> Callable[..., None]:
    def _raise(*args, **kwargs):
        raise RuntimeError(
            f"HiCache transfer op {name} needs CUDA kernels; on CPU launch with "
            f"{_VALID_FLAGS}."
        )

    _raise.__name__ = name
    return _raise


# ---------------------------------------------------------------------------
# Patches applied by the import hooks (CPU hosts only)
# ---------------------------------------------------------------------------


def patch_pool_host_common(module) -> None:
    """Give every host pool a plain (unregistered) allocation function.

    ``ALLOC_MEMORY_FUNCS`` is a defaultdict keyed by the device type of the pool;
    the default, ``alloc_with_host_register``, calls ``torch.cuda.cudart()`` to
    ``cudaHostRegister`` the buffer and fails without CUDA. On a CPU host every
    pool is a CPU pool, so both the ``"cpu"`` entry and the default factory (some
    pools index the table by a ``torch.device`` or a device string) become
    :func:`alloc_host_buffer_cpu`.
    """
    table = module.ALLOC_MEMORY_FUNCS
    table.default_factory = lambda: alloc_host_buffer_cpu
    table["cpu"] = alloc_host_buffer_cpu


def patch_pool_host_base(module) -> None:
    """Scale ``HICACHE_HOST_MEMORY_RESERVE_BYTES`` to this machine's RAM.

    ``host_memory_budget_bytes`` (explicit sizing) and the auto-sizing in
    ``hicache_auto_size`` subtract this module global, read at call time, from the
    available host memory; see :func:`cpu_host_memory_reserve_bytes` for why the
    stock 10 GiB is replaced on CPU hosts.
    """
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    module.HICACHE_HOST_MEMORY_RESERVE_BYTES = cpu_host_memory_reserve_bytes(total)


def patch_pool_host_mha(module) -> None:
    """Bind the KV transfer ops ``pool_host/mha.py`` leaves unbound on CPU.

    The module imports them from ``sgl_kernel.kvcacheio`` only on CUDA/HIP and from
    the XPU wheel on XPU; on CPU the names are missing and the first transfer
    raises ``NameError``. ``transfer_kv_direct`` (the ``direct`` backend with the
    ``layer_first`` layout) becomes :func:`transfer_kv_direct`; every other op
    raises an error naming the flags that work on CPU.
    """
    for name in _MHA_KVCACHEIO_OPS:
        if hasattr(module, name):
            continue  # a real kernel is bound: leave it
        op = transfer_kv_direct if name == "transfer_kv_direct" else None
        setattr(module, name, op or _unavailable_on_cpu(name))
    # Storage pages (an L3 backend such as ``file``) are read into fresh host tensors made
    # with the pool's ``pin_memory`` (True by default), which torch refuses without an
    # accelerator: such pools stop asking for pinned memory once built.
    for cls in (module.MHATokenToKVPoolHost, module.MHATokenToKOnlyPoolHost):
        if getattr(cls, "_sgl_spec_unpinned", False):
            continue
        init = cls.__init__

        def __init__(self, *args, _init=init, **kwargs):
            _init(self, *args, **kwargs)
            if not torch.cuda.is_available():
                self.pin_memory = False

        cls.__init__ = __init__
        cls._sgl_spec_unpinned = True


def patch_cache_controller(module) -> None:
    """Check that the controller's streams and events are torch.cpu's no-ops.

    ``cache_controller`` (and ``l2_transfer``, which it drives) create
    ``device_module.Stream()``/``Event()`` and call ``record``/``wait``/``query``/
    ``wait_stream`` unconditionally. ``device_module`` is
    ``get_device_module()``, which is ``torch.cpu`` on a host without an
    accelerator, whose stream and event are no-ops: right on CPU, where each copy
    has finished when the call that issues it returns. Nothing to replace; fail
    loudly if a later sglang resolves it to something else.
    """
    if module.device_module is not torch.cpu:
        raise RuntimeError(
            "sgl_spec HiCache on CPU expects cache_controller.device_module to be "
            f"torch.cpu, found {module.device_module.__name__}"
        )


def register_cpu_hicache_defaults(module) -> None:
    """Resolve the HiCache I/O flags for CPU before sglang's own HiCache step.

    Wraps the ``handle_hicache`` step of the argument-resolution pipeline through
    sglang's ``register_resolution_hook`` (``module`` is
    ``sglang.srt.arg_groups.resolution_hooks``): when HiCache is on, sglang's
    defaults become ``direct``/``layer_first`` and any other choice is rejected
    with a ``ValueError`` naming the valid flags. After the stock step (which may
    rewrite the layout for a storage backend) the result is checked again.
    """
    if _resolve_hicache_on_cpu in module._HOOKS.get("handle_hicache", ()):
        return  # already registered in this process
    module.register_resolution_hook("handle_hicache")(_resolve_hicache_on_cpu)


def _resolve_hicache_on_cpu(server_args, previous) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    if not cfg.enable_hierarchical_cache:
        previous(server_args)
        return
    asked = (cfg.hicache_io_backend, cfg.hicache_mem_layout)
    io, layout = resolve_cpu_hicache_io(*asked)
    if (io, layout) != asked:
        logger.info(
            "HiCache on CPU: using --hicache-io-backend %s --hicache-mem-layout %s "
            "(was %s %s; the stock defaults need CUDA kernels)",
            io,
            layout,
            *asked,
        )
        declare_resolution(
            server_args,
            "sgl_spec.integration.tiers.hicache_cpu",
            hicache_io_backend=io,
            hicache_mem_layout=layout,
        )
    previous(server_args)
    check_cpu_hicache_io(
        cfg.hicache_io_backend,
        cfg.hicache_mem_layout,
        context=" after sglang's HiCache resolution (a storage backend such as "
        "mooncake asks for a page-major layout)",
    )
