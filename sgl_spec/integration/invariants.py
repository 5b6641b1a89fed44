"""``--spec-check-invariants``: the KV-slot and per-request invariants, checked by the
scheduler while it serves.

sglang's own checker (``SchedulerInvariantChecker``) counts slots: free + tree +
requests' own = pool. Counts cannot see a slot that is both free and in the tree (the
wrong answer of an overwritten prefix), so this adds, at the same points:

* after every scheduler step (sglang's busy check, which the launcher turns on with
  ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY``): ``slot_violations`` over the
  allocator's free list, the tree's device slots and the running requests' rows;
* when the scheduler goes idle (no request running or waiting): the same, and every
  per-request structure of sgl_spec (the request hub's ``live()``) must be empty.

A violation is logged as an error with what broke and counted in the radix cache's
``InvariantLog`` (sgl_spec's cache builds one under the flag); ``GET /sgl_spec/cache``
serves the counts and the first messages (``invariants``). It does not stop the
server: a test or the soak harness reads the endpoint.
"""

from __future__ import annotations

import logging

import torch

from sgl_spec.cache.invariants import Owner, slot_violations
from sgl_spec.config import current

logger = logging.getLogger(__name__)

KEPT = 20  # messages kept for the endpoint


class InvariantLog:
    """What the checks found in one scheduler's cache (written by the scheduler thread)."""

    def __init__(self):
        self.checks = 0
        self.idle_checks = 0
        self.violations = 0
        self.messages: list[str] = []

    def record(self, where: str, found: list[str]) -> None:
        if not found:
            return
        self.violations += len(found)
        for msg in found:
            logger.error("sgl_spec invariant broken (%s): %s", where, msg)
            if len(self.messages) < KEPT:
                self.messages.append(f"{where}: {msg}")

    def as_dict(self) -> dict:
        return {"checks": self.checks, "idle_checks": self.idle_checks,
                "violations": self.violations, "messages": list(self.messages)}


def free_slots(allocator) -> torch.Tensor:
    """[F] int64 slots the allocator would hand out (its free and release lists)."""
    pages = allocator.get_all_free_pages()
    if pages is None:
        return torch.empty(0, dtype=torch.int64)
    ps = allocator.page_size
    if ps == 1:
        return pages.long()
    return (pages.long()[:, None] * ps + torch.arange(ps, device=pages.device)).flatten()


def owners(checker) -> list[Owner]:
    rows = checker.req_to_token_pool.req_to_token
    out = []
    for req in checker._requests_owning_rows():
        kv = req.kv
        row = rows[kv.req_pool_idx]
        out.append(Owner(req.rid, row[: kv.cache_protected_len],
                         row[kv.cache_protected_len : kv.kv_allocated_len]))
    return out


def check_slots(checker) -> list[str]:
    alloc = checker.token_to_kv_pool_allocator
    if getattr(alloc, "free_pages", None) is None or not hasattr(
            checker.tree_cache, "all_values_flatten"):
        return []  # hybrid pools (SWA, mamba): their own checks
    return slot_violations(alloc.size, free_slots(alloc),
                           checker.tree_cache.all_values_flatten(), owners(checker))


def live_leftovers(hub) -> list[str]:
    """sgl_spec's per-request structures that still hold a request (none should once
    no request runs or waits); ``hub``: the cache's request hub, None for another cache."""
    if hub is None:
        return []
    hub.idle()
    return [f"{name} holds {n} request(s) with none running"
            for name, n in hub.live().items() if n]


def _log(checker) -> InvariantLog:
    """The checked cache's log (sgl_spec's cache); a stand-alone one for another cache,
    whose findings only reach the server log."""
    log = getattr(checker.tree_cache, "invariant_log", None)
    if log is None:
        log = checker.tree_cache.invariant_log = InvariantLog()
    log.checks += 1
    return log


def patch_checker(module) -> None:
    """Wrap ``SchedulerInvariantChecker``'s busy check and its idle tree check
    (``_check_tree_cache``, which the idle path always calls) when the server runs
    with ``--spec-check-invariants``. Idempotent."""
    if not current().check_invariants:
        return
    cls = module.SchedulerInvariantChecker
    if getattr(cls.self_check_during_busy, "_sgl_spec", False):
        return
    busy, idle = cls.self_check_during_busy, cls._check_tree_cache

    def self_check_during_busy(self):
        busy(self)
        _log(self).record("step", check_slots(self))

    def _check_tree_cache(self):
        idle(self)
        log = _log(self)
        log.idle_checks += 1
        log.record("idle", check_slots(self)
                   + live_leftovers(getattr(self.tree_cache, "hub", None)))

    self_check_during_busy._sgl_spec = _check_tree_cache._sgl_spec = True
    cls.self_check_during_busy = self_check_during_busy
    cls._check_tree_cache = _check_tree_cache
