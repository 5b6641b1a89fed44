"""Server configurations compared side by side, kept as data (a TOML file).

A configuration set names the rows of one evaluation run::

    name = "baseline"
    description = "..."              # optional

    [[config]]
    name = "sgl_spec exact"          # the row's label, unique in the set
    launcher = "sgl_spec"            # "stock" or "sgl_spec" (see LAUNCHERS)
    flags = ["--spec-mode", "exact"] # extra launch flags (optional)
    reference = true                 # exactly one row: agreement is measured against it

    [plan]                           # optional: what every row plays (``plan.parse``)
    dataset = "default"
    longgen = ["doc-facts"]
    longgen_max_tokens = 512

    [checks.within_points]           # optional: row -> the most exact-match points it
    "loopserve B=1024" = 3           # may lose to the reference at any query position

    [checks.followup_speedup]        # optional: row -> how many times faster than the
    "sgl_spec exact" = 5             # first row its follow-up turns over a cached
                                     # document must reach their first token

Greedy agreement is measured against the reference row; speed ratios against the
first row (the baseline: stock in ``baseline.toml``). Later attention modes add rows
(``loopserve B=512``) to such a file; the runner and the report take any number of
rows. The harness owns ``--model-path``, ``--host`` and ``--port`` and adds
``COMMON_FLAGS`` to every server. The built-in sets are in ``configs/``.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, replace
from typing import NamedTuple

from sgl_spec.bench import plan as run_plan
from sgl_spec.bench.server import SPEC, STOCK
from sgl_spec import cpu as host_cpu
from sgl_spec.config import SpecConfig

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
DEFAULT_PATH = os.path.join(CONFIG_DIR, "baseline.toml")

# Flags every server gets, so that only a row's own flags differ between rows.
# Metrics are observational (outputs do not change); sparse modes export their
# decode-step counters there, which the runner reads.
COMMON_FLAGS: tuple[str, ...] = ("--max-total-tokens", "32768", "--enable-cache-report",
                                 "--enable-metrics")
# Flags the harness sets itself; a row may not.
OWNED_FLAGS: tuple[str, ...] = ("--model-path", "--model", "--host", "--port")


class Launcher(NamedTuple):
    module: str
    flags: tuple[str, ...]  # before the row's own flags


LAUNCHERS: dict[str, Launcher] = {
    # What CPU users of stock sglang run, in the dtype sgl_spec's launcher picks for this
    # CPU (sgl_spec.cpu), so that every ratio compares one dtype.
    "stock": Launcher(STOCK, ("--device", "cpu", "--attention-backend", "torch_native",
                              *(("--dtype", host_cpu.default_dtype())
                                if host_cpu.default_dtype() else ()))),
    # sgl_spec's launcher adds its own CPU defaults.
    "sgl_spec": Launcher(SPEC, ()),
}

SET_KEYS: tuple[str, ...] = ("name", "description", "config", "plan", "checks")
CHECK_KEYS: tuple[str, ...] = ("within_points", "followup_speedup")
CONFIG_KEYS: tuple[str, ...] = ("name", "launcher", "flags", "reference", "description")


@dataclass(frozen=True)
class ServerConfig:
    """One row: a server started as ``python -m <launcher module> <args>``."""

    name: str
    launcher: str
    flags: tuple[str, ...] = ()
    reference: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"a configuration needs a non-empty name, got {self.name!r}")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"configuration {self.name!r}: unknown launcher "
                             f"{self.launcher!r}; valid: {sorted(LAUNCHERS)}")
        if not all(isinstance(f, str) for f in self.flags):
            raise ValueError(f"configuration {self.name!r}: flags must be strings, "
                             f"got {list(self.flags)!r}")
        owned = [f for f in self.flags if f.split("=", 1)[0] in OWNED_FLAGS]
        if owned:
            raise ValueError(f"configuration {self.name!r}: {owned} are set by the harness; "
                             f"a row may not set any of {list(OWNED_FLAGS)}")
        if not isinstance(self.reference, bool):
            raise ValueError(f"configuration {self.name!r}: reference must be true or "
                             f"false, got {self.reference!r}")

    @property
    def module(self) -> str:
        return LAUNCHERS[self.launcher].module

    def server_args(self, model: str) -> list[str]:
        """The launcher's argv (without host and port)."""
        return ["--model-path", model, *COMMON_FLAGS, *LAUNCHERS[self.launcher].flags,
                *self.flags]

    def spec(self) -> SpecConfig | None:
        """The row's ``--spec-*`` configuration; None for stock rows."""
        if self.launcher != "sgl_spec":
            return None
        from sgl_spec.launch_server import split_argv

        return split_argv(list(self.flags))[0]

    @property
    def slug(self) -> str:
        """The name as a file-name part: ``sgl_spec exact`` -> ``sgl_spec-exact``."""
        keep = "".join(c if c.isalnum() or c in "._-" else "-" for c in self.name)
        return "-".join(p for p in keep.split("-") if p)


