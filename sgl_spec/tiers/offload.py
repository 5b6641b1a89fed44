"""SpeContext's adaptive memory management (Sec. 6.2, Algorithms 1-2): which layers' KV a
generation keeps on the device as it grows.

``thresholds`` is Algorithm 1: the sequence lengths S_0 <= S_1 <= ... <= S_L past which
one more layer (the last first) must leave the device for R requests' KV to fit in the
memory left after the weights. ``on_host`` is Algorithm 2's inner loop: the layers on the
host at length S. ``Placement`` runs Algorithm 2 on a server's pool: its tokens in use in
place of R x S, layers leaving as they grow and coming back when the pool drains. In bytes;
``to_host`` / ``to_device`` are the moves (one copy of a layer's buffer each); the pool
they run on is sglang's (``sgl_spec.integration.tiers.offload``, docs/design/offload.md).

Equation 7 of the paper, with this project's names: the device holds the weights (x1.3
for the runtime's activations), the full KV of the ``L - i`` layers still on it plus the
retrieval head's one layer and ``alpha`` layers of GQA expansion buffer (sgl_spec's
kernels expand no heads: 0), and ``budget`` selected rows of each of the ``i`` offloaded
layers, per request::

    M(i, S) = 1.3 * weights + R * row * ((L - i + 1 + alpha) * S + i * budget)

with ``row`` the bytes of one token's K and V at one layer (2 x kv_heads x head_dim x
element bytes; the paper's "4HD" in fp16). S_i is the largest S with M(i, S) <= memory.
The paper's Algorithm 1 leaves the element and K/V factor out of the buffer term
(``i x B x R x H x D``); Equation 7 has it, and so has this.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

RUNTIME_FACTOR = 1.3  # the paper's runtime memory: 30% of the weights


class Shape(NamedTuple):
    """What Algorithm 1 reads from the model and the workload."""

    layers: int          # L: the model's decoder layers
    kv_heads: int        # H (KV heads)
    head_dim: int        # D
    element_bytes: int   # of the KV dtype (2: fp16 / bf16)
    head_layers: int = 1     # the retrieval head's own KV layer (SpeContext's "+1")
    alpha: float = 0.0       # GQA expansion buffer, in layers (0: no heads expanded)

    @property
    def row_bytes(self) -> int:
        """One token's K and V at one layer."""
        return 2 * self.kv_heads * self.head_dim * self.element_bytes


def thresholds(memory: int, weights: int, requests: int, budget: int,
               shape: Shape) -> list[int]:
    """Algorithm 1: ``[S_0, ..., S_L]``, S_i the longest sequence at which ``requests``
    requests fit with their last ``i`` layers offloaded (``budget`` rows each left on the
    device). ``memory``: device bytes for weights and KV; ``weights``: the model's and
    the head's. ValueError where even S_0 is negative (the weights alone do not fit)."""
    if requests < 1 or budget < 0 or shape.layers < 1:
        raise ValueError(f"requests >= 1, budget >= 0 and layers >= 1; got {requests}, "
                         f"{budget}, {shape.layers}")
    free = memory - RUNTIME_FACTOR * weights
    if free < 0:
        raise ValueError(f"the weights ({weights} bytes, x{RUNTIME_FACTOR} with the runtime's) "
                         f"do not fit in {memory} bytes")
    per = requests * shape.row_bytes
    out = []
    for i in range(shape.layers + 1):
        resident = shape.layers - i + shape.head_layers + shape.alpha
        out.append(int((free - i * budget * per) // (resident * per)))
    return out


def on_host(length: int, limits: list[int]) -> int:
    """Algorithm 2's inner loop: how many layers (the last ones) are on the host at
    sequence length ``length`` given ``thresholds``' ``limits``: the first i with
    length < S_i (all L when none)."""
    n = 0
    while n < len(limits) - 1 and length >= limits[n]:
        n += 1
    return n


def last_layers(layers: int, n: int) -> list[int]:
    """The last ``n`` of ``layers`` layers, the last first (the order Algorithm 2 offloads
    them)."""
    return [layers - 1 - j for j in range(n)]


def host_layers(length: int, limits: list[int]) -> list[int]:
    """The layer indices on the host at ``length``: the last ``on_host`` ones."""
    return last_layers(len(limits) - 1, on_host(length, limits))


class Move(NamedTuple):
    """What one ``Placement.update`` changed: layers to offload now (the last first) and
    layers back on the device (all of them, when the pool drained)."""

    offload: list[int]
    reload: list[int]


class Placement:
    """Algorithm 2 on a server's pool (docs/design/offload.md, "How it maps onto a
    server"): the pool keeps one set of offloaded layers, the last ``offloaded`` ones,
    moved by its tokens in use in place of the paper's R x S. With ``running`` requests,
    Algorithm 1 for one "request" of that many tokens and ``budget`` x ``running`` rows
    per offloaded layer gives the token counts past which one more layer leaves. Layers
    only leave while tokens are in use; all come back when the pool drains (the paper
    never moves one back while it runs). Every layer is on exactly one tier."""

    def __init__(self, memory: int, weights: int, budget: int, shape: Shape):
        thresholds(memory, weights, 1, budget, shape)  # ValueError: nothing fits
        self.memory, self.weights, self.budget, self.shape = memory, weights, budget, shape
        self.offloaded = 0

    def host(self) -> list[int]:
        """The layers on the host, the last first (the order they left)."""
        return last_layers(self.shape.layers, self.offloaded)

    def device(self) -> list[int]:
        return list(range(self.shape.layers - self.offloaded))

    def limits(self, running: int, reserved: int = 0) -> list[int]:
        """Algorithm 1 over the pool: S_i in tokens in use, ``running`` requests, with
        ``reserved`` device bytes taken first (buffers that do not depend on the placement:
        sgl_spec's staging rows). All zeros where nothing fits beside the reserve."""
        try:
            return thresholds(self.memory - reserved, self.weights, 1,
                              self.budget * max(1, running), self.shape)
        except ValueError:
            return [0] * (self.shape.layers + 1)

    def update(self, tokens: int, running: int, reserved: int = 0) -> Move:
        """After a grow, finish, abort or retraction: the pool holds ``tokens`` tokens of
        ``running`` requests (``reserved``: as ``limits``)."""
        if tokens < 0 or running < 0 or reserved < 0:
            raise ValueError(f"tokens, running and reserved must be >= 0; got {tokens}, "
                             f"{running}, {reserved}")
        if tokens == 0:
            back, self.offloaded = sorted(self.host()), 0
            return Move([], back)
        want = on_host(tokens, self.limits(running, reserved))
        if want <= self.offloaded:
            return Move([], [])
        before = self.offloaded
        self.offloaded = want
        return Move(self.host()[before:], [])


def to_host(buf: torch.Tensor) -> torch.Tensor:
    """A layer's pool buffer copied to the host tier (pinned where it comes from a GPU, so
    that loads from it can be asynchronous); one copy."""
    out = torch.empty(buf.shape, dtype=buf.dtype, device="cpu", pin_memory=buf.is_cuda)
    out.copy_(buf)
    return out


def to_device(buf: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host buffer copied back to the device tier; one copy (a new tensor on CPU too)."""
    return buf.to(device, copy=True)
