"""The seam: only ``sgl_spec.integration`` imports sglang internals.

Every other module of sgl_spec (kernels included) imports with sglang made
unimportable, and the unit tests of those modules pass that way, in a fresh process
whose every ``import sglang...`` raises (``SGLSPEC_TEST_BLOCK_SGLANG``, conftest).
The agents are left out: they are programs in SGLang's public frontend language.
"""

from __future__ import annotations

import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Test modules of the sglang-free code (and what of them needs a server or sglang).
SGLANG_FREE_TESTS = [
    "tests/test_turn_format.py", "tests/test_sparse_policies.py",
    "tests/test_sparse_decode_kernels.py", "tests/test_vslash_kernels.py",
    "tests/test_sparse_prefill.py", "tests/test_sparse_backend.py", "tests/test_launcher.py",
    "tests/test_long_context.py", "tests/test_model_sources.py", "tests/test_krul_select.py",
    "tests/test_krul_merge.py", "tests/test_krul_pyramid.py", "tests/test_tiers_arena.py",
    "tests/test_krul_quant.py", "tests/test_bench_scaleout.py", "tests/test_offload.py",
]
NEEDS_SGLANG = "batch_view"  # test_sparse_backend: the integration's ForwardBatch view


def sglang_free_modules() -> list[str]:
    import sgl_spec
    import sgl_spec.kernels

    names = {sgl_spec.__name__, sgl_spec.kernels.__name__}
    for pkg in (sgl_spec, sgl_spec.kernels):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            names.add(info.name)
    return sorted(n for n in names if not n.endswith("__main__")
                  and not n.startswith(("sgl_spec.integration", "sgl_spec.agents")))


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "SGLSPEC_TEST_BLOCK_SGLANG": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_only_the_integration_package_names_sglang_internals():
    offenders = [str(p.relative_to(ROOT)) for d in ("sgl_spec", "kernels", "agents")
                 for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in (".py", ".cpp")
                 and "sglang.srt" in p.read_text(errors="ignore")
                 and "integration" not in p.parts]
    assert offenders == []


def test_every_other_module_imports_without_sglang():
    modules = sglang_free_modules()
    assert "sgl_spec.attention.decode" in modules and "sgl_spec.kernels.sparse_decode" in modules
    code = (
        "import importlib, sys\n"
        "sys.path.insert(0, 'tests'); import conftest\n"  # installs the blocker
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules)\n"
        "try:\n"
        "    import sglang.srt  # noqa: F401\n"
        "    raise SystemExit('sglang was importable')\n"
        "except ImportError:\n"
        "    print('ok', len(sys.argv))\n"
    )
    proc = _run(["-c", code], timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# What the sglang-free run leaves out: Triton's interpreted runs are the kernels' own tests
# (elsewhere): there they would only repeat them, slowly. The launcher's subprocess tests
# run sgl_spec.launch_server, which imports sglang by design.
LEFT_OUT = (NEEDS_SGLANG, "fresh_process", "triton", "exits_nonzero", "help_lists")


def runs_without_sglang(item) -> bool:
    """Whether a collected test is one of the sglang-free modules' unit tests that
    ``test_their_unit_tests_pass_without_sglang`` runs (the conftest then leaves it out of
    the main run: it runs once, there)."""
    if item.nodeid.split("::")[0] not in SGLANG_FREE_TESTS:
        return False
    if item.get_closest_marker("server") or item.get_closest_marker("gpu"):
        return False
    return not any(word in item.nodeid.lower() for word in LEFT_OUT)


def test_their_unit_tests_pass_without_sglang(tmp_path):
    from conftest import BLOCKED_ONLY

    if BLOCKED_ONLY:  # the whole suite: exactly the tests the main run left to this one
        ids = tmp_path / "ids.txt"
        ids.write_text("\n".join(BLOCKED_ONLY) + "\n")
        args = [f"@{ids}"]
    else:
        args = ["-m", "not server and not gpu",
                "-k", " and ".join(f"not {w}" for w in LEFT_OUT), *SGLANG_FREE_TESTS]
    proc = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", *args], timeout=1200)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout
    if BLOCKED_ONLY:
        counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|skipped)", tail))
        assert sum(counts.values()) == len(BLOCKED_ONLY), (counts, len(BLOCKED_ONLY), tail)
