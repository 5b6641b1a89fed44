"""Run SGLang's own cache unit tests against stock's cores and sgl_spec's caches.

    python -m sgl_spec.integration.upstream_tests [--configs ...] [--tests DIR] [--out DIR]

Each configuration (``upstream_plugin.CONFIGS``) runs the unmodified upstream test
files in its own pytest process, the plugin swapping the cache classes the tests
build. Writes ``upstream.json`` (test id -> configuration -> outcome) and
``upstream.md`` (the table) under ``--out``, and exits 1 when a test that passes on
stock's Python core fails on an sgl_spec configuration without an entry in
``DELIBERATE`` (the documented differences, each with its reason).

The upstream files are not in this repository (see ``tests/upstream/SOURCES.md``):
nothing is downloaded at run time; ``--tests`` names the folder that holds them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .upstream_plugin import CONFIGS, ENV

BASELINE = "stock-python"
SPEC_CONFIGS = tuple(c for c in CONFIGS if c.startswith(("spec", "tagged")))
DEFAULT_TESTS = Path(__file__).resolve().parents[2] / "tests" / "upstream" / "sglang"

# The stock core each sgl_spec configuration runs on: spec-lru (default flags) is
# sglang's compiled core plus token recording, so a test the compiled core itself
# fails (it asserts RadixKey token ids are array('q'); upstream's RadixCache tests
# pass lists) is stock's difference, not sgl_spec's.
CORE_OF = {"spec-lru": "stock-rust", "tagged-lru": BASELINE, "tagged-turn": BASELINE}

# (test id, configuration) -> why sgl_spec differs from stock's Python core on purpose.
# Empty: no test passing on stock's Python core and on the configuration's own stock
# core fails on sgl_spec's (docs/turn-cache.md, SGLang's own cache tests).
DELIBERATE: dict[tuple[str, str], str] = {}


def _run_one(config: str, tests: Path, out: Path) -> dict[str, str]:
    """Outcomes (passed/failed/error/skipped) of every test id under ``config``."""
    xml = out / f"junit-{config}.xml"
    env = {**os.environ, ENV: config,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(DEFAULT_TESTS.parents[2]),
                                                       os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-p", "sgl_spec.integration.upstream_plugin", "-o", "addopts=",
           "--rootdir", str(tests), f"--junitxml={xml}", str(tests)]
    with open(out / f"log-{config}.txt", "w") as log:
        subprocess.run(cmd, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT,
                       check=False)
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[tid] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                         else "skipped" if "skipped" in kinds else "passed")
    return outcomes


def unexplained(results: dict[str, dict[str, str]]) -> list[tuple[str, str]]:
    """(test id, configuration) pairs passing on stock's Python core and on the
    configuration's own stock core (where that ran), failing on sgl_spec's."""
    return [(tid, c) for tid, row in results.items() for c in SPEC_CONFIGS
            if row.get(BASELINE) == "passed" and c in row and row[c] != "passed"
            and row.get(CORE_OF[c], "passed") == "passed"
            and (tid, c) not in DELIBERATE]


def inherited(results: dict[str, dict[str, str]]) -> list[tuple[str, str]]:
    """sgl_spec failures shared with the configuration's own stock core."""
    return [(tid, c) for tid, row in results.items() for c in SPEC_CONFIGS
            if row.get(BASELINE) == "passed" and c in row and row[c] != "passed"
            and row.get(CORE_OF[c], "passed") != "passed"]


def table(results: dict[str, dict[str, str]], configs: list[str]) -> str:
    short = {"passed": "pass", "failed": "FAIL", "error": "ERR", "skipped": "skip"}
    lines = ["| test | " + " | ".join(configs) + " |",
             "|---|" + "---|" * len(configs)]
    for tid in sorted(results):
        row = results[tid]
        lines.append(f"| `{tid}` | " + " | ".join(short.get(row.get(c, ""), "-")
                                                   for c in configs) + " |")
    totals = ["/".join(str(sum(r.get(c) == k for r in results.values()))
                       for k in ("passed", "failed", "error", "skipped")) for c in configs]
    lines.append("| **pass/fail/error/skip** | " + " | ".join(totals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                    help="configurations to run (default: all)")
    ap.add_argument("--tests", type=Path, default=DEFAULT_TESTS,
                    help="folder holding SGLang's test files (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where upstream.json and upstream.md go (default: a temp dir)")
    ap.add_argument("--jobs", type=int, default=2, help="pytest processes at once")
    args = ap.parse_args(argv)
    if not sorted(args.tests.glob("test_*.py")):
        ap.error(f"--tests {args.tests}: no test_*.py files; tests/upstream/SOURCES.md "
                 "says which files and commits to put there")
    out = args.out or Path(tempfile.mkdtemp(prefix="upstream-tests-"))
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {c: pool.submit(_run_one, c, args.tests, out) for c in args.configs}
        per_config = {}
        for c, fut in futures.items():
            per_config[c] = fut.result()
            print(f"[upstream] {c}: {sum(v == 'passed' for v in per_config[c].values())}"
                  f"/{len(per_config[c])} passed ({time.monotonic() - start:.0f} s)",
                  flush=True)
    results: dict[str, dict[str, str]] = {}
    for c, outcomes in per_config.items():
        for tid, o in outcomes.items():
            results.setdefault(tid, {})[c] = o
    bad = unexplained(results)
    (out / "upstream.json").write_text(json.dumps(
        {"configs": args.configs, "baseline": BASELINE, "results": results,
         "unexplained": [list(p) for p in bad],
         "inherited_from_stock_core": [[t, c, CORE_OF[c]] for t, c in inherited(results)],
         "deliberate": [[t, c, why] for (t, c), why in DELIBERATE.items()]}, indent=1))
    (out / "upstream.md").write_text(table(results, args.configs) + "\n")
    print(table(results, args.configs))
    print(f"[upstream] {len(results)} tests, {time.monotonic() - start:.0f} s; "
          f"written to {out}")
    for tid, c in inherited(results):
        print(f"[upstream] fails on {c} as on its stock core {CORE_OF[c]}: {tid}")
    for tid, c in bad:
        print(f"[upstream] sgl_spec-only failure: {tid} on {c}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
