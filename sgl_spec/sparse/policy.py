"""Selection policies: which history positions a request's decode attends to.

A policy decides, per request, layer and KV head, which positions the decode step
attends: the sink, a selection of ``width`` positions (``budget``, or 0 for
streaming) and the recent window from ``recent_start`` on (the contract of
``sgl_spec.kernels.sparse_decode.common``). It is driven by
``sgl_spec.attention.decode.Decoder`` in two halves:

* host side, once per forward pass and request: ``step(rid, seq_len) -> RowStep``
  advances the request's state machine and says what this step needs;
* device side, once per layer and batched over the rows that need it:
  ``observe`` (keep the step's queries), ``reselect`` (score the history, store a new
  selection), ``selection`` (the stored selections of the sparse rows).

Call order for one request (one sglang request is one turn)::

    policy.start(rid, prompt_len)              after prefill wrote the prompt's K/V
    policy.prefill_layer(rid, layer, q_obs, k) per layer, only if it scores_prompt()
    loop over decode steps:
        row = policy.step(rid, seq_len)        once per step, before the layers
        per layer, batched over rows: observe / reselect / selection
    policy.release(rid)                        finished, aborted or retracted

Host state is a ``RequestState`` per rid; device state (selections, LoopServe's query
ring) lives in a ``SlotTable`` whose slot the request holds until released. Policies
are not thread-safe: the scheduler thread that runs the forward pass owns them.
Tensors passed in are read, never kept, except the rows copied into the slot table.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch

from .slots import BufferSpec, SlotTable

if TYPE_CHECKING:
    from sgl_spec.config import DecodeConfig


@dataclass(frozen=True)
class AttnShape:
    """The attention layout a policy serves (per tensor-parallel rank)."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    kv_dtype: torch.dtype = torch.float32  # the KV pool's (staging copies keep it)

    def __post_init__(self):
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads {self.num_q_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )

    @property
    def sm_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim**-0.5


class Kind(IntEnum):
    EXACT = 0  # dense attention; the policy needs nothing of this step
    OBSERVE = 1  # dense attention; the policy keeps this step's queries
    SPARSE = 2  # attends sink + selection + recent window


class RowStep(NamedTuple):
    """What one request's decode step needs (``SelectionPolicy.step``)."""

    kind: Kind
    recent_start: int = 0  # SPARSE: first position of the recent window
    reselect: bool = False  # SPARSE: select anew, in every layer, before attending
    observe: int = -1  # >= 0: keep this step's query at this ring index


EXACT_STEP = RowStep(Kind.EXACT)


@dataclass
class RequestState:
    """Per-request host bookkeeping; policies subclass it with their own fields."""

    prompt_len: int
    slot: int
    seq_len: int = 0  # history incl. the current token, as of the last step()
    step: int = -1  # decode steps taken; 0 during the first decode step


