"""The one timing helper of the benchmarks: clocks, medians, spreads, interleaved rounds.

Every benchmark times through this module, so that "median of R after W warm-up
calls" and "spread over server starts" mean the same thing everywhere:

    >>> median_s(lambda: attention(q, k, v), repeats=5, warmup=1)   # seconds
    >>> value, seconds = timed(lambda: select_lines(q, k, 0, cfg))
    >>> watch = Stopwatch(); ...; watch.elapsed()                    # a streamed request
    >>> spread([2.1, 2.4, 1.9])                                      # Spread(1.9, 2.1, 2.4)
    >>> interleaved(["a", "b"], rounds=3, run=lambda key, i: ...)    # a b a b a b

``interleaved`` is the ``--rounds``/``--repeats`` loop: every key once per round, all
keys then all keys again, so a slow stretch of a shared machine hits every key.
Pure Python (``time.perf_counter``, as ``clock``); nothing here imports torch or a
server.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

# The clock every measurement here reads (seconds, monotonic); tests substitute it.
clock: Callable[[], float] = time.perf_counter


class Stopwatch:
    """Seconds since construction (``time.perf_counter``), for timings that are not one
    call: the first chunk of a stream, a server start."""

    def __init__(self) -> None:
        self.start = clock()

    def elapsed(self) -> float:
        return clock() - self.start


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` once: its value and the seconds it took."""
    watch = Stopwatch()
    value = fn()
    return value, watch.elapsed()


def samples_s(fn: Callable[[], object], repeats: int, warmup: int = 0,
              sync: Callable[[], object] | None = None) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones; ``sync``
    (e.g. ``torch.cuda.synchronize``) runs after each call, inside its time."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    call = fn if sync is None else (lambda: (fn(), sync()))
    for _ in range(warmup):
        call()
    return [timed(call)[1] for _ in range(repeats)]


def median_s(fn: Callable[[], object], repeats: int, warmup: int = 0,
             sync: Callable[[], object] | None = None) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    return statistics.median(samples_s(fn, repeats, warmup, sync))


def median(xs: Iterable[float | None]) -> float | None:
    """Median of the values that are not None; None when there are none."""
    kept = [x for x in xs if x is not None]
    return statistics.median(kept) if kept else None


class Spread(NamedTuple):
    """min / median / max of repeated measurements (server starts, rounds)."""

    min: float
    median: float
    max: float


def spread(xs: Iterable[float | None]) -> Spread | None:
    """The spread of the values that are not None; None when there are none."""
    kept = [x for x in xs if x is not None]
    if not kept:
        return None
    return Spread(min(kept), statistics.median(kept), max(kept))


def ratio_spread(nums: Sequence[float | None], dens: Sequence[float | None]) -> Spread | None:
    """Spread of the paired ratios ``nums[i] / dens[i]`` (one pair per server start, so
    each ratio compares two rows under the same machine state); pairs with a missing
    or zero value are left out."""
    return spread(a / b if a is not None and b else None for a, b in zip(nums, dens))


def interleaved(keys: Sequence[K], rounds: int,
                run: Callable[[K, int], T]) -> dict[K, list[T]]:
    """``run(key, round)`` for every key, all keys then all keys again, ``rounds`` times;
    ``{key: [one result per round]}``."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    out: dict[K, list[T]] = {k: [] for k in keys}
    for i in range(rounds):
        for k in keys:
            out[k].append(run(k, i))
    return out
