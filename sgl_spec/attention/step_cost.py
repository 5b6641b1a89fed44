"""Where a sparse decode pays on this hardware: the calibration behind the exact fallback.

A sparse step attends ~B of the history's rows but pays a plan first (a policy's step;
LoopServe's reselection every ``--spec-nd`` steps; SpeContext's head and its elastic
loads). Below some history length that costs more than the dense attention it saves,
and where that length lies depends on the host, the mode and the kernels (measured
profiles: docs/sparse-decode.md), so a server measures it (``prepare_profile``).

``device="cuda"`` times the path a SpeContext server runs on a GPU (the other modes
delegate to sglang's backend there): the head, planning and elastic loads on the GPU,
the loads on a side stream (``--spec-prefetch auto``), the staged rows and the exact
row on the Triton kernel (``CUDA_DECODE_IMPL``), each step eager as served (CUDA graphs
off) and synchronised before the clock stops.

``profile`` times decode steps of sgl_spec's attention path as a server of the sparse
mode runs them (``AttentionCore``: the head's pass, the decoder's plan, one kernel call
per layer, the head's captures at its aux layers) over a KV pool of the model's shape
with scattered slots, at a ladder of history lengths: the *sparse* row with every
history selecting, the *exact* row with ``min_context`` above them all, what the same
server does with a shorter history (SpeContext's head still runs there). The two are
interleaved over ``repeats`` rounds. Each request's last prompt chunk runs through the
core first (what SnapKV scores, what the head's state needs). The model's other work
(projections, MLP) is the same in both, so only attention and planning are timed.
Random weights and KV; the head's inputs drift from step to step (an AR(1) residual
stream) rather than jump, so consecutive selections overlap and the elastic loads move
part of B, as when serving; the profile records the share loaded and the overlap.

``crossover`` is the shortest measured history from which the sparse step is faster at
every longer measured history; a server given the profile (``--spec-decode-profile``)
decodes histories under it exactly (``min_context``), and all of them exactly when the
mode paid at no measured length.

    python -m sgl_spec.calibrate decode --spec-mode specontext [--spec-budget 1024]
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import torch

from sgl_spec.config import MODES, DecodeConfig
from sgl_spec.sparse.policy import AttnShape

from .batch import BatchView
from .core import AttentionCore
from .decode import CUDA_DECODE_IMPL, Decoder

HISTORIES = (1536, 2048, 3072, 4096, 8192, 16384)  # less those the budget covers
# What --spec-decode-profile auto measures at a server's first start: a coarser ladder,
# fewer steps and rounds than calibrate decode's defaults, to keep the start short.
AUTO = {"histories": (2048, 4096, 8192, 16384), "steps": 16, "repeats": 2}
NEVER = sys.maxsize  # min_context of a mode that paid at no measured history
_FORMAT = 1
_LAST_CHUNK = 64  # prompt tokens run through the core before decoding (the rest fills)
_DRIFT = 0.95  # the head's inputs from step to step: x' = a x + sqrt(1 - a^2) noise
# Decode config fields the measured step depends on (a profile must match them).
MATCH = ("mode", "budget", "sink", "window", "nd", "first_select_step", "dense_layers",
         "prefetch")


DTYPES = ("auto", "bfloat16", "float16", "float32")  # calibrate decode --dtype


def kv_dtype(dtype: str | None, kv_cache_dtype: str | None, config: dict | None) -> str:
    """The KV pool dtype of a server given these sglang flags (None: not given): its
    ``--kv-cache-dtype`` unless auto, else the model's ``--dtype``, whose ``auto`` is
    sglang's: the config's dtype if 16-bit, else float16 (bfloat16 for Gemma)."""
    if kv_cache_dtype and kv_cache_dtype != "auto":
        return kv_cache_dtype
    if dtype and dtype != "auto":
        return {"half": "float16", "float": "float32"}.get(dtype, dtype)
    config = config or {}
    given = config.get("dtype") or config.get("torch_dtype")
    if given in ("bfloat16", "float16"):
        return given
    return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"


def shape_of(config: dict) -> dict:
    """The attention shape a profile records, from a model's config.json dict."""
    heads = config["num_attention_heads"]
    return {"num_layers": config["num_hidden_layers"], "num_q_heads": heads,
            "num_kv_heads": config.get("num_key_value_heads") or heads,
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads}


