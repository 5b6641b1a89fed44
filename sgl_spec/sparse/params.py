"""Sparse-decode parameters (the ``--spec-budget`` ... flags) and the exact fallback."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


# field -> (the flag named in errors, lowest valid value); sgl_spec.config builds
# the --spec-* flags' help from this too.
LIMITS: dict[str, tuple[str, int]] = {
    "budget": ("--spec-budget", 1),
    "sink": ("--spec-sink", 0),
    "window": ("--spec-window", 1),
    "nd": ("--spec-nd", 1),
    "first_select_step": ("first_select_step", 0),
    "min_context": ("--spec-min-context", 0),
}


def _check_int(flag: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{flag} {value!r} is invalid; valid range: integers >= {lo}")


@dataclass(frozen=True)
class SparseParams:
    """What a selection policy keeps per request, KV head and layer. Immutable.

    budget: selected history positions per KV head (B); sink: first positions always
    attended; window: last positions always attended; nd: LoopServe's reselection
    interval (and query ring size); first_select_step: LoopServe's first selection
    (decode step 16 in Algorithm 3); min_context: shorter histories decode exactly.
    """

    budget: int = 1024
    sink: int = 4
    window: int = 64
    nd: int = 16
    first_select_step: int = 16
    min_context: int = 2048

    def __post_init__(self):
        for name, (flag, lo) in LIMITS.items():
            _check_int(flag, getattr(self, name), lo)
        if self.first_select_step + 1 < self.nd:
            logger.warning(
                "first_select_step %d < --spec-nd %d - 1: the first selection sees "
                "only %d decoded queries",
                self.first_select_step, self.nd, self.first_select_step + 1,
            )


def use_exact(seq_len: int, params: SparseParams) -> bool:
    """Whether a history of ``seq_len`` positions is decoded densely.

    Short histories (< min_context) gain nothing from sparsity, and when sink, window
    and budget cover the whole history the "sparse" subset would be all of it.
    """
    return (
        seq_len < params.min_context
        or params.budget + params.sink + params.window >= seq_len
    )
