"""The README stays a guide: short, short cells, and every command it shows parses (the
``--help`` of each module it runs with ``python -m``)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MAX_LINES, MAX_CELL = 250, 200


def _text() -> str:
    return README.read_text()


def test_the_readme_is_short_and_its_cells_are():
    lines = _text().splitlines()
    assert len(lines) <= MAX_LINES, len(lines)
    long = [(i + 1, c.strip()[:60]) for i, line in enumerate(lines) if line.startswith("|")
            for c in line.strip("|").split(" | ") if len(c.strip()) > MAX_CELL]
    assert not long, long


def _modules() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", _text(), flags=re.S)
    return sorted({m for b in blocks for m in re.findall(r"python3? -m ([\w.]+)", b)})


@pytest.mark.slow
def test_every_module_the_readme_runs_answers_help():
    mods = _modules()
    assert "sgl_spec.launch_server" in mods and "sglang.bench_serving" in mods
    present = [m for m in mods if importlib.util.find_spec(m.split(".")[0]) is not None]
    missing = sorted(set(mods) - set(present))
    assert missing in ([], ["sglang_router.launch_router"]), missing  # the optional extra

    # One process answers every module's --help as `python -m MOD --help` would
    # (runpy, run as __main__): the imports they share are paid once.
    code = (
        "import runpy, sys\n"
        "failed = []\n"
        "for mod in sys.argv[1:]:\n"
        "    sys.argv = [mod, '--help']\n"
        "    try:\n"
        "        runpy.run_module(mod, run_name='__main__', alter_sys=True)\n"
        "    except SystemExit as e:\n"
        "        if e.code not in (0, None):\n"
        "            failed.append((mod, e.code))\n"
        "print('FAILED', failed)\n"
    )
    run = subprocess.run([sys.executable, "-c", code, *present], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and "FAILED []" in run.stdout, (run.stdout[-2000:],
                                                                run.stderr[-2000:])
