"""The llama.cpp peer's parts that need no build: the build's progress, the tools it
needs (a missing compiler is a clear error), the server's command line. The build itself
is opt-in (python -m sgl_spec.bench.peers build) and never runs in CI."""

from __future__ import annotations

import pytest

from sgl_spec.bench import peers


def test_progress_is_read_off_cmakes_lines():
    assert peers.progress_of("[ 42%] Building CXX object common/CMakeFiles/x.o") == 42
    assert peers.progress_of("[100%] Built target llama-server") == 100
    assert peers.progress_of("-- Configuring done") is None


def test_a_missing_compiler_or_cmake_is_named(monkeypatch, tmp_path):
    assert peers.missing_tools(lambda name: f"/usr/bin/{name}") == []
    lacking = peers.missing_tools(lambda name: None)
    assert lacking == ["cmake (>= 3.14)", "a C++17 compiler (g++ or clang++)"]
    only_cc = peers.missing_tools(lambda name: "/usr/bin/cmake" if name == "cmake" else None)
    assert only_cc == ["a C++17 compiler (g++ or clang++)"]
    monkeypatch.setattr(peers, "missing_tools", lambda: ["a C++17 compiler (g++ or clang++)"])
    with pytest.raises(peers.PeerError, match="needs a C\\+\\+17 compiler.*apt-get install"):
        peers.build(cache_dir=str(tmp_path))


def test_the_cli_refuses_what_it_cannot_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SGLSPEC_CACHE_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        peers.main(["gguf", "--model-path", str(tmp_path)])
    assert exc.value.code == 2 and "peers build" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        peers.main(["gguf", "--model-path", str(tmp_path), "--outtype", "q8"])
    assert exc.value.code == 2 and "invalid choice: 'q8'" in capsys.readouterr().err


def test_the_server_runs_on_this_hosts_cores_with_its_prompt_cache(tmp_path):
    argv = peers.server_argv("/m.gguf", 30100, parallel=4, ctx=8192, cache_dir=str(tmp_path))
    assert argv[0].endswith("bin/llama-server") and argv[argv.index("-m") + 1] == "/m.gguf"
    assert argv[argv.index("--parallel") + 1] == "4"
    assert argv[argv.index("-c") + 1] == str(4 * 8192)  # each slot gets ctx
    assert "--cache-prompt" in argv and int(argv[argv.index("-t") + 1]) >= 1
    assert not peers.is_built(str(tmp_path))
