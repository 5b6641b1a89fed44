"""Turns of the radix cache, free of sglang: where turns, rounds, roles and reasoning
spans lie in a token sequence (``turn_format``, ``segment``), the tree summary derived
from them on demand (``summary``) and its Prometheus gauges (``metrics``). The radix
cache itself (sglang's, with an optional turn-tagged tree core) is in
``sgl_spec.integration``."""