@dataclass(frozen=True)
class ConfigSet:
    """The rows, and optionally the plan they all play and per-row checks:
    ``within_points`` pairs a row with the most exact-match points (0-100) it may
    lose to the reference at any query position; ``followup_speedup`` with the
    least factor by which its follow-up turns' TTFT must beat the first row's."""

    name: str
    configs: tuple[ServerConfig, ...]
    description: str = ""
    plan: run_plan.RunPlan | None = None
    within_points: tuple[tuple[str, float], ...] = ()
    followup_speedup: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"a configuration set needs a non-empty name, got {self.name!r}")
        if not self.configs:
            raise ValueError(f"configuration set {self.name!r} has no [[config]] rows")
        names = [c.name for c in self.configs]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"configuration set {self.name!r}: duplicate names {dups}")
        slugs = [c.slug for c in self.configs]
        if len(set(slugs)) != len(slugs):
            raise ValueError(f"configuration set {self.name!r}: names {names} collide as "
                             f"file names {slugs}")
        refs = [c.name for c in self.configs if c.reference]
        if len(refs) != 1:
            raise ValueError(f"configuration set {self.name!r}: exactly one row must have "
                             f"reference = true (exact attention), found {len(refs)}: {refs}")
        self._check_rows("within_points", self.within_points, refs[0], "the reference",
                         "a number of points in [0, 100]", lambda x: 0 <= x <= 100)
        self._check_rows("followup_speedup", self.followup_speedup, names[0],
                         "the first row", "a factor > 0", lambda x: x > 0)

    def _check_rows(self, table: str, pairs: tuple[tuple[str, float], ...], other: str,
                    other_label: str, want: str, ok) -> None:
        names = [c.name for c in self.configs]
        where = f"configuration set {self.name!r}: [checks.{table}]"
        for row, value in pairs:
            if row not in names or row == other:
                raise ValueError(f"{where} names {row!r}, not a row other than "
                                 f"{other_label}; valid: {[n for n in names if n != other]}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"{where} {row!r} must be {want}, got {value!r}")

    def only(self, rows: list[str]) -> ConfigSet:
        """The set with only ``rows`` besides the baseline and the reference (which
        the others are measured against); ValueError names the valid rows."""
        names = [c.name for c in self.configs]
        bad = [r for r in rows if r not in names]
        if bad:
            raise ValueError(f"configuration set {self.name!r} has no row(s) {bad}; "
                             f"valid: {names}")
        keep = {self.baseline.name, self.reference.name, *rows}
        return replace(self, configs=tuple(c for c in self.configs if c.name in keep),
                       within_points=tuple(p for p in self.within_points if p[0] in keep),
                       followup_speedup=tuple(p for p in self.followup_speedup
                                              if p[0] in keep))

    def with_flags(self, flags: list[str]) -> ConfigSet:
        """Every row with ``flags`` appended (``--server-flags``: e.g. ``--dtype float32``
        on a CPU whose bf16 GEMMs are slow); ValueError for a flag the harness sets."""
        if not flags:
            return self
        return replace(self, configs=tuple(replace(c, flags=(*c.flags, *flags))
                                           for c in self.configs))

    @property
    def baseline(self) -> ServerConfig:
        """The row speed ratios are taken against: the first."""
        return self.configs[0]

    @property
    def reference(self) -> ServerConfig:
        return next(c for c in self.configs if c.reference)


def _check_keys(table: dict, valid: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(table) - set(valid))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys: {list(valid)}")


def parse(doc: dict, source: str = "<configs>") -> ConfigSet:
    """A ``ConfigSet`` from a parsed TOML document; ValueError names what is wrong."""
    _check_keys(doc, SET_KEYS, source)
    if "name" not in doc:
        raise ValueError(f"{source}: missing top-level 'name'; valid keys: {list(SET_KEYS)}")
    rows = doc.get("config", [])
    if not isinstance(rows, list):
        raise ValueError(f"{source}: 'config' must be an array of tables ([[config]])")
    configs = []
    for i, row in enumerate(rows):
        where = f"{source}: [[config]] #{i + 1}"
        if not isinstance(row, dict):
            raise ValueError(f"{where} must be a table")
        _check_keys(row, CONFIG_KEYS, where)
        for key in ("name", "launcher"):
            if key not in row:
                raise ValueError(f"{where}: missing {key!r}; valid keys: {list(CONFIG_KEYS)}")
        flags = row.get("flags", [])
        if not isinstance(flags, list):
            raise ValueError(f"{where}: flags must be a list of strings, got {flags!r}")
        try:
            configs.append(ServerConfig(
                name=row["name"], launcher=row["launcher"], flags=tuple(flags),
                reference=row.get("reference", False),
                description=row.get("description", ""),
            ))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    plan = run_plan.parse(doc["plan"], f"{source}: [plan]") if "plan" in doc else None
    checks = doc.get("checks", {})
    if not isinstance(checks, dict):
        raise ValueError(f"{source}: [checks] must be a table; valid keys: {list(CHECK_KEYS)}")
    _check_keys(checks, CHECK_KEYS, f"{source}: [checks]")
    tables = {}
    for key in CHECK_KEYS:
        tables[key] = checks.get(key, {})
        if not isinstance(tables[key], dict):
            raise ValueError(f"{source}: [checks] {key} must be a table of row name = "
                             f"number, got {tables[key]!r}")
    try:
        return ConfigSet(doc["name"], tuple(configs), doc.get("description", ""), plan,
                         tuple(tables["within_points"].items()),
                         tuple(tables["followup_speedup"].items()))
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def loads(text: str, source: str = "<configs>") -> ConfigSet:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source}: not valid TOML: {exc}") from None
    return parse(doc, source)


def load(path: str = DEFAULT_PATH) -> ConfigSet:
    with open(path, "rb") as f:
        text = f.read().decode()
    return loads(text, path)
