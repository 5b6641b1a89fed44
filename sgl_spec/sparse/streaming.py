"""``streaming``: StreamingLLM's sink + sliding recent window; nothing is selected.

Histories that ``use_exact`` keeps dense (shorter than min_context, or covered by
budget + sink + window) decode exactly, as under the other sparse policies.
"""

from __future__ import annotations

from .policy import EXACT_STEP, Kind, RowStep, SelectionPolicy
from .slots import BufferSpec


class StreamingPolicy(SelectionPolicy):
    name = "streaming"

    @property
    def width(self) -> int:
        return 0

    def buffers(self) -> dict[str, BufferSpec]:
        return {}

    def selection(self, layer, slots):
        return slots.new_empty(slots.shape[0], self.shape.num_kv_heads, 0)

    def _on_step(self, st) -> RowStep:
        if self.cfg.use_exact(st.seq_len):
            return EXACT_STEP
        return RowStep(Kind.SPARSE, st.seq_len - self.cfg.window)
