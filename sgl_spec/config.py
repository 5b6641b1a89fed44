"""sgl_spec's own serving options (the ``--spec-*`` flags), as one frozen config.

The launcher parses these flags, validates them here and hands the config to every
sglang process through the environment (``SGLSPEC_CONFIG``, JSON), since sglang's
``ServerArgs`` is sealed and its scheduler runs in spawned processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache

from sgl_spec import envs
from sgl_spec.sparse.params import LIMITS, SparseParams

# Attention modes: "exact" (dense) and the selection policies of sgl_spec.sparse.
MODES = ("exact", "streaming", "snapkv", "loopserve")
# Radix-cache eviction orders (sgl_spec.cache.tree_core.EVICTION_POLICIES).
CACHE_EVICTIONS = ("lru", "turn")
# Prefill attention: "exact" (dense) or LoopServe's online vertical/slash lines.
PREFILL_MODES = ("exact", "loopserve")


@dataclass(frozen=True)
class SpecConfig:
    """What ``--spec-*`` selected. Immutable; validated on construction."""

    mode: str = "exact"
    disable: bool = False
    cache_eviction: str = "lru"
    # Sparse decode (modes other than exact); validated by SparseParams.
    budget: int = SparseParams.budget
    sink: int = SparseParams.sink
    window: int = SparseParams.window
    nd: int = SparseParams.nd
    min_context: int = SparseParams.min_context
    # Sparse prefill (sgl_spec.attention.sparse_prefill), independent of ``mode``.
    prefill: str = "exact"
    prefill_alpha: float = 0.955
    # kernels/vslash/bench.py --crossover on the default model: select + line-sparse
    # attention never beat SDPA below 4k fresh tokens (0.34-0.71x), and came closest
    # (0.8-0.99x) for 2k-token turns over a cached history; shorter extends stay exact.
    prefill_min_tokens: int = 2048
    prefill_reuse: bool = True
    prefill_max_density: float = 0.3  # sgl_spec.attention.sparse_prefill.MAX_DENSITY
    prefill_skip_density: float = 0.2  # sgl_spec.attention.sparse_prefill.SKIP_DENSITY

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(
                f"--spec-mode {self.mode!r} is invalid; valid values: {', '.join(MODES)}"
            )
        if self.cache_eviction not in CACHE_EVICTIONS:
            raise ValueError(
                f"--spec-cache-eviction {self.cache_eviction!r} is invalid; valid "
                f"values: {', '.join(CACHE_EVICTIONS)}"
            )
        self.sparse_params()  # raises ValueError naming the bad --spec-* flag
        if self.prefill not in PREFILL_MODES:
            raise ValueError(
                f"--spec-prefill {self.prefill!r} is invalid; valid values: "
                f"{', '.join(PREFILL_MODES)}"
            )
        _check_fraction("--spec-prefill-alpha", self.prefill_alpha)
        n = self.prefill_min_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"--spec-prefill-min-tokens {n!r} is invalid; valid range: integers >= 1"
            )
        _check_fraction("--spec-prefill-max-density", self.prefill_max_density)
        _check_fraction("--spec-prefill-skip-density", self.prefill_skip_density)

    def sparse_params(self) -> SparseParams:
        """The selection policies' parameters (the one place they are validated)."""
        return SparseParams(
            budget=self.budget,
            sink=self.sink,
            window=self.window,
            nd=self.nd,
            min_context=self.min_context,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SpecConfig":
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{envs.SGLSPEC_CONFIG} has unknown keys {unknown}; valid keys: {sorted(known)}"
            )
        return cls(**data)


# SpecConfig field -> help of its flag; the flag's name and valid range are
# SparseParams' (sgl_spec.sparse.params.LIMITS), which also checks them.
_SPARSE_HELP = {
    "budget": "Sparse modes: history positions selected per KV head and layer (B).",
    "sink": "Sparse modes: first positions always attended (attention sink).",
    "window": "Sparse modes: last positions always attended (recent window).",
    "nd": "loopserve: reselection interval in decode steps, and the number of "
    "recent decoded queries that score the history.",
    "min_context": "Sparse modes: histories shorter than this decode exactly (as "
    "do histories that budget + sink + window cover).",
}