def model_shape(model_path: str, kv_dtype: torch.dtype) -> tuple[AttnShape, int, int]:
    """(the attention shape, hidden size, vocab size) from the model's config.json."""
    with open(os.path.join(model_path, "config.json")) as f:
        c = json.load(f)
    return AttnShape(**shape_of(c), kv_dtype=kv_dtype), c["hidden_size"], c["vocab_size"]


class _Bench:
    """A pool holding ``batch`` requests of ``history`` tokens (plus room for the steps),
    and the attention path of one decode config over it."""

    def __init__(self, cfg: DecodeConfig, shape: AttnShape, hidden: int, vocab: int,
                 batch: int, history: int, steps: int, head=None, seed: int = 0,
                 device: str = "cpu", pool: tuple[list, list] | None = None,
                 host: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.shape, self.hidden, self.vocab, self.batch = shape, hidden, vocab, batch
        self.device = dev = torch.device(device)
        self.gen = torch.Generator().manual_seed(seed)  # small draws, on the CPU
        self.drift: dict[int, torch.Tensor] = {}  # aux layer -> this step's hidden [B, Ht]
        ctx = history + steps + 1
        self.dgen = self.gen if dev.type == "cpu" else torch.Generator(dev).manual_seed(seed)
        self.k, self.v = pool or kv_pool(shape, batch * ctx + 1, dev, self.dgen)
        slots = self.k[0].shape[0]
        if slots < batch * ctx + 1:
            raise ValueError(f"a pool of {slots} slots holds no {batch} x {ctx} tokens")
        # scattered slots, as a pool after some churn
        order = torch.randperm(slots - 1, generator=self.gen) + 1
        self.req_to_token = order[: batch * ctx].view(batch, ctx).to(
            dev, torch.int32).contiguous()
        self.rows = torch.arange(batch, device=dev)
        self.lens = [0] * batch
        self.rids = tuple(f"calib-{i}" for i in range(batch))
        self.ids = torch.randint(0, vocab, (batch,), generator=self.gen).to(dev)
        self.head = None
        policy = None
        if cfg.mode != "exact":
            from sgl_spec.sparse import get_policy

            policy = get_policy(cfg.mode, cfg, shape, dev)
        self.policy = policy
        if head is not None and cfg.retrieval_head:
            from sgl_spec.head.runtime import HeadRuntime, HeadStore

            hk = (slots, head.cfg.num_kv_heads, head.cfg.head_dim)
            keys = torch.zeros(hk, dtype=shape.kv_dtype, device=dev)
            kh = torch.zeros(hk, dtype=shape.kv_dtype, device=dev)
            embed = None
            if head.w.embed is None:
                embed = torch.randn(vocab, head.cfg.hidden_size, generator=self.gen).to(
                    dev, shape.kv_dtype)
            self.head = HeadRuntime(head, HeadStore(lambda: (keys, kh), embed), dev)
            self.aux = head.cfg.resolve_aux_layers(shape.num_layers)
            policy.attach(self.head)
            self._extend(history - _LAST_CHUNK, head_only=True)  # the head's keys
        else:
            self.lens = [history - _LAST_CHUNK] * batch  # no head: the KV is all there is
        self.decoder = Decoder(shape, policy, prefetch=cfg.prefetch,
                               pool_layers=lambda layer: (self.k[layer], self.v[layer]),
                               impl=CUDA_DECODE_IMPL if dev.type == "cuda" else None)
        self.core = AttentionCore(self.decoder, None, self.head)
        self._extend(_LAST_CHUNK)  # the last prompt chunk through the whole path
        self.host = sorted(host or {})
        if host:  # offloaded layers: the decoder's pool reads them from the host copies
            self.k, self.v = list(self.k), list(self.v)
            for j, (hk, hv) in host.items():
                self.k[j], self.v[j] = hk, hv
        self.last_plan = None
        self.q = torch.randn(batch, shape.num_q_heads, shape.head_dim,
                             generator=self.gen).to(dev, shape.kv_dtype)
        self.out = torch.empty_like(self.q)

    def _view(self, mode: str, n: int) -> BatchView:
        """A pass adding ``n`` tokens to every request."""
        seq = tuple(s + n for s in self.lens)
        loc = torch.cat([self.req_to_token[i, s:s + n] for i, s in enumerate(self.lens)]).long()
        # decode: the same token each step, the context drifting (see the module docstring)
        ids = self.ids if mode == "decode" else torch.randint(
            0, self.vocab, (self.batch * n,), generator=self.gen)
        dev = self.device
        return BatchView(mode, self.rids, seq, tuple(range(self.batch)),
                         (n,) * self.batch if mode == "extend" else (), True,
                         self.req_to_token, self.rows, torch.tensor(seq, device=dev),
                         ids.to(dev), loc)

    def _capture(self, layer: int, tokens: int, drift: bool = False) -> None:
        if self.head is None or layer not in self.aux:
            return
        noise = torch.randn(tokens, self.hidden, generator=self.dgen, device=self.device)
        if drift:
            last = self.drift.get(layer, noise)
            noise = self.drift[layer] = _DRIFT * last + (1 - _DRIFT ** 2) ** 0.5 * noise
        self.head.capture(self.aux.index(layer), noise.to(self.shape.kv_dtype))

    def _extend(self, n: int, head_only: bool = False) -> None:
        view = self._view("extend", n)
        if head_only:
            self.head.begin_pass(view)
            for layer in range(self.shape.num_layers):
                self._capture(layer, self.batch * n)
        else:
            plan = self.core.plan(view)
            q = torch.randn(self.batch * n, self.shape.num_q_heads, self.shape.head_dim,
                            generator=self.gen).to(self.device, self.shape.kv_dtype)
            out = torch.empty_like(q)
            for layer in range(self.shape.num_layers):
                self._capture(layer, self.batch * n)
                self.core.run(plan, layer, q, self.k[layer], self.v[layer], out,
                              self.shape.sm_scale)
        self.lens = [s + n for s in self.lens]

    def counts(self) -> dict:
        """What the timed steps did: sparse and exact request-steps, reselections, and
        SpeContext's elastic loads (rows per request-step and KV head) and overlap."""
        st = self.decoder.stats
        out = {"sparse_steps": st.sparse_steps, "exact_steps": st.exact_steps,
               "reselections": st.reselections}
        ps = getattr(self.policy, "stats", None)
        if ps is not None and hasattr(ps, "rows_loaded") and ps.selections:
            out["rows_loaded"] = ps.rows_loaded / (ps.selections * self.shape.num_kv_heads)
            out["overlap"] = ps.mean_overlap
        return out

    def reset_counts(self) -> None:
        self.decoder.stats = type(self.decoder.stats)()
        if self.policy is not None and hasattr(self.policy, "stats"):
            self.policy.stats = type(self.policy.stats)()

    def step(self, ranges: bool = False) -> None:
        """One decode pass of every request, as the server's layers call the core;
        ``ranges``: its stages named for a profiler (``trace``)."""
        named = torch.profiler.record_function if ranges else lambda _: contextlib.nullcontext()
        with named("plan"):
            plan = self.last_plan = self.core.plan(self._view("decode", 1))
        for layer in range(self.shape.num_layers):
            with named("head capture"):
                self._capture(layer, self.batch, drift=True)
            with named("layer"):
                self.core.run(plan, layer, self.q, self.k[layer], self.v[layer], self.out,
                              self.shape.sm_scale)
        self.lens = [s + 1 for s in self.lens]

    def host_copy_s(self, repeats: int = 3) -> float:
        """Seconds of the last pass's loads of the host layers alone (the elastic loads
        and the decoded token's row, every host layer, on the current stream, synced):
        what an offloaded step would wait for if nothing hid it. 0 without host layers
        or staged rows."""
        st = None if self.last_plan is None or self.last_plan.decode is None \
            else self.last_plan.decode.staged
        if not self.host or st is None:
            return 0.0
        ep = st.elastic
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        out = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            for j in self.host:
                bufs = (*self.policy.stage_buffers(j), self.k[j], self.v[j])
                ep.ahead.copy(*bufs)
                ep.current.copy(*bufs)
            sync()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)


