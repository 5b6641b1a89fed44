"""Krul's recompute pre-pass inside sglang (Sec 6; docs/design/krul.md §5).

With a restore profile whose host tier chooses a share > 0 (``--spec-krul-profile``),
a demoted node keeps no rows for the first positions of each layer (a pyramid, most at
layer 0), and HiCache's load-back brings back the rest. The tree still reports the whole
path host-resident, so sglang's ``load_back`` allocates device slots for every token and
queues the load; ``TaggedRadixCache.load_back`` then calls ``recompute``, which fills
the unstored rows by running the model's own layers on those tokens
(``sgl_spec.krul.prepass``). The pre-pass needs only the device-resident prefix and what
it computes itself, so it can overlap the load (``--spec-krul-restore pipelined``;
``auto``, the default, pipelines on a GPU only): ``start`` issues it and returns;
sglang's loader then copies the stored rows (on a CPU in line, in the scheduler thread,
while the pre-pass runs on a worker thread; on a GPU on the loader's stream, while the
pre-pass's kernels run on the compute stream: not served on a GPU; timed there outside
sglang by ``calibrate restore --pipeline-share``); ``join``,
called once the load ran and before the batch that reads those rows, waits for it.
``serial`` runs the pre-pass to completion first (what the overlap is measured against:
the restore clock's ``recompute_seconds``, ``load_seconds`` and ``overlap_seconds``).

The model runner comes from the cache's links to the attention path
(``radix.CoreLinks.runner``: sgl_spec's backend's runner); without one, or for a model that
is not Llama-shaped, or with pipeline parallelism, ``unsupported`` names the reason and
the share is 0.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.mem_cache.unified_cache.unified_tree_core import BASE_COMPONENT_TYPE

from sgl_spec.attention.extend import exact_extend
from sgl_spec.krul import prepass
from sgl_spec.tiers.arena import UNSTORED
from sgl_spec.krul.pyramid import restore_lengths

logger = logging.getLogger(__name__)

def unsupported(runner) -> str | None:
    """Why ``runner`` (the model runner whose layers the pre-pass runs, None where the
    attention backend is not sgl_spec's) cannot recompute a restore's front, or None."""
    if runner is None:
        return "the attention backend is not sgl_spec's (--attention-backend sgl_spec binds the model)"
    from sglang.srt.runtime_context import get_parallel

    if get_parallel().pp_group.world_size > 1:
        return "pipeline parallelism (a rank holds only some layers)"
    layers = getattr(getattr(runner.model, "model", None), "layers", None)
    need = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    if not layers or not all(hasattr(lyr, a) for lyr in layers for a in need) or not all(
            hasattr(lyr.self_attn, a) for lyr in layers
            for a in ("qkv_proj", "rotary_emb", "o_proj", "attn")):
        return f"{type(runner.model).__name__} is not a Llama/Qwen2-shaped model"
    return None


def _reduce(module, x: torch.Tensor) -> torch.Tensor:
    """The all-reduce sglang's layer boundary does after a row-parallel projection."""
    if getattr(module, "reduce_results", True) or getattr(module, "tp_size", 1) == 1:
        return x
    from sglang.srt.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(x)


class SglangOps:
    """``prepass.LayerOps`` over an sglang Llama / Qwen2 model: its own modules, so the
    recomputed KV is rounded as a prefill's."""

    def __init__(self, model):
        self.model = model.model
        self.layers = self.model.layers
        self.num_layers = len(self.layers)

    def embed(self, ids):
        return self.model.embed_tokens(ids)

    def qkv(self, layer, x, positions):
        a = self.layers[layer].self_attn
        qkv, _ = a.qkv_proj(x)
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q, k = a.rotary_emb(positions, q, k)
        r = a.attn
        m = x.shape[0]
        return (q.reshape(m, r.tp_q_head_num, r.qk_head_dim),
                k.reshape(m, r.tp_k_head_num, r.qk_head_dim),
                v.reshape(m, r.tp_v_head_num, r.v_head_dim))

    def attn_out(self, layer, o):
        a = self.layers[layer].self_attn
        out, _ = a.o_proj(o.reshape(o.shape[0], -1))
        return _reduce(a.o_proj, out)

    def norm(self, layer, which, h, residual):
        lyr = self.layers[layer]
        norm = lyr.input_layernorm if which == 0 else lyr.post_attention_layernorm
        if residual is None:
            return norm(h), h
        return norm(h, residual)

    def mlp(self, layer, x):
        mlp = self.layers[layer].mlp
        return _reduce(mlp.down_proj, mlp(x))

    def scale(self, layer):
        return self.layers[layer].self_attn.attn.scaling


class RestorePlan(NamedTuple):
    """A load-back's recompute, from the path as it was before the load."""

    node: object             # the load's deepest node
    device_prefix: int       # D: tokens whose KV stayed on the device
    lengths: tuple[int, ...]  # R per model layer: recompute [D, R_l)


def path(node, root) -> list:
    """The nodes from the root's child down to ``node``."""
    out = []
    while node is not None and node is not root:
        out.append(node)
        node = node.parent
    return out[::-1]


def plan(node, root, arena, num_layers: int) -> RestorePlan | None:
    """What a load-back of ``node`` must recompute: the unstored rows of its host-only
    nodes (the arena's maps), as pyramid lengths; None when every row is stored."""
    pos, D, unstored = 0, None, [0] * num_layers
    for nd in path(node, root):
        cd = nd.component_data[BASE_COMPONENT_TYPE]
        if cd.value is None and cd.host_value is not None:
            D = pos if D is None else D
            gone = (arena.map[:num_layers, cd.host_value.cpu().long()] == UNSTORED)
            counts = gone.sum(dim=1).tolist()       # a node's unstored rows lead its slots
            unstored = [max(u, pos + c) if c else u for u, c in zip(unstored, counts)]
        pos += len(nd.key)
    if D is None or not any(unstored):
        return None
    return RestorePlan(node, D, restore_lengths(unstored, D, pos))


class Recompute:
    """Runs restore plans after sglang's load-back allocated their device slots, pipelined
    with the load (``start`` ... ``join``) or not; counts them (``GET /sgl_spec/cache``)."""

    def __init__(self, runner, mode: str = "auto"):
        self.runner = runner  # the model runner whose layers run (unsupported: None)
        self.mode = mode  # --spec-krul-restore: auto (pipelined on a GPU), pipelined, serial
        self.restores = 0
        self.token_layers = 0
        self.seconds = 0.0
        self._pending: list[Future] = []
        self._cuda_pending = False
        self._started: float | None = None  # when the first unjoined pre-pass was issued
        self._batch_seconds = 0.0  # the unjoined pre-passes' own time
        self._worker: ThreadPoolExecutor | None = None

    def start(self, p: RestorePlan, root) -> None:
        """Issue ``p``'s pre-pass: pipelined, it runs while sglang's loader copies the
        stored rows, and ``join`` waits for it; serial, it runs to completion now."""
        if not self.pipelined:
            self._batch_seconds += self.run(p, root)
            return
        if self._started is None:
            self._started = time.perf_counter()
        if self._device().type == "cuda":
            self._batch_seconds += self.run(p, root, sync=False)
            self._cuda_pending = True
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="sgl_spec-krul-restore")
        self._pending.append(self._worker.submit(self.run, p, root))

    def join(self) -> tuple[float, float | None]:
        """Wait for the issued pre-passes (before any batch reads their rows); returns
        their own seconds and the seconds since the first was issued (None: serial, or
        none pending), and resets. A pre-pass's exception is raised here."""
        started, self._started = self._started, None
        pending, self._pending = self._pending, []
        try:
            for f in pending:
                self._batch_seconds += f.result()
            if self._cuda_pending:
                self._cuda_pending = False
                # The extend that follows may run on sglang's forward stream (overlap
                # scheduling): it must see these rows. Unverified on a GPU.
                torch.cuda.current_stream(self._device()).synchronize()
        finally:
            own, self._batch_seconds = self._batch_seconds, 0.0
        return own, None if started is None else time.perf_counter() - started

    def _device(self) -> torch.device:
        return self.runner.token_to_kv_pool.get_key_buffer(0).device

    @property
    def pipelined(self) -> bool:
        """Whether a pre-pass overlaps the load: ``auto`` on a GPU only. On a CPU a host
        copy is a small part of a restore that recomputes, and the pre-pass runs slower on
        a worker thread than in the scheduler's: it costs more than it hides
        (docs/design/krul.md §18)."""
        if self.mode == "auto":
            return self.runner is not None and self._device().type == "cuda"
        return self.mode == "pipelined"

    def run(self, p: RestorePlan, root, sync: bool = True) -> float:
        """``p``'s pre-pass, to completion (``sync``: also on a GPU); its seconds."""
        nodes = path(p.node, root)
        slots = torch.cat([nd.component_data[BASE_COMPONENT_TYPE].value for nd in nodes])
        D, R = p.device_prefix, p.lengths
        ids = []
        pos = 0
        for nd in nodes:
            end = pos + len(nd.key)
            if end > D and pos < R[0]:
                toks = list(nd.key.token_ids[:len(nd.key)])
                ids.extend(toks[max(D - pos, 0):R[0] - pos])
            pos = end
        runner = self.runner
        pool = runner.token_to_kv_pool
        dev = pool.get_key_buffer(0).device
        slots = slots.to(dev).long()
        ops = SglangOps(runner.model)

        def write(layer, start, k, v):
            loc = slots[start:start + k.shape[0]]
            pool.set_kv_buffer(ops.layers[layer].self_attn.attn, KVWriteLoc(loc, None), k, v)

        def attend(layer, q, end):
            lid = ops.layers[layer].self_attn.attn.layer_id
            idx = slots[:end]
            k = pool.get_key_buffer(lid).index_select(0, idx)
            v = pool.get_value_buffer(lid).index_select(0, idx)
            return exact_extend(q, k, v, D, ops.scale(layer))

        t0 = time.perf_counter()
        with torch.inference_mode():
            done = prepass.run(ops, torch.tensor(ids, dtype=torch.int64, device=dev), D, R,
                               write, attend)
        if dev.type == "cuda" and sync:
            torch.cuda.current_stream(dev).synchronize()
        took = time.perf_counter() - t0
        self.seconds += took
        self.restores += 1
        self.token_layers += done
        logger.debug("sgl_spec krul: recomputed %d token-layers of a restore (prefix %d, "
                     "R_0 %d)", done, D, R[0])
        return took

    def totals(self) -> dict:
        return {"recomputed_restores": self.restores,
                "recomputed_token_layers": self.token_layers,
                "recompute_seconds": round(self.seconds, 4),
                "restore_pipeline": "pipelined" if self.pipelined else "serial"}