def _check_fraction(flag: str, value) -> None:
    """Raise a ValueError naming ``flag`` unless ``value`` is a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{flag} {value!r} is invalid; valid range: a number in (0, 1]")


def _float_or_text(text: str) -> float | str:
    """argparse type: a float, or the text itself for SpecConfig to reject."""
    try:
        return float(text)
    except ValueError:
        return text


def _int_or_text(text: str) -> int | str:
    """argparse type: an int, or the text itself for SparseParams to reject with
    the flag's valid range (argparse's own error would not name it)."""
    try:
        return int(text)
    except ValueError:
        return text


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``--spec-*`` flags (sglang-style help, defaults shown)."""
    group = parser.add_argument_group("sgl_spec options")
    defaults = SpecConfig()
    group.add_argument(
        "--spec-mode",
        type=str,
        default=defaults.mode,
        choices=MODES,
        help="Decode attention mode. 'exact' is dense attention (the path every "
        "sparse mode falls back to); 'streaming' attends the sink and a recent "
        "window (StreamingLLM); 'snapkv' selects --spec-budget positions per KV "
        "head once, from the last prompt window (SnapKV); 'loopserve' reselects "
        "them from the last --spec-nd decoded queries (LoopServe Sec 5.3). Sparse "
        "modes run on CPU (torch); on CUDA hosts decode stays exact. "
        f"Default: {defaults.mode}.",
    )
    for dest, text in _SPARSE_HELP.items():
        flag, lo = LIMITS[dest]
        group.add_argument(
            flag,
            dest=dest,
            type=_int_or_text,
            default=getattr(defaults, dest),
            metavar="N",
            help=f"{text} Integer >= {lo}. Default: {getattr(defaults, dest)}.",
        )
    group.add_argument(
        "--spec-cache-eviction",
        type=str,
        default=defaults.cache_eviction,
        choices=CACHE_EVICTIONS,
        help="Radix-cache eviction order. 'lru' is stock sglang's (identical "
        "evictions); 'turn' evicts dead reasoning branches (finished turns' "
        "reasoning the chat template drops from history) first, then the least "
        "recently active conversations, oldest rounds first. "
        f"Default: {defaults.cache_eviction}.",
    )
    group.add_argument(
        "--spec-prefill",
        type=str,
        default=defaults.prefill,
        choices=PREFILL_MODES,
        help="Prefill attention mode, independent of --spec-mode (decode). 'exact' "
        "is dense attention; 'loopserve' selects vertical and slash lines per layer "
        "and KV head from a sample of each long extend's own queries and attends "
        "only those (LoopServe Sec 5.2). CPU only. Default: "
        f"{defaults.prefill}.",
    )
    group.add_argument(
        "--spec-prefill-alpha",
        type=_float_or_text,
        default=defaults.prefill_alpha,
        metavar="FLOAT",
        help="loopserve prefill: fraction of the sampled attention mass the selected "
        f"lines must cover. Number in (0, 1]. Default: {defaults.prefill_alpha}.",
    )
    group.add_argument(
        "--spec-prefill-min-tokens",
        type=_int_or_text,
        default=defaults.prefill_min_tokens,
        metavar="N",
        help="loopserve prefill: extends with fewer new tokens (short turns, decode-"
        "sized chunks) take the exact path. Integer >= 1. Default: "
        f"{defaults.prefill_min_tokens}.",
    )
    group.add_argument(
        "--spec-prefill-max-density",
        type=_float_or_text,
        default=defaults.prefill_max_density,
        metavar="FLOAT",
        help="loopserve prefill: a layer whose selected lines cover more than this "
        "share of the causal cells makes the dense call instead (the line kernel "
        "would cost more than the dense call). Number in (0, 1]; 1 never falls back. "
        f"Default: {defaults.prefill_max_density}.",
    )
    group.add_argument(
        "--spec-prefill-skip-density",
        type=_float_or_text,
        default=defaults.prefill_skip_density,
        metavar="FLOAT",
        help="loopserve prefill: a layer whose selected lines cover more than this "
        "share of the causal cells skips its selection in the next extends and makes "
        "the dense call (selection plus lines would cost more than the dense call), "
        "re-selecting every 8th extend. Number in (0, 1]; 1 never skips. Default: "
        f"{defaults.prefill_skip_density}.",
    )
    group.add_argument(
        "--spec-prefill-reuse",
        action=argparse.BooleanOptionalAction,
        default=defaults.prefill_reuse,
        help="loopserve prefill: seed each extend's selection with the lines "
        "selected for the cached sequence it continues (the previous turn or "
        "chunk). Default: on.",
    )
    group.add_argument(
        "--spec-disable",
        action="store_true",
        default=defaults.disable,
        help="Serve with stock sglang components (torch_native attention on CPU, "
        "sglang's default radix cache) for side-by-side comparison. Default: off.",
    )


def from_cli_args(args: argparse.Namespace) -> SpecConfig:
    """The config of parsed flags; raises ValueError naming a bad flag."""
    return SpecConfig(
        mode=args.spec_mode,
        disable=args.spec_disable,
        cache_eviction=args.spec_cache_eviction,
        prefill=args.spec_prefill,
        prefill_alpha=args.spec_prefill_alpha,
        prefill_min_tokens=args.spec_prefill_min_tokens,
        prefill_reuse=args.spec_prefill_reuse,
        prefill_max_density=args.spec_prefill_max_density,
        prefill_skip_density=args.spec_prefill_skip_density,
        **{dest: getattr(args, dest) for dest in _SPARSE_HELP},
    )


@lru_cache(maxsize=1)
def current() -> SpecConfig:
    """The config of this server process (defaults when launched without sgl_spec)."""
    text = envs.spec_config_json()
    return SpecConfig.from_json(text) if text else SpecConfig()
