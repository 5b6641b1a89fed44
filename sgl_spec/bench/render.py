"""Markdown cells and tables: the one formatter of every benchmark report (``results.md``).

    >>> num(0.3571, 1e3, 1)          # '357.1'  (seconds shown as ms)
    >>> ratio(0.102)                 # '0.102x'
    >>> spread_cell(Spread(1.9, 2.1, 2.4))   # '1.90 / 2.10 / 2.40'
    >>> "\\n".join(table(["row", "tok/s"], [["stock", "3.67"]]))

A missing figure (None) is shown as ``n/a``. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from sgl_spec.bench.timing import Spread

MISSING = "n/a"


def num(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    """``x * scale`` with ``digits`` decimals; ``n/a`` for None."""
    return MISSING if x is None else f"{x * scale:.{digits}f}"


def ratio(x: float | None) -> str:
    """A ratio with three significant digits and an ``x``: ``0.102x``, ``1x``."""
    return MISSING if x is None else f"{x:.3g}x"


def spread_cell(s: Spread | None, digits: int = 2) -> str:
    """``min / median / max``; ``n/a`` without values."""
    return MISSING if s is None else " / ".join(num(v, digits=digits) for v in s)


def cell(x, spec: str = ".2f") -> str:
    """A figure, a ``Spread`` as ``median (min-max)``, or a dict's values joined by `` / ``
    (``spec`` "d": signed differences); ``-`` for None."""
    if x is None:
        return "-"
    if isinstance(x, (list, tuple)) and len(x) == 3:
        return f"{x[1]:{spec}} ({x[0]:{spec}}-{x[2]:{spec}})"
    if isinstance(x, dict):
        return " / ".join(cell(v, "+.1f" if spec == "d" else ".1f") for v in x.values())
    return f"{x:{spec}}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table's lines: header, separator, one line per row."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]