def host_layers(pool: tuple[list, list], layers: list[int]
                ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Host copies of ``layers`` of a pool (pinned where it is on a GPU, as
    ``--spec-offload`` moves a layer: ``tiers.offload.to_host``)."""
    from sgl_spec.tiers.offload import to_host

    return {j: (to_host(pool[0][j]), to_host(pool[1][j])) for j in layers}


def kv_pool(shape: AttnShape, slots: int, device, gen: torch.Generator
            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V buffers of ``slots`` rows per layer, as sglang's pool: random rows (the
    time does not depend on them), drawn on the device (a CPU tensor copied in at each
    step would sync the host). One pool serves every point of a profile."""
    kv = (slots, shape.num_kv_heads, shape.head_dim)
    draw = lambda: [torch.randn(kv, generator=gen, device=device).to(shape.kv_dtype)  # noqa: E731
                    for _ in range(shape.num_layers)]
    return draw(), draw()


def _covered(cfg: DecodeConfig) -> int:
    """The longest history the budget, sink, window and the last prompt chunk cover."""
    return _LAST_CHUNK + cfg.budget + cfg.sink + cfg.window


def measurable(cfg: DecodeConfig, histories=HISTORIES) -> tuple[int, ...]:
    """The histories a sparse step of ``cfg`` can be timed at."""
    return tuple(h for h in histories if h > _covered(cfg))


def crossover(histories, exact_s, sparse_s) -> int:
    """The shortest history from which the sparse step was faster at every longer one
    measured; ``NEVER`` if it was not faster at the longest."""
    best = NEVER
    for h, e, s in sorted(zip(histories, exact_s, sparse_s), reverse=True):
        if s >= e:
            break
        best = h
    return best


def check(cfg: DecodeConfig, histories, device: str = "cpu") -> None:
    """ValueError, naming the valid choices, where ``cfg`` at ``histories`` cannot be
    measured on ``device`` (before a model or head is prepared)."""
    if cfg.mode == "exact":
        raise ValueError("--spec-mode exact has nothing to calibrate; valid: "
                         + ", ".join(m for m in MODES if m != "exact"))
    if torch.device(device).type == "cuda" and not cfg.retrieval_head:
        raise ValueError(f"--spec-mode {cfg.mode} decodes through sglang's own backend on "
                         "CUDA (exactly), so there is no sparse step to time there; valid on "
                         "cuda: specontext")
    if torch.device(device).type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not one calibrate decode times; valid: cpu, "
                         "cuda")
    if min(histories) <= _covered(cfg):
        raise ValueError(f"history {min(histories)} is covered by the budget, sink and window "
                         f"({cfg.budget} + {cfg.sink} + {cfg.window}, after a {_LAST_CHUNK}-token "
                         f"last chunk); valid: histories > {_covered(cfg)}")


