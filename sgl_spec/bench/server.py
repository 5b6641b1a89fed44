"""Start, wait for, measure and stop a real sglang server process; empty its cache.

Shared by the test suite and the benchmarks: ``stock`` servers run
``python -m sglang.launch_server``, sgl_spec servers ``python -m
sgl_spec.launch_server``, both from this environment's interpreter.

    >>> with ServerProcess(SPEC, ["--model-path", model]) as server:
    ...     flush_cache(server.url)
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import psutil
import requests

STOCK = "sglang.launch_server"
SPEC = "sgl_spec.launch_server"


# Below sglang's own range for the ports its children bind later (22000-29999, the
# TCPStore's nccl_port): one server's store must not take another's HTTP port.
_LOWEST_PORT, _HIGHEST_PORT = 10000, 22000


def _ephemeral_start() -> int:
    """Where the kernel's range of source ports for outgoing connections begins."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A free TCP port below the kernel's ephemeral range and below sglang's range for
    its late-bound ports. A server binds it only after loading (minutes on this CPU),
    and meanwhile a port of either range can be taken (as the source port of an
    outgoing connection, or by another server's TCPStore), which fails the bind
    ("address already in use"); ``ServerProcess.start`` retries then."""
    top = min(_ephemeral_start(), _HIGHEST_PORT)
    if top - _LOWEST_PORT >= 1000:
        rng = random.Random()
        for _ in range(100):
            port = rng.randrange(_LOWEST_PORT, top)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str, lines: int = 40) -> str:
    """The last lines of a server log, without sglang's per-model "Ignore import
    error" lines (dozens on CPU) that would crowd out what went wrong."""
    try:
        with open(path, errors="replace") as f:
            kept = [line for line in f if "Ignore import error" not in line]
    except OSError:
        return "(no log)"
    return "".join(kept[-lines:])


class ServerStartError(RuntimeError):
    pass


def flush_cache(url: str, attempts: int = 120) -> None:
    """Empty the server's radix cache, so that no measurement starts with another's
    prefixes cached. sglang refuses while a request is still finishing (its answer
    can reach the client first) or HiCache is still writing back: retried every 0.5 s,
    then RuntimeError."""
    for _ in range(attempts):
        r = requests.post(url.rstrip("/") + "/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url}/flush_cache answered {r.status_code}: {r.text[:200]}")


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL the launcher when its parent dies (Linux prctl), so a
    killed test run or benchmark leaves no server spinning on the CPU. sglang's
    scheduler and detokenizer die with the launcher (they set the same signal). It
    imports nothing: it runs in the forked child, where an import could wait on a lock
    another thread of the parent held at the fork."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class ServerProcess:
    """A server run as ``python -m <module> <args> --host 127.0.0.1 --port N``.

    Use as a context manager; ``url`` is ready (``/health`` answered 200) inside.
    The process group is killed on exit. ``peak_rss_bytes`` is the largest sum of
    RSS over the server's process tree seen by a 0.5 s sampler.
    """

    module: str
    args: list[str] = field(default_factory=list)
    port: int = 0
    log_path: str | None = None
    env: dict[str, str] | None = None
    timeout_s: float = 240.0
    proc: subprocess.Popen | None = None
    peak_rss_bytes: int = 0
    _stop_sampler: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, retries: int = 2) -> "ServerProcess":
        """Launch (unless ``launch`` already did) and wait until healthy; a server whose
        port was taken while it loaded is launched again on another port."""
        if self.proc is None:
            self.launch()
        try:
            self.wait_healthy()
        except ServerStartError:
            if not (retries and self._lost_port()):
                raise
            self.port, self.log_path, self.proc = 0, None, None
            return self.start(retries - 1)
        threading.Thread(target=self._sample_memory, daemon=True).start()
        return self

    def launch(self) -> "ServerProcess":
        """Start the process and return at once; ``start`` waits for it. A caller
        with other work to do (a test session's unit tests) lets it boot meanwhile."""
        if not self.port:
            self.port = free_port()
        self._prepare_head()
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix=f"sglang-{self.port}-", suffix=".log")
            os.close(fd)
        cmd = [sys.executable, "-m", self.module, *self.args,
               "--host", "127.0.0.1", "--port", str(self.port)]
        env = dict(os.environ, **(self.env or {}))
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )
        return self

    def _lost_port(self) -> bool:
        """Did the server fail to bind its port (taken by another process meanwhile)?"""
        try:
            with open(self.log_path) as f:
                log = f.read()
        except OSError:
            return False
        return f"{self.port}): address already in use" in log

    def _prepare_head(self) -> None:
        """A specontext server without --spec-draft-path trains its model's head on its
        first start (minutes): do it here, with a progress bar, not inside the health
        timeout."""
        a = self.args
        if (self.module != SPEC or "--spec-draft-path" in a or "--spec-mode" not in a
                or a[a.index("--spec-mode") + 1] != "specontext"):
            return
        from sgl_spec.launch_server import _value
        from sgl_spec.prepare_model import prepare as prepare_model
        from sgl_spec.train_head import prepare

        prepare(_value(a, "--model-path") or prepare_model())

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.module} exited with code {self.proc.returncode} before "
                    f"becoming healthy; log {self.log_path}:\n{tail(self.log_path)}"
                )
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(
            f"{self.module} not healthy after {self.timeout_s:.0f} s; "
            f"log {self.log_path}:\n{tail(self.log_path)}"
        )

    def _sample_memory(self) -> None:
        while not self._stop_sampler.wait(0.5):
            try:
                root = psutil.Process(self.proc.pid)
                procs = [root, *root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in procs if p.is_running())
            except psutil.Error:
                continue
            self.peak_rss_bytes = max(self.peak_rss_bytes, rss)

    def stop(self) -> None:
        self._stop_sampler.set()
        if self.proc is None or self.proc.poll() is not None:
            return
        # SIGKILL the whole group: sglang's launcher can sit on SIGTERM for minutes
        # with its scheduler already gone, and a server holds no state worth saving.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
