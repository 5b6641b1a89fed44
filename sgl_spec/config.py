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

# Attention modes; later issues add sparse ones here (and nowhere else).
MODES = ("exact",)
# Radix-cache eviction orders (sgl_spec.cache.tree_core.EVICTION_POLICIES).
CACHE_EVICTIONS = ("lru", "turn")


@dataclass(frozen=True)
class SpecConfig:
    """What ``--spec-*`` selected. Immutable; validated on construction."""

    mode: str = "exact"
    disable: bool = False
    cache_eviction: str = "lru"

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
        f"sparse mode falls back to). Default: {defaults.mode}.",
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
        "--spec-disable",
        action="store_true",
        default=defaults.disable,
        help="Serve with stock sglang components (torch_native attention on CPU, "
        "sglang's default radix cache) for side-by-side comparison. Default: off.",
    )


def from_cli_args(args: argparse.Namespace) -> SpecConfig:
    return SpecConfig(
        mode=args.spec_mode,
        disable=args.spec_disable,
        cache_eviction=args.spec_cache_eviction,
    )


@lru_cache(maxsize=1)
def current() -> SpecConfig:
    """The config of this server process (defaults when launched without sgl_spec)."""
    text = envs.spec_config_json()
    return SpecConfig.from_json(text) if text else SpecConfig()