def profile(model_path: str, cfg: DecodeConfig, histories=HISTORIES, batch: int = 1,
            steps: int = 32, repeats: int = 3, threads: int | None = None,
            progress: bool = True, dtype: str = "bfloat16", device: str = "cpu",
            offload_layers: int = 0) -> dict:
    """Seconds per decode step (attention and planning, every layer) of ``cfg``'s server
    with every history sparse and with none, at each history; ``steps`` timed (for
    LoopServe a multiple of ``nd``, after a warm-up past its first selection), the two
    rows interleaved over ``repeats`` rounds, over a KV pool of ``dtype`` (the served
    model's: ``sgl_spec.cpu`` on bfloat16 without native support), on
    ``device`` (the module docstring). ``offload_layers`` > 0 adds a third row, the
    sparse one with the last ``offload_layers`` layers' KV in host memory (pinned on a
    GPU), as ``--spec-offload`` places them: their elastic loads read the host, on the
    prefetcher's side stream / thread; with each history's host copy time alone and the
    share of it hidden behind compute (1 - the offload row's extra time / the copies').
    ValueError on what cannot be measured (``check``)."""
    from tqdm import tqdm

    check(cfg, histories, device)
    if threads:
        torch.set_num_threads(threads)
    if dtype not in DTYPES[1:]:
        raise ValueError(f"dtype {dtype!r} is not one calibrate decode times; valid: "
                         + ", ".join(DTYPES[1:]))
    shape, hidden, vocab = model_shape(model_path, getattr(torch, dtype))
    head = _load_head(cfg, device) if cfg.retrieval_head else None
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    warm = 2
    if cfg.mode == "loopserve":
        warm = cfg.first_select_step + 2
        steps = -(-steps // cfg.nd) * cfg.nd  # whole reselection intervals
    rows = {"exact": dataclasses.replace(cfg, min_context=NEVER),
            "sparse": dataclasses.replace(cfg, min_context=0)}
    offloaded = offload_plan(cfg, shape.num_layers, offload_layers)
    if offloaded:
        rows["offload"] = rows["sparse"]
    med = {name: [] for name in rows}  # median seconds per step, by history
    runs = {name: [] for name in rows}  # every round's
    counts = []  # the sparse row's last round, by history
    dev = torch.device(device)
    pool = kv_pool(shape, batch * (max(histories) + warm + steps + 1) + 1, dev,
                   torch.Generator(dev).manual_seed(1))
    host = host_layers(pool, offloaded) if offloaded else None
    copy_s = []  # the offload row's host copies alone, by history
    bar = tqdm(total=len(histories) * repeats * len(rows), desc="decode steps", unit="point",
               disable=not progress)
    for h in histories:
        times = {name: [] for name in rows}
        cnt = {}
        copies = []
        for _ in range(repeats):
            for name, c in rows.items():
                bar.set_postfix_str(f"{name} {h} tok x{batch}")
                # The exact row never selects: a short warm-up (LoopServe's reaches past
                # its first selection, for the sparse rows only).
                w = 2 if name == "exact" else warm
                b = _Bench(c, shape, hidden, vocab, batch, h, w + steps, head,
                           device=device, pool=pool, host=host if name == "offload" else None)
                for _ in range(w):
                    b.step()
                b.reset_counts()
                sync()
                t0 = time.perf_counter()
                for _ in range(steps):
                    b.step()
                sync()
                times[name].append((time.perf_counter() - t0) / steps)
                cnt[name] = b.counts()
                if name == "offload":
                    copies.append(b.host_copy_s())
                del b
                bar.update()
        for name in rows:
            med[name].append(statistics.median(times[name]))
            runs[name].append(times[name])
        counts.append(cnt["sparse"])
        if offloaded:
            copy_s.append(statistics.median(copies))
    bar.close()
    cross = crossover(histories, med["exact"], med["sparse"])
    extra = {}
    if offloaded:
        from sgl_spec.kernels.sparse_decode import HOST_COPY

        fallback = HOST_COPY["fallback"]
        extra = {"host_copy": "in place" if fallback is None else f"gathered ({fallback})",
                 "offload_layers": offloaded, "offload_s": med["offload"],
                 "offload_runs_s": runs["offload"], "host_copy_s": copy_s,
                 "hidden_share": [hidden_share(s, o, c) for s, o, c in
                                  zip(med["sparse"], med["offload"], copy_s)]}
    return {
        "format": _FORMAT,
        "hardware": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
        "device": torch.device(device).type, **_gpu(device),
        "model": os.path.abspath(model_path),
        "shape": {k: getattr(shape, k) for k in ("num_layers", "num_q_heads", "num_kv_heads",
                                                 "head_dim")},
        "decode": {k: getattr(cfg, k) for k in MATCH},
        "kv_dtype": dtype,
        "batch": batch, "steps": steps, "repeats": repeats,
        "histories": list(histories),
        "exact_s": med["exact"], "sparse_s": med["sparse"],
        "exact_runs_s": runs["exact"], "sparse_runs_s": runs["sparse"],
        "sparse_counts": counts,
        "crossover": None if cross == NEVER else cross,
        **extra,
    }


def offload_plan(cfg: DecodeConfig, num_layers: int, n: int) -> list[int]:
    """The layers a profile's offload row keeps on the host: the last ``n`` (Algorithm
    2's order), none of the ``--spec-dense-layers`` (they read the whole pool). ValueError
    names the valid range."""
    top = num_layers - cfg.dense_layers
    if n == 0:
        return []
    if not cfg.retrieval_head:
        raise ValueError(f"--offload-layers times SpeContext's offloaded step; --spec-mode "
                         f"{cfg.mode} does not stage its rows; valid: specontext")
    if not 0 < n <= top:
        raise ValueError(f"--offload-layers {n}: valid 0..{top} (the model's {num_layers} "
                         f"layers less {cfg.dense_layers} dense ones)")
    return sorted(num_layers - 1 - j for j in range(n))


def hidden_share(sparse_s: float, offload_s: float, copy_s: float) -> float | None:
    """The share of the host copies' time that an offloaded step did not add to the
    device-resident step: 1 - (offload - sparse) / copies, in [0, 1] (None: no copies)."""
    if copy_s <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - (offload_s - sparse_s) / copy_s))


