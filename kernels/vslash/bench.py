"""Moved: the line-sparse prefill benchmark is ``python -m sgl_spec.bench.vslash``.

Left only so that ``kernels/sparse_decode/bench_dense.py`` (``from ..vslash.bench import
_median_s``) keeps running until it imports ``sgl_spec.bench.timing.median_s`` (same
behaviour: median of ``repeats`` calls, no warm-up); delete this file then.
"""

from sgl_spec.bench.timing import median_s as _median_s  # noqa: F401

if __name__ == "__main__":
    raise SystemExit("moved: python -m sgl_spec.bench.vslash (same flags)")
