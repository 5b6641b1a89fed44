"""Build-on-first-use of the C++ CPU kernels: a build directory per source, and a build
killed midway does not leave every later server waiting on its lock file."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import torch.utils.cpp_extension

from sgl_spec.kernels import cpu_build


def test_build_dir_is_keyed_by_source_and_honours_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("int f() { return 1; }\n")
    b.write_text("int f() { return 2; }\n")
    da = cpu_build.build_dir("k", a, "avx2")
    assert da == cpu_build.build_dir("k", a, "avx2")
    assert da.parent == tmp_path / "ext" / "sgl_spec" and da.name.startswith("k_avx2_")
    assert cpu_build.build_dir("k", b, "avx2") != da
    assert cpu_build.build_dir("k", a, "avx512") != da


def test_a_lock_left_by_a_killed_build_is_removed_before_building(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    cap = torch.backends.cpu.get_cpu_capability().lower()
    directory = cpu_build.build_dir("k", source, cap)
    directory.mkdir(parents=True)
    # A builder that takes the flock, writes torch's lock file and is killed midway.
    builder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, pathlib, time
        held = open({str(directory) + ".flock"!r}, "w")
        fcntl.flock(held, fcntl.LOCK_EX)
        pathlib.Path({str(directory / "lock")!r}).touch()
        print("holding", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "holding"
    finally:
        builder.kill()
        builder.wait()
    assert (directory / "lock").exists()

    seen = {}

    def fake_load(name, sources, build_directory, **kw):
        seen.update(name=name, dir=build_directory, lock=(directory / "lock").exists())
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    start = time.monotonic()
    assert cpu_build._build("k", source) == "module"
    assert time.monotonic() - start < 30  # the dead builder's flock was released
    assert seen == {"name": f"sgl_spec_k_{cap}", "dir": str(directory), "lock": False}


def test_clear_stale_lock_reports_whether_one_was_there(tmp_path):
    assert cpu_build.clear_stale_lock(tmp_path) is False
    (tmp_path / "lock").touch()
    assert cpu_build.clear_stale_lock(tmp_path) is True
    assert not (tmp_path / "lock").exists()


def test_a_finished_build_is_imported_without_torchs_load(tmp_path, monkeypatch):
    """A second environment (another clone's .venv) imports the stamped build instead of
    letting torch's load rebuild it for its own include paths."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    cap = torch.backends.cpu.get_cpu_capability().lower()
    directory = cpu_build.build_dir("k", source, cap)
    calls = []

    def fake_load(name, sources, build_directory, **kw):
        calls.append(name)
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    assert cpu_build._build("k", source) == "module" and calls == [f"sgl_spec_k_{cap}"]
    assert (directory / cpu_build.STAMP).exists()
    imported = []
    monkeypatch.setattr(cpu_build, "import_built",
                        lambda module, d: imported.append((module, d)) or "the built one")
    assert cpu_build._build("k", source) == "the built one" and len(calls) == 1
    assert imported == [(f"sgl_spec_k_{cap}", directory)]


def test_import_built_needs_the_stamp_and_a_module_that_imports(tmp_path):
    assert cpu_build.import_built("m", tmp_path) is None
    (tmp_path / "m.so").write_bytes(b"not an ELF file")
    assert cpu_build.import_built("m", tmp_path) is None  # no stamp: an unfinished build
    (tmp_path / cpu_build.STAMP).touch()
    assert cpu_build.import_built("m", tmp_path) is None  # does not import: rebuilt
