"""Data and tensor parallelism through sgl_spec's launcher (no server): ``--tp-size`` and
``--dp-size`` reach sglang's ServerArgs untouched, and on CPU hosts the launcher gives
each rank its own cores where ranks outnumber NUMA nodes (sglang asserts otherwise)."""

from __future__ import annotations

import os

import pytest

from sgl_spec import envs
from sgl_spec.integration.cpu.threads import bind_groups, ranks_in, set_default_bind
from sgl_spec.launch_server import sglang_argv, split_argv


@pytest.mark.parametrize("nodes, ranks, value", [
    ([[0, 1]], 2, "0|1"),
    ([[0, 1, 2, 3]], 2, "0-1|2-3"),
    ([[0, 1, 2, 3, 4]], 2, "0-1|2-3"),  # an odd core is left out, groups stay equal
    ([[0, 2, 4, 6]], 2, "0,2|4,6"),
    ([[0, 1, 2, 3], [4, 5, 6, 7]], 4, "0-1|2-3|4-5|6-7"),
    ([[0, 1], [2, 3]], 2, None),  # one node per rank: sglang's default binding
    ([[0, 1]], 1, None),
    ([[0, 1]], 3, None),  # fewer cores than ranks: left to sglang's assertion
], ids=["2cores-dp2", "4cores-dp2", "5cores-dp2", "sparse", "2nodes-4ranks", "2nodes-2ranks",
        "one-rank", "too-few-cores"])
def test_bind_groups_split_the_cores_evenly(nodes, ranks, value):
    assert bind_groups(nodes, ranks) == value


def test_ranks_are_dp_times_tp_times_pp():
    assert ranks_in(["--dp-size", "2", "--tp-size=2"]) == 4
    assert ranks_in(["--dp", "2", "--pp-size", "3"]) == 6
    assert ranks_in(["--model-path", "/m"]) == 1


def test_a_user_binding_or_a_single_rank_is_left_alone(monkeypatch):
    monkeypatch.setenv(envs.SGLANG_CPU_OMP_THREADS_BIND, "0-3|4-7")
    assert set_default_bind(["--dp-size", "2"]) is None
    assert os.environ[envs.SGLANG_CPU_OMP_THREADS_BIND] == "0-3|4-7"
    monkeypatch.delenv(envs.SGLANG_CPU_OMP_THREADS_BIND)
    assert set_default_bind(["--tp-size", "1"]) is None
    assert envs.SGLANG_CPU_OMP_THREADS_BIND not in os.environ


@pytest.mark.slow
def test_tp_and_dp_sizes_pass_through_to_sglang_server_args(model_path):
    from sglang.srt.server_args import prepare_server_args

    from sgl_spec.integration import plugin

    plugin.register()  # "sgl_spec" becomes a valid --attention-backend choice
    cfg, rest = split_argv(["--model-path", model_path, "--tp-size", "2", "--dp-size", "2",
                            "--spec-cache-eviction", "turn"])
    assert cfg.cache.eviction == "turn"
    args = prepare_server_args(sglang_argv(cfg, rest, cpu=True))
    assert (args.tp_size, args.dp_size) == (2, 2)
    assert (args.attention_backend, args.radix_cache_backend) == ("sgl_spec", "sgl_spec")


class _Stop(Exception):
    pass


class _Controller:
    """What the DP controller's event loop touches: its socket, watchdog and dispatcher."""

    def __init__(self, sock, expected: int):
        self.recv_from_tokenizer = sock
        self.feeds = 0
        self.dispatched: list = []
        self.expected = expected
        self.soft_watchdog = self

    def feed(self) -> None:
        self.feeds += 1

    def _request_dispatcher(self, req) -> None:
        self.dispatched.append(req)
        if len(self.dispatched) == self.expected:
            raise _Stop


@pytest.mark.slow
def test_dp_controller_waits_for_requests_and_dispatches_them_in_order(monkeypatch):
    """The stock loop spins (~1M watchdog feeds a second while idle); the patched one
    blocks in poll: over 0.3 s idle it feeds once, then dispatches every request."""
    import threading
    import time

    import zmq
    from sglang.srt.managers import data_parallel_controller as dpc
    from sglang.srt.managers.io_struct import sock_send

    from sgl_spec.integration.cpu import dp_controller

    monkeypatch.setattr(dpc.DataParallelController, "event_loop",
                        dpc.DataParallelController.event_loop)  # restored after the test
    dp_controller.patch_event_loop(dpc)
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://sgl-spec-dp-test")
    push.connect("inproc://sgl-spec-dp-test")
    ctl = _Controller(pull, expected=3)
    errors: list = []

    def run():
        try:
            dpc.DataParallelController.event_loop(ctl)
        except _Stop:
            pass
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    time.sleep(0.3)
    assert ctl.feeds == 1 and ctl.dispatched == []
    for i in range(3):
        sock_send(push, {"req": i})
    worker.join(timeout=5)
    assert not worker.is_alive() and errors == []
    assert ctl.dispatched == [{"req": 0}, {"req": 1}, {"req": 2}]
    push.close(linger=0)
    pull.close(linger=0)


