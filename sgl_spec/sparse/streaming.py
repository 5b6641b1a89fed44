"""``streaming``: StreamingLLM's sink + sliding recent window; nothing is selected.

Histories that ``use_exact`` keeps dense (shorter than min_context, or covered by
budget + sink + window) decode exactly, as under the other sparse policies.
"""

from __future__ import annotations

import torch

from .params import use_exact
from .policy import SelectionPolicy
from .subset import Subset, dense_subset


class StreamingPolicy(SelectionPolicy):
    name = "streaming"

    def attends_layers(self, rid: str) -> bool:
        return not use_exact(self.states.get(rid).seq_len, self.params)

    def decode_layer(
        self, rid: str, layer: int, q: torch.Tensor, k: torch.Tensor | None = None
    ) -> Subset:
        st = self.states.get(rid)
        empty = dense_subset(self.shape.num_kv_heads, q.device)
        if use_exact(st.seq_len, self.params):
            return empty
        return Subset(empty.sel_idx, st.seq_len - self.params.window)