def trace(model_path: str, cfg: DecodeConfig, history: int, batch: int = 1,
          steps: int | None = None, dtype: str = "bfloat16", device: str = "cpu") -> str:
    """Where a sparse step's time goes: ``steps`` decode steps (default 8; LoopServe's
    ``nd``, one reselection among them) of the sparse row at ``history`` (after a warm-up)
    under ``torch.profiler``, the step's stages as ranges
    (``plan``: the head's query and scores, the selection, the elastic plan and the
    prefetch's start; ``head capture``: the head's keys for the new token; ``layer``:
    one layer's attention). Returns the profiler's table of ops and ranges by host time
    (with their device time on cuda)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    check(cfg, (history,), device)
    if steps is None:  # LoopServe: one reselection interval, so one reselection is in it
        steps = cfg.nd if cfg.mode == "loopserve" else 8
    shape, hidden, vocab = model_shape(model_path, getattr(torch, dtype))
    head = _load_head(cfg, device) if cfg.retrieval_head else None
    # LoopServe decodes densely until its first selection: warm up past it, as profile.
    warm = cfg.first_select_step + 2 if cfg.mode == "loopserve" else 3
    b = _Bench(dataclasses.replace(cfg, min_context=0), shape, hidden, vocab, batch, history,
               steps + warm, head, device=device)
    for _ in range(warm):
        b.step()
    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with torch_profile(activities=acts) as prof:
        for _ in range(steps):
            b.step(ranges=True)
        if cuda:
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cpu_time_total", row_limit=30,
                                     max_name_column_width=48)


def _gpu(device: str) -> dict:
    return {"gpu": torch.cuda.get_device_name(device)} \
        if torch.device(device).type == "cuda" else {}


def _load_head(cfg: DecodeConfig, device: str = "cpu"):
    from sgl_spec.head import eagle3
    from sgl_spec.head.model import RetrievalHead

    head_cfg, weights, n_aux = eagle3.load(cfg.draft_path)
    return RetrievalHead(head_cfg, weights, n_aux, device)


def profile_path(model_path: str, cfg: DecodeConfig, kv: str, device: str = "cpu",
                 cache_dir: str | None = None) -> str:
    """Where the profile that ``--spec-decode-profile auto`` measures for this host,
    model, KV dtype, device and decode flags (``MATCH``) is kept in the cache dir."""
    from sgl_spec import cpu as host_cpu
    from sgl_spec import envs

    key = [_FORMAT, host_cpu.model_name(), os.cpu_count(), os.path.abspath(model_path), kv,
           torch.device(device).type, {k: getattr(cfg, k) for k in MATCH}]
    return envs.keyed_path("decode-profiles", model_path, key,
                           tag=f"-{cfg.mode}-B{cfg.budget}", suffix=".json", root=cache_dir)


def prepare_profile(model_path: str, cfg: DecodeConfig, kv: str, device: str = "cpu",
                    cache_dir: str | None = None) -> str:
    """``profile_path``'s file, measured first where it is missing (``profile`` with the
    ``AUTO`` settings at the histories the budget does not cover, with a progress bar;
    written atomically)."""
    path = profile_path(model_path, cfg, kv, device, cache_dir)
    if os.path.exists(path):
        return path
    histories = measurable(cfg, AUTO["histories"]) or (max(HISTORIES),)
    prof = profile(model_path, cfg, histories, steps=AUTO["steps"], repeats=AUTO["repeats"],
                   dtype=kv, device=device)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(prof, f, indent=1)
    os.replace(tmp, path)
    return path


def read_profile(path: str) -> dict:
    """A profile file (``python -m sgl_spec.calibrate decode --out``), checked.
    OSError / ValueError otherwise."""
    with open(path) as f:
        try:
            prof = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path!r} is not JSON ({exc})") from None
    try:
        ok = (prof["format"] == _FORMAT and isinstance(prof["decode"], dict)
              and all(k in prof["decode"] for k in MATCH)
              and (prof["crossover"] is None or int(prof["crossover"]) >= 0)
              and int(prof["shape"]["num_layers"]) > 0)
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{path!r} is not a decode profile (python -m sgl_spec.calibrate "
                         "decode writes one)")
    return prof


def min_context(prof: dict, cfg: DecodeConfig, shape: dict | None = None,
                kv: str | None = None) -> int:
    """The ``min_context`` a server of ``cfg`` uses with this profile: the larger of its
    own and the profile's crossover (``NEVER`` where the mode paid nowhere). ValueError
    where the profile measured another config, (``shape``, as the profile's) model or
    (``kv``, ``kv_dtype``) KV dtype."""
    diff = [f"{k} {prof['decode'][k]!r} (this server: {getattr(cfg, k)!r})"
            for k in MATCH if prof["decode"][k] != getattr(cfg, k)]
    for k, v in (shape or {}).items():
        if prof["shape"].get(k) != v:
            diff.append(f"{k} {prof['shape'].get(k)} (this model: {v})")
    measured = prof.get("kv_dtype", "bfloat16")  # profiles before the field timed bfloat16
    if kv is not None and measured != kv:
        diff.append(f"a {measured} KV pool (this server: {kv})")
    if diff:
        raise ValueError("the decode profile was measured with " + ", ".join(diff)
                         + "; valid: a profile from python -m sgl_spec.calibrate decode "
                         "with this server's --spec-* decode flags, --dtype and --model-path")
    cross = NEVER if prof["crossover"] is None else int(prof["crossover"])
    return max(cfg.min_context, cross)