# ---- cache-aware DP dispatch (sgl_spec.integration.dp_dispatch) ---------------------

def _conversation(seed: int, turns: int) -> list[list[int]]:
    """Each turn's prompt: the previous prompt, an answer and a question (ids)."""
    import random

    rng = random.Random(seed)
    prompt, out = [rng.randrange(50_000) for _ in range(300)], []
    for _ in range(turns):
        out.append(list(prompt))
        prompt += [rng.randrange(50_000) for _ in range(80)]
    return out


def test_a_conversations_turns_stay_on_one_rank_and_new_ones_round_robin():
    from sgl_spec.integration.dp_dispatch import PrefixIndex

    index = PrefixIndex(ranks=2)
    convs = [_conversation(seed, turns=3) for seed in range(4)]
    first = [index.choose(c[0], [0, 1]) for c in convs]  # nothing cached: round robin
    assert first == [0, 1, 0, 1]
    for turn in (1, 2):  # interleaved, as concurrent clients send them
        assert [index.choose(c[turn], [0, 1]) for c in convs] == first
    assert index.choose(convs[1][2], [0]) == 0  # rank 1 unusable: the usable one
    assert index.choose([7] * 10, [0, 1]) in (0, 1)  # shorter than a block


def test_a_prompt_sharing_under_half_its_blocks_is_not_pinned_and_lru_is_bounded():
    from sgl_spec.integration.dp_dispatch import BLOCK, PrefixIndex, block_hashes

    index = PrefixIndex(ranks=2, max_blocks=16)
    base = list(range(10 * BLOCK))
    assert index.choose(base, [0, 1]) == 0
    other = base[: 4 * BLOCK] + [9] * (6 * BLOCK)  # 4 of 10 blocks shared
    assert index.choose(other, [0, 1]) == 1  # round robin, not rank 0
    assert len(block_hashes(base)) == 10 and block_hashes(base[:BLOCK + 3])[0] == \
        block_hashes(base)[0]
    for i in range(40):  # rank 0 forgets the oldest prompts' blocks, deepest first
        index.choose([10_000 + i] * (2 * BLOCK), [0])
    assert len(index._blocks[0]) == 16


def test_the_controller_dispatches_by_prefix_only_when_sgl_spec_asks(monkeypatch):
    """Wrapped __init__: sgl_spec's config (cache_aware) and sglang's round robin ->
    the prefix dispatch; routed requests keep their rank; --spec-dp-dispatch sglang or
    no sgl_spec config leave sglang's dispatch."""
    from types import SimpleNamespace

    from sglang.srt.managers import data_parallel_controller as dpc

    from sgl_spec.config import CacheConfig, SpecConfig
    from sgl_spec.integration import dp_dispatch

    sent = []

    class Controller:
        def __init__(self):
            self.load_balance_method = dpc.LoadBalanceMethod.ROUND_ROBIN
            self.workers, self._active_workers, self.status = ["w0", "w1"], [0, 1], [1, 1]
            self.dispatching = "sglang's"

        def maybe_external_dp_rank_routing(self, req):
            if req.routed_dp_rank is None:
                return False
            sent.append(("routed", req.routed_dp_rank))
            return True

    module = SimpleNamespace(DataParallelController=Controller,
                             LoadBalanceMethod=dpc.LoadBalanceMethod,
                             sock_send=lambda worker, req: sent.append(worker))
    dp_dispatch.patch_controller(module)
    dp_dispatch.patch_controller(module)  # idempotent
    monkeypatch.delenv(envs.SGLSPEC_CONFIG, raising=False)
    assert Controller().dispatching == "sglang's"
    monkeypatch.setenv(envs.SGLSPEC_CONFIG,
                       SpecConfig(cache=CacheConfig(dp_dispatch="sglang")).to_json())
    assert Controller().dispatching == "sglang's"
    monkeypatch.setenv(envs.SGLSPEC_CONFIG, SpecConfig().to_json())
    ctl = Controller()
    turns = _conversation(1, turns=2)
    for ids, routed in ((turns[0], None), (_conversation(2, 1)[0], None), (turns[1], None),
                        (turns[1], 0)):
        ctl.dispatching(SimpleNamespace(input_ids=ids, routed_dp_rank=routed))
    assert sent == ["w0", "w1", "w0", ("routed", 0)]


def test_on_cpu_hosts_the_dp_controller_gets_both_patches():
    from sgl_spec.integration.cpu import hooks

    hooks.install(cpu=True)
    hooks.install(cpu=True)  # idempotent: not chained twice
    name = "sglang.srt.managers.data_parallel_controller"
    assert hooks.AFTER[name].__name__ == "patch_controller+patch_event_loop"
