"""Per-rank CPU groups for ``--dp-size``/``--tp-size``/``--pp-size`` > 1 on CPU hosts.

sglang 0.5.23 gives each CPU rank one NUMA node unless ``SGLANG_CPU_OMP_THREADS_BIND``
names a core group per rank, and asserts ``ranks <= NUMA nodes`` otherwise
(``utils/numa_utils.py::init_threads_binding``): on a one-node machine ``--dp-size 2``
dies in every scheduler with ``AssertionError: SGLANG_CPU_OMP_THREADS_BIND is not
set ...``. The launcher fills the variable in, where the user did not, by splitting
the node's cores evenly (the value sglang's message suggests). On CPUs without AMX
(or arm64) sglang reads the groups only for that check and binds no threads; with AMX
each rank's OpenMP threads are bound to its group.
"""

from __future__ import annotations

import logging
import os

from sgl_spec import envs

logger = logging.getLogger(__name__)


def _span(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (sglang's group syntax)."""
    parts, start = [], 0
    for i in range(1, len(cpus) + 1):
        if i == len(cpus) or cpus[i] != cpus[i - 1] + 1:
            lo, hi = cpus[start], cpus[i - 1]
            parts.append(str(lo) if lo == hi else f"{lo}-{hi}")
            start = i
    return ",".join(parts)


def bind_groups(cpus_by_node: list[list[int]], ranks: int) -> str | None:
    """The ``SGLANG_CPU_OMP_THREADS_BIND`` value giving ``ranks`` processes disjoint,
    equal groups of cores (node by node, in order), or None where sglang's default
    already works (``ranks <= nodes``) or where there are fewer cores than ranks (then
    sglang's own assertion names the variable)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if ranks <= len(cpus_by_node):
        return None
    cpus = [c for node in cpus_by_node for c in sorted(node)]
    per = len(cpus) // ranks
    if per == 0:
        return None
    return "|".join(_span(cpus[r * per:(r + 1) * per]) for r in range(ranks))


def ranks_in(argv: list[str]) -> int:
    """Scheduler processes a server argv starts: dp x tp x pp (sglang's world size for
    thread binding; attention DP partitions the TP group and adds none)."""
    from sgl_spec.launch_server import _value

    size = 1
    for options in (("--dp-size", "--dp"), ("--tp-size", "--tp"), ("--pp-size", "--pp")):
        size *= int(_value(argv, *options) or 1)
    return size


def set_default_bind(argv: list[str]) -> str | None:
    """Set ``SGLANG_CPU_OMP_THREADS_BIND`` for ``argv``'s ranks where the user did not
    (the spawned schedulers inherit it); returns the value set, or None."""
    if os.environ.get(envs.SGLANG_CPU_OMP_THREADS_BIND):
        return None
    ranks = ranks_in(argv)
    if ranks == 1:
        return None
    from sglang.srt.utils.common import get_cpu_ids_by_node

    nodes = [[int(c) for c in node.split(",")] for node in get_cpu_ids_by_node()]
    value = bind_groups(nodes, ranks)
    if value is not None:
        os.environ[envs.SGLANG_CPU_OMP_THREADS_BIND] = value
        logger.info("%d CPU ranks on %d NUMA node(s): %s=%s", ranks, len(nodes),
                    envs.SGLANG_CPU_OMP_THREADS_BIND, value)
    return value