class SelectionPolicy(ABC):
    """Base of every policy; see the module docstring for the call order."""

    name: ClassVar[str]
    # Whether prefill_layer() must be fed the last prompt queries (SnapKV): a request
    # starts its state there or decodes exactly. scores_prompt() may also ask for them.
    needs_prefill_queries: ClassVar[bool] = False
    # Whether select_pass() selects once per pass, before the layers, for every layer
    # (SpeContext); otherwise selection() is read per layer.
    selects_per_pass: ClassVar[bool] = False
    # Whether the sparse rows attend a staging copy of their subset (stage(),
    # stage_buffers(): SpeContext's elastic loading) instead of the pool in place.
    stages_kv: ClassVar[bool] = False

    def __init__(self, cfg: DecodeConfig, shape: AttnShape, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.shape = shape
        self.states: dict[str, RequestState] = {}
        self.slots = SlotTable(shape.num_layers, self.buffers(), device)

    @property
    def width(self) -> int:
        """Selected positions per KV head of a sparse row (the same in every layer)."""
        return self.cfg.budget

    def buffers(self) -> dict[str, BufferSpec]:
        """The slot table's per-request, per-layer rows; ``sel``: the selection."""
        return {"sel": BufferSpec((self.shape.num_kv_heads, self.width), torch.int64)}

    @property
    def live_states(self) -> int:
        return len(self.states)

    def new_state(self, prompt_len: int, slot: int) -> RequestState:
        return RequestState(prompt_len, slot, seq_len=prompt_len)

    def start(self, rid: str, prompt_len: int) -> RequestState:
        """Create the request's state; its prefill wrote K/V for ``prompt_len`` positions."""
        if prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
        if rid in self.states:
            raise ValueError(f"request {rid!r} already has a live {self.name} state")
        st = self.states[rid] = self.new_state(prompt_len, self.slots.acquire(rid))
        return st

    def release(self, rid: str) -> bool:
        """Free the request's state (finished or aborted). False if none was live."""
        self.slots.release(rid)
        return self.states.pop(rid, None) is not None

    def state(self, rid: str) -> RequestState:
        try:
            return self.states[rid]
        except KeyError:
            raise KeyError(f"no live {self.name} state for request {rid!r}; start() it first "
                           f"({len(self.states)} live)") from None

    def step(self, rid: str, seq_len: int) -> RowStep:
        """Advance the request to its next decode step (history ``seq_len`` incl. the
        current token) and say what the step needs."""
        st = self.state(rid)
        if seq_len <= st.seq_len:
            raise ValueError(f"request {rid!r}: seq_len {seq_len} did not grow from {st.seq_len}")
        st.step += 1
        st.seq_len = seq_len
        return self._on_step(st)

    @abstractmethod
    def _on_step(self, st: RequestState) -> RowStep: ...

    def scores_prompt(self) -> bool:
        """Whether a long prompt's state starts at its prefill, fed its last
        ``prefill_window`` queries per layer (``prefill_layer``)."""
        return self.needs_prefill_queries

    @property
    def prefill_window(self) -> int:
        """How many of the prompt's last queries ``prefill_layer`` is fed."""
        return self.cfg.window

    def prefill_layer(
        self,
        rid: str,
        layer: int,
        q_obs: torch.Tensor,  # [w, Hq, D] the last w prompt queries of this layer
        k: torch.Tensor,  # [prompt_len, Hkv, D] this layer's prompt keys
    ) -> None:
        """End-of-prefill scoring; a no-op unless ``scores_prompt()``."""

    def observe(
        self,
        layer: int,
        q: torch.Tensor,  # [R, Hq, D] this layer's queries of the observing rows
        slots: torch.Tensor,  # [R] int64 their slots
        ring: torch.Tensor,  # [R] int64 their RowStep.observe indices
    ) -> None:
        """Keep the step's queries (LoopServe); others never ask to observe."""
        raise NotImplementedError(f"{self.name} does not observe queries")

    def reselect(
        self,
        layer: int,
        keys: torch.Tensor,  # [R, N, Hkv, D] this layer's keys of the reselecting rows, padded
        batch: ReselectBatch,
    ) -> None:
        """Score the rows' histories and store their new selections (LoopServe)."""
        raise NotImplementedError(f"{self.name} does not reselect while decoding")

    def reselect_batch(self, rids: list[str], device: torch.device) -> ReselectBatch:
        """Host-side inputs of ``reselect`` for rows stepped with ``reselect=True``."""
        sts = [self.state(r) for r in rids]
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return ReselectBatch(
            slots=t([s.slot for s in sts]),
            seq_lens=t([s.seq_len for s in sts]),
            lo=t([min(self.cfg.sink, s.seq_len) for s in sts]),
            hi=t([s.seq_len - self.cfg.window for s in sts]),
            q_pos=None,
        )

    def selection(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """``[S, Hkv, width]`` int64: the stored selections of the rows in ``slots``."""
        return self.slots.rows("sel", layer, slots)

    def select_pass(self, batch, rows: list[int]) -> torch.Tensor:
        """``[R, Hkv, width]`` int64: the selections of a decode pass's sparse ``rows``
        (indices into ``batch``, a ``BatchView``), for every layer; only policies with
        ``selects_per_pass``."""
        raise NotImplementedError(f"{self.name} selects per layer")


class ReselectBatch(NamedTuple):
    slots: torch.Tensor  # [R] int64
    seq_lens: torch.Tensor  # [R] int64 keys per row
    lo: torch.Tensor  # [R] int64 first candidate (the sink's end)
    hi: torch.Tensor  # [R] int64 one past the last candidate (the recent window's start)
    q_pos: torch.Tensor | None  # [R, n] int64 positions of the observed queries, -1 unused


# ------------------------------------------------------------------ registry

PolicyFactory = Callable[["DecodeConfig", AttnShape, "torch.device | str"], SelectionPolicy]
_REGISTRY: dict[str, PolicyFactory] = {}


def register_policy(name: str, factory: PolicyFactory) -> PolicyFactory:
    """Register a policy factory (e.g. the class) under ``name``; duplicates are errors."""
    if name in _REGISTRY:
        raise ValueError(
            f"selection policy {name!r} is already registered; registered: "
            f"{', '.join(available_policies())}"
        )
    _REGISTRY[name] = factory
    return factory


def available_policies() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_policy(name: str, cfg: DecodeConfig, shape: AttnShape,
               device: torch.device | str = "cpu") -> SelectionPolicy:
    """A new policy instance (with no live states) for ``name``."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"selection policy {name!r} is unknown; valid: {', '.join(available_policies())}"
        ) from None
    return factory(cfg, shape, device)


def _lazy(module: str, cls: str) -> PolicyFactory:
    def factory(cfg, shape, device="cpu") -> SelectionPolicy:
        return getattr(importlib.import_module(module), cls)(cfg, shape, device)

    return factory


for _name, _module, _cls in (
    ("streaming", "sgl_spec.sparse.streaming", "StreamingPolicy"),
    ("snapkv", "sgl_spec.sparse.snapkv", "SnapKVPolicy"),
    ("loopserve", "sgl_spec.sparse.loopserve", "LoopServePolicy"),
    ("specontext", "sgl_spec.sparse.specontext", "SpeContextPolicy"),
):
    register_policy(_name, _lazy(_module, _cls))
