"""The layer-tiered pool's pieces without sglang: the upper tier's slot accounting across
alloc, free, evict (a round stored to the host) and restore, as a property test; round
blocks round-trip their rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sgl_spec.tiers import blocks
from sgl_spec.tiers.free_list import FreeList
from sgl_spec.tiers.working_set import UpperSlots

FULL, UPPER, LAYERS, HEADS, DIM = 48, 20, 2, 2, 4


class TieredPool(RuleBasedStateMachine):
    """A model of the upper tier: ``expected[full slot]`` is the [LAYERS, 2, HEADS, DIM]
    KV that slot's token must read at the upper layers while mapped; ``host`` holds the
    rounds stored to blocks (their full slots and expected rows)."""

    def __init__(self):
        super().__init__()
        self.slots = UpperSlots(FULL, UPPER)
        self.k = [torch.full((UPPER, HEADS, DIM), float("nan")) for _ in range(LAYERS)]
        self.v = [torch.full((UPPER, HEADS, DIM), float("nan")) for _ in range(LAYERS)]
        self.expected: dict[int, torch.Tensor] = {}
        self.host: list[tuple[list[int], blocks.RoundBlock, dict[int, torch.Tensor]]] = []
        self.step = 0

    def _unmapped(self) -> list[int]:
        held = {s for full, _, _ in self.host for s in full}
        return [s for s in range(FULL) if s not in self.expected and s not in held]

    def _write(self, full: list[int], upper: torch.Tensor) -> None:
        for i, s in enumerate(full):
            self.step += 1
            kv = torch.full((LAYERS, 2, HEADS, DIM), float(self.step))
            kv += torch.arange(LAYERS * 2.0).view(LAYERS, 2, 1, 1) / 10
            for layer in range(LAYERS):
                self.k[layer][upper[i]] = kv[layer, 0]
                self.v[layer][upper[i]] = kv[layer, 1]
            self.expected[s] = kv

    @rule(data=st.data(), n=st.integers(1, 8))
    def alloc(self, data, n):
        pool = self._unmapped()
        if not pool:
            return
        full = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=n, unique=True))
        free_before = self.slots.available()
        upper = self.slots.assign(torch.tensor(full))
        if upper is None:
            assert free_before < len(full) and self.slots.available() == free_before
            return
        self._write(full, upper)

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def free(self, data):
        full = data.draw(st.lists(st.sampled_from(sorted(self.expected)), min_size=1,
                                  unique=True))
        # a finished request frees its slots, some of them perhaps never mapped
        extra = [s for s in self._unmapped()[:2]]
        assert self.slots.release(torch.tensor(full + extra)) == len(full)
        for s in full:
            del self.expected[s]

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def evict(self, data):
        full = data.draw(st.lists(st.sampled_from(sorted(self.expected)), min_size=1,
                                  unique=True))
        idx = torch.tensor(full)
        block = blocks.store(self.k, self.v, self.slots.translate(idx))
        assert block.tokens == len(full) and block.nbytes == len(full) * LAYERS * 2 * HEADS \
            * DIM * 4
        self.host.append((full, block, {s: self.expected.pop(s) for s in full}))
        assert self.slots.release(idx) == len(full)

    @precondition(lambda self: self.host)
    @rule(data=st.data())
    def restore(self, data):
        i = data.draw(st.integers(0, len(self.host) - 1))
        full, block, rows = self.host[i]
        upper = self.slots.assign(torch.tensor(full))
        if upper is None:
            assert self.slots.available() < len(full)
            return
        blocks.load(block, self.k, self.v, upper)
        self.expected.update(rows)
        del self.host[i]

    @invariant()
    def accounting_holds(self):
        assert self.slots.check() == []
        assert self.slots.used() == len(self.expected)
        assert self.slots.used() + self.slots.available() == UPPER

    @invariant()
    def every_mapped_slot_reads_its_own_rows(self):
        for s, kv in self.expected.items():
            u = int(self.slots.translate(torch.tensor([s]))[0])
            assert u >= 0
            for layer in range(LAYERS):
                assert torch.equal(self.k[layer][u], kv[layer, 0])
                assert torch.equal(self.v[layer][u], kv[layer, 1])


TestTieredPool = TieredPool.TestCase
TestTieredPool.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


class SharedHolds(RuleBasedStateMachine):
    """Requests holding full slots at the upper tier, some shared (a round two running
    questions selected): a slot is mapped exactly while someone holds it, never twice."""

    def __init__(self):
        super().__init__()
        self.slots = UpperSlots(FULL, UPPER)
        self.holds: list[list[int]] = []  # one list of full slots per running request

    @rule(data=st.data(), n=st.integers(1, 8))
    def acquire(self, data, n):
        full = data.draw(st.lists(st.integers(0, FULL - 1), min_size=1, max_size=n,
                                  unique=True))
        before = self.slots.translate(torch.tensor(full)).clone()
        got = self.slots.acquire(torch.tensor(full))
        if got is None:
            assert torch.equal(self.slots.translate(torch.tensor(full)), before)
            return
        upper, new = got
        assert torch.equal(new, before < 0)
        assert torch.equal(upper[~new], before[~new])  # shared: the same upper slot
        self.holds.append(full)

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def drop(self, data):
        full = self.holds.pop(data.draw(st.integers(0, len(self.holds) - 1)))
        still = {s for h in self.holds for s in h}
        freed = self.slots.drop(torch.tensor(full))
        assert freed == len([s for s in full if s not in still])

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def rekey(self, data):
        """sglang frees a request's slot of a token the tree holds in another slot and
        points the request there: the hold follows (the tree's slot unmapped: the upper
        slot moves with it, rows untouched; mapped: shared)."""
        h = self.holds[data.draw(st.integers(0, len(self.holds) - 1))]
        count: dict[int, int] = {}
        for s in (s for hold in self.holds for s in hold):
            count[s] = count.get(s, 0) + 1
        own = [s for s in h if count[s] == 1]
        if not own:
            return
        src = data.draw(st.sampled_from(own))
        dst = data.draw(st.sampled_from([s for s in range(FULL) if s not in h]))
        upper = int(self.slots.translate(torch.tensor([src]))[0])
        moved = int(self.slots.translate(torch.tensor([dst]))[0]) < 0
        self.slots.rekey(torch.tensor([src]), torch.tensor([dst]))
        h[h.index(src)] = dst
        assert int(self.slots.translate(torch.tensor([src]))[0]) == -1
        if moved:
            assert int(self.slots.translate(torch.tensor([dst]))[0]) == upper

    @invariant()
    def held_exactly_while_someone_holds_it(self):
        assert self.slots.check() == []
        count: dict[int, int] = {}
        for h in self.holds:
            for s in h:
                count[s] = count.get(s, 0) + 1
        mapped = self.slots.translate(torch.arange(FULL))
        assert sorted(torch.nonzero(mapped >= 0).flatten().tolist()) == sorted(count)
        for s, c in count.items():
            assert int(self.slots.refs[int(mapped[s])]) == c


TestSharedHolds = SharedHolds.TestCase
TestSharedHolds.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_slot_is_owned_once_and_padding_translates_to_padding():
    slots = UpperSlots(8, 4)
    up = slots.assign(torch.tensor([1, 5]))
    assert sorted(up.tolist()) == [0, 1]
    with pytest.raises(ValueError, match="already mapped: \\[5\\]"):
        slots.assign(torch.tensor([5, 6]))
    with pytest.raises(ValueError, match="repeated"):
        slots.assign(torch.tensor([6, 6]))
    assert slots.assign(torch.tensor([2, 3, 4])) is None and slots.available() == 2
    assert slots.translate(torch.tensor([5, -1, 7])).tolist() == [int(up[1]), -1, -1]
    slots.map[7] = int(up[0])  # a corruption the check must name
    assert "an upper slot is mapped from two full slots" in slots.check()
    with pytest.raises(ValueError, match="need 0 < upper size"):
        UpperSlots(4, 8)


def test_a_double_free_is_refused():
    fl = FreeList(4)
    got = fl.pop(3)
    fl.push(got[:1])
    with pytest.raises(RuntimeError, match="double free"):
        fl.push(got[:2])
    assert fl.pop(5) is None and fl.count == 2


def test_a_block_loads_back_into_other_slots_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(16, 2, 8, generator=g).to(torch.bfloat16) for _ in range(3)]
    v = [torch.randn(16, 2, 8, generator=g).to(torch.bfloat16) for _ in range(3)]
    block = blocks.store(k, v, torch.tensor([3, 9, 4]))
    assert block.data.shape == (3, 2, 3, 2, 8) and block.data.dtype == torch.bfloat16
    blocks.load(block, k, v, torch.tensor([10, 11, 12]))
    for layer in range(3):
        assert torch.equal(k[layer][10:13], k[layer][[3, 9, 4]])
        assert torch.equal(v[layer][10:13], v[layer][[3, 9, 4]])
    with pytest.raises(ValueError, match="a block of 3 tokens x 3 layers into 2 slots"):
        blocks.load(block, k, v, torch.tensor([1, 2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_block_is_pinned_and_round_trips_while_its_slots_are_reused():
    g = torch.Generator(device="cuda").manual_seed(0)
    k = [torch.randn(4096, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
         for _ in range(13)]
    v = [torch.randn(4096, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
         for _ in range(13)]
    rows = torch.randperm(4096, device="cuda", generator=g)[:700]
    want = [b[rows].cpu() for b in k]
    block = blocks.store(k, v, rows)
    for b in k:  # the next round writes into the freed slots, queued after the copy
        b[rows] = 0
    block.wait()
    assert block.data.is_pinned() and block.data.device.type == "cpu"
    assert all(torch.equal(block.data[i, 0], want[i]) for i in range(13))
    other = torch.arange(100, 800, device="cuda")
    blocks.load(block, k, v, other)
    torch.cuda.synchronize()
    assert all(torch.equal(k[i][other].cpu(), want[i]) for i in range(13))


def test_a_slot_listed_twice_is_two_holds():
    slots = UpperSlots(FULL, UPPER)
    slots.acquire(torch.tensor([3, 4]))
    slots.acquire(torch.tensor([3]))
    assert slots.drop(torch.tensor([3, 3, 4])) == 2 and slots.used() == 0
    assert slots.check() == []
