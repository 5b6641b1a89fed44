"""Selection policies: which history positions a request's decode attends to.

A policy decides, per request, layer and KV head, a ``Subset`` (sink + selected
positions + recent window) that ``sgl_spec.kernels.sparse_decode`` attends to.
Call order for one request (one sglang request is one turn):

    policy.start(rid, prompt_len)              after prefill wrote the prompt's K/V
    policy.prefill_layer(rid, layer, q_obs, k) per layer, only if needs_prefill_queries
    loop over decode steps:
        reselect = policy.step(rid, seq_len)   once per step, before the layers
        if policy.attends_layers(rid):         else the step is dense, layers skipped
            policy.decode_layer(rid, layer, q, k)  per layer -> Subset; k only if reselect
    policy.release(rid)                        finished or aborted: frees the state

Every request's state is a ``RequestState`` owned by the policy's ``PolicyStates``
table; nothing else holds it. Policies are not thread-safe: the scheduler thread that
runs the forward pass owns them. Tensors passed in are read, never written or kept,
except LoopServe's copy of each decoded query into its ring.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch

from .params import SparseParams
from .subset import Subset


@dataclass(frozen=True)
class AttnShape:
    """The attention layout a policy serves."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None = None  # softmax scale; None: head_dim ** -0.5

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


@dataclass
class RequestState:
    """Per-request bookkeeping; policies subclass it with their own fields."""

    prompt_len: int
    seq_len: int = 0  # history incl. the current token, as of the last step()
    step: int = -1  # decode steps taken; 0 during the first decode step


S = TypeVar("S", bound=RequestState)


class PolicyStates(Generic[S]):
    """Live per-request states of one policy, keyed by rid."""

    def __init__(self, policy: str):
        self._policy = policy
        self._states: dict[str, S] = {}

    def add(self, rid: str, state: S) -> S:
        if rid in self._states:
            raise ValueError(f"request {rid!r} already has a live {self._policy} state")
        self._states[rid] = state
        return state

    def get(self, rid: str) -> S:
        try:
            return self._states[rid]
        except KeyError:
            raise KeyError(
                f"no live {self._policy} state for request {rid!r}; start() it first "
                f"({len(self._states)} live)"
            ) from None

    def release(self, rid: str) -> bool:
        """Drop the request's state; False if it had none (releasing twice is fine)."""
        return self._states.pop(rid, None) is not None

    def __contains__(self, rid: str) -> bool:
        return rid in self._states

    def __len__(self) -> int:
        return len(self._states)


class SelectionPolicy(ABC):
    """Base of every policy; see the module docstring for the call order."""

    name: ClassVar[str]
    # Whether prefill_layer() must be fed the last prompt queries (SnapKV).
    needs_prefill_queries: ClassVar[bool] = False

    def __init__(self, params: SparseParams, shape: AttnShape):
        self.params = params
        self.shape = shape
        self.states: PolicyStates[RequestState] = PolicyStates(self.name)

    @property
    def live_states(self) -> int:
        return len(self.states)

    def new_state(self, prompt_len: int) -> RequestState:
        return RequestState(prompt_len=prompt_len, seq_len=prompt_len)

    def start(self, rid: str, prompt_len: int) -> None:
        """Create the request's state; its prefill wrote K/V for ``prompt_len`` positions."""
        if prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
        self.states.add(rid, self.new_state(prompt_len))

    def prefill_layer(
        self,
        rid: str,
        layer: int,
        q_obs: torch.Tensor,  # [w, Hq, D] the last w prompt queries of this layer
        k: torch.Tensor,  # [prompt_len, Hkv, D] this layer's prompt keys
    ) -> None:
        """End-of-prefill scoring; a no-op unless ``needs_prefill_queries``."""

    def step(self, rid: str, seq_len: int) -> bool:
        """Advance the request to its next decode step (history ``seq_len`` incl. the
        current token). Returns whether ``decode_layer`` needs the layer's keys now."""
        st = self.states.get(rid)
        if seq_len <= st.seq_len:
            raise ValueError(f"request {rid!r}: seq_len {seq_len} did not grow from {st.seq_len}")
        st.step += 1
        st.seq_len = seq_len
        return self._on_step(st)

    def _on_step(self, st: RequestState) -> bool:
        return False

    def attends_layers(self, rid: str) -> bool:
        """Whether this step's ``decode_layer`` calls matter (after ``step()``).

        False promises that every layer's subset would be dense and that the
        policy keeps nothing of this step's queries: the caller may then decode the
        row exactly without calling ``decode_layer`` (no per-layer work at all).
        """
        return True

    @abstractmethod
    def decode_layer(
        self,
        rid: str,
        layer: int,
        q: torch.Tensor,  # [Hq, D] the current token's query in this layer
        k: torch.Tensor | None = None,  # [seq_len, Hkv, D] this layer's keys, if step() said so
    ) -> Subset:
        """The subset this layer attends to at the current step."""

    def release(self, rid: str) -> bool:
        """Free the request's state (finished or aborted). False if none was live."""
        return self.states.release(rid)


# ------------------------------------------------------------------ registry

PolicyFactory = Callable[[SparseParams, AttnShape], SelectionPolicy]
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


def get_policy(name: str, params: SparseParams, shape: AttnShape) -> SelectionPolicy:
    """A new policy instance (with no live states) for ``name``."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"selection policy {name!r} is unknown; valid: {', '.join(available_policies())}"
        ) from None
    return factory(params, shape)


def _lazy(module: str, cls: str) -> PolicyFactory:
    def factory(params: SparseParams, shape: AttnShape) -> SelectionPolicy:
        return getattr(importlib.import_module(module), cls)(params, shape)

    return factory


for _name, _module, _cls in (
    ("exact", "sgl_spec.sparse.exact", "ExactPolicy"),
    ("streaming", "sgl_spec.sparse.streaming", "StreamingPolicy"),
    ("snapkv", "sgl_spec.sparse.snapkv", "SnapKVPolicy"),
    ("loopserve", "sgl_spec.sparse.loopserve", "LoopServePolicy"),
):
    register_policy(_name, _lazy(_module, _cls))
