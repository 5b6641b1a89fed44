"""Cache-aware DP dispatch: a conversation's later turns go to the rank holding its prefix.

sglang 0.5.23's DP controller sends requests to ranks round robin (or by load), blind to
the prompt, so under ``--dp-size 2`` a conversation's turns alternate between ranks and
half of its follow-ups find no cached history (docs/cpu.md, Scale-out). Here the
controller remembers, per rank, chained
hashes of the ``BLOCK``-token blocks of the prompts it sent there (an LRU of at most
``MAX_BLOCKS`` per rank) and sends a request to the rank that was sent the longest prefix
of its prompt, if that covers at least ``MIN_SHARE`` of its whole blocks; otherwise round
robin, as sglang would (sglang-router's ``cache_aware`` policy, inside one server).

Explicitly routed requests (``routed_dp_rank``: sglang-router's ``--dp-aware``) and the
other load-balance methods are left to sglang. Only the controller's thread calls it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

logger = logging.getLogger(__name__)

BLOCK = 32  # tokens per hashed block
MAX_BLOCKS = 1 << 18  # per rank (8M tokens of prompts)
MIN_SHARE = 0.5  # of the prompt's whole blocks a rank must have been sent


def block_hashes(ids: Sequence[int], block: int = BLOCK) -> list[int]:
    """Chained hashes of the whole ``block``-token blocks of ``ids`` (prefix i+1 blocks)."""
    out, h = [], 0
    for start in range(0, len(ids) - block + 1, block):
        h = hash((h, tuple(ids[start:start + block])))
        out.append(h)
    return out


class PrefixIndex:
    """Per rank, the block hashes of the prompts sent there, least recently sent first."""

    def __init__(self, ranks: int, max_blocks: int = MAX_BLOCKS):
        self.max_blocks = max_blocks
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(ranks)]
        self._next = 0

    def choose(self, ids: Sequence[int], usable: Sequence[int]) -> int:
        """The rank for a prompt ``ids`` among ``usable`` (non-empty), and record it there."""
        hashes = block_hashes(ids)
        best, best_len = None, 0
        for rank in usable:
            n = _matched(self._blocks[rank], hashes)
            if n > best_len:
                best, best_len = rank, n
        if best is None or best_len < MIN_SHARE * len(hashes):
            best = usable[self._next % len(usable)]
            self._next += 1
        self._record(best, hashes)
        return best

    def _record(self, rank: int, hashes: list[int]) -> None:
        kept = self._blocks[rank]
        for h in reversed(hashes):  # a prefix's blocks are younger than what follows them
            kept[h] = None
            kept.move_to_end(h)
        while len(kept) > self.max_blocks:
            kept.popitem(last=False)


def _matched(kept: OrderedDict[int, None], hashes: list[int]) -> int:
    """How many leading blocks of ``hashes`` ``kept`` holds (binary search: a chained
    hash is present only if the prefix before it was sent too, LRU aside)."""
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in kept:
            lo = mid
        else:
            hi = mid - 1
    return lo


def patch_controller(module) -> None:
    """Wrap ``module.DataParallelController.__init__`` (``sglang.srt.managers.
    data_parallel_controller``): with sgl_spec's config asking for it and sglang's
    round-robin method, its ``dispatching`` becomes the cache-aware one. Idempotent."""
    cls = module.DataParallelController
    if getattr(cls.__init__, "_sgl_spec", False):
        return
    orig_init = cls.__init__
    sock_send = module.sock_send

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        if self.load_balance_method != module.LoadBalanceMethod.ROUND_ROBIN or not _wanted():
            return
        index = PrefixIndex(len(self.workers))

        def dispatching(req) -> None:
            if self.maybe_external_dp_rank_routing(req):
                return
            usable = [r for r in self._active_workers if self.status[r]]
            if not usable:
                raise RuntimeError("Cannot route request: no active DP worker is available.")
            sock_send(self.workers[index.choose(req.input_ids or (), usable)], req)

        self.dispatching = dispatching
        logger.info("sgl_spec: cache-aware DP dispatch over %d ranks", len(self.workers))

    __init__._sgl_spec = True
    cls.__init__ = __init__


def _wanted() -> bool:
    from sgl_spec import envs
    from sgl_spec.config import SpecConfig

    text = envs.spec_config_json()
    if not text:
        return False  # not launched by sgl_spec (stock sglang in this environment)
    cfg = SpecConfig.from_json(text)
    return not cfg.disable and cfg.cache.dp_dispatch == "cache_aware"
