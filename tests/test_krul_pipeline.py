"""Krul's restore pre-pass pipelined with the load (``krul_restore.Recompute``): issued
by the load-back, run on a worker thread while the scheduler thread copies the stored
rows, joined before the batch reads them; ``serial`` runs it at once. The pre-pass
itself is replaced by a timed sleep here (the server test runs the real one)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")
from sgl_spec.integration.tiers.krul_restore import Recompute  # noqa: E402

PREPASS_S = 0.3


def _recompute(pipelined: bool) -> tuple[Recompute, list[str]]:
    pool = SimpleNamespace(get_key_buffer=lambda i: torch.zeros(1))
    r = Recompute(SimpleNamespace(token_to_kv_pool=pool),
                  "pipelined" if pipelined else "serial")
    ran_on: list[str] = []

    def run(p, root, sync=True):
        ran_on.append(threading.current_thread().name)
        if p == "bad":
            raise RuntimeError("pre-pass failed")
        time.sleep(PREPASS_S)
        return PREPASS_S

    r.run = run
    return r, ran_on


def test_pipelined_pre_pass_runs_beside_the_copy_and_join_waits_for_it():
    r, ran_on = _recompute(pipelined=True)
    t0 = time.perf_counter()
    r.start("plan", None)
    assert time.perf_counter() - t0 < PREPASS_S / 3  # issued, not run here
    time.sleep(PREPASS_S)  # the scheduler thread's in-line copy
    own, wall = r.join()
    took = time.perf_counter() - t0
    assert ran_on and ran_on[0] != threading.current_thread().name
    assert own == pytest.approx(PREPASS_S)
    assert wall is not None and wall == pytest.approx(took, abs=0.05)
    assert took < 1.6 * PREPASS_S  # about max(T_C, T_L), not their sum
    assert r.join() == (0.0, None)  # nothing pending: reset


def test_two_pre_passes_of_one_batch_are_joined_together():
    r, ran_on = _recompute(pipelined=True)
    r.start("a", None)
    r.start("b", None)
    own, wall = r.join()
    assert len(ran_on) == 2 and own == pytest.approx(2 * PREPASS_S)
    assert wall >= 2 * PREPASS_S * 0.95  # one worker: one after the other


def test_serial_pre_pass_runs_at_start_in_the_calling_thread():
    r, ran_on = _recompute(pipelined=False)
    t0 = time.perf_counter()
    r.start("plan", None)
    assert time.perf_counter() - t0 >= PREPASS_S * 0.95
    assert ran_on == [threading.current_thread().name]
    own, wall = r.join()
    assert own == pytest.approx(PREPASS_S) and wall is None


def test_a_failed_pre_pass_raises_at_join_and_leaves_nothing_pending():
    r, _ = _recompute(pipelined=True)
    r.start("bad", None)
    with pytest.raises(RuntimeError, match="pre-pass failed"):
        r.join()
    assert r.join() == (0.0, None)


def test_auto_pipelines_on_a_gpu_only():
    pool = SimpleNamespace(get_key_buffer=lambda i: torch.zeros(1))  # a CPU pool
    assert not Recompute(SimpleNamespace(token_to_kv_pool=pool), "auto").pipelined
    assert Recompute(SimpleNamespace(token_to_kv_pool=pool), "pipelined").pipelined
    assert not Recompute(None, "auto").pipelined  # no runner: no pre-pass at all
    cuda = SimpleNamespace(get_key_buffer=lambda i: SimpleNamespace(device=torch.device("cuda")))
    assert Recompute(SimpleNamespace(token_to_kv_pool=cuda), "auto").pipelined
    assert Recompute(SimpleNamespace(token_to_kv_pool=cuda), "auto").totals()[
        "restore_pipeline"] == "pipelined"
