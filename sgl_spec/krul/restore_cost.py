"""What a restore costs on this hardware: the calibration behind the recompute share.

Krul restores a demoted conversation by recomputing the first part of its history
while the rest is loaded (``krul.pyramid``); the share that balances the two comes
from two measured costs (``pyramid.RestoreCost``):

* ``recompute_s``: seconds per token per layer of a prefill of the history, the
  target model in the serving dtype on the serving device (a forward of ``tokens``
  random ids; its weights do not change the time, so ``--random-weights`` builds the
  model from its config alone, for hosts that have the config but not the weights);
  with ``--pipeline-share``, the served pre-pass's own cost instead (``measure_pipeline``:
  on a GPU its kernel launches can cost more than a forward's), and the share
  of a restore the pipeline hid (``overlap_of``), which ``host_share`` then uses;
* ``load_s`` per tier: seconds per row (one token, one layer, K and V) to bring a
  stored conversation into a device KV buffer: ``host`` reads the arena through its
  codec and copies each layer to the device as the host pool's per-layer load does;
  ``file`` first reads each page back from a file and loads it into the arena, as the
  ``file`` storage backend and ``KrulHostPool.set_from_flat_data_page`` do (the OS
  page cache is warm: a cold disk costs more).

    python -m sgl_spec.calibrate restore [--model-path DIR] [--device cuda]   # JSON profile
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from sgl_spec.tiers.arena import Arena
from .pyramid import RestoreCost, choose_share, pyramid, restore_time, times

TIERS = ("host", "file")
_FORMAT = 1


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> ModelShape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers,
                   getattr(config, "num_key_value_heads", None) or heads, head_dim)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, repeats: int, device: torch.device) -> float:
    fn()                                   # warm-up (kernels, caches, allocator)
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def load_model(model_path: str, dtype: torch.dtype, device: torch.device,
               random_weights: bool = False):
    """The target in transformers (sdpa attention), eval mode, on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if random_weights:
        config = AutoConfig.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                     attn_implementation="sdpa")
    return model.to(device).eval()


@torch.no_grad()
def measure_recompute(model, tokens: int, repeats: int, device: torch.device) -> float:
    """Seconds per token per layer of a ``tokens``-long prefill (median of repeats)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen).to(device)
    t = _median_time(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1),
                     repeats, device)
    return t / (tokens * model.config.num_hidden_layers)


def _filled_arena(shape: ModelShape, tokens: int, dtype: torch.dtype, codec: str
                  ) -> tuple[Arena, torch.Tensor]:
    L, H, D = shape.num_layers, shape.kv_heads, shape.head_dim
    arena = Arena(tokens, L, tokens * L, H, D, dtype, codec=codec)
    slots = arena.alloc(tokens)
    gen = torch.Generator().manual_seed(0)
    for layer in range(L):
        k, v = (torch.randn(tokens, H, D, generator=gen).to(dtype) for _ in range(2))
        arena.write(layer, slots, k, v)
    return arena, slots


@torch.no_grad()
def measure_load(shape: ModelShape, tokens: int, dtype: torch.dtype, codec: str,
                 tier: str, repeats: int, device: torch.device) -> float:
    """Seconds per row to bring ``tokens`` stored tokens of every layer from ``tier``
    into device buffers (median of repeats)."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; valid: {', '.join(TIERS)}")
    L, H, D = shape.num_layers, shape.kv_heads, shape.head_dim
    arena, slots = _filled_arena(shape, tokens, dtype, codec)
    dev_k = [torch.empty(tokens, H, D, dtype=dtype, device=device) for _ in range(L)]
    dev_v = [torch.empty_like(b) for b in dev_k]
    dev_idx = torch.arange(tokens, device=device)

    def to_device():
        load_into(arena, slots, dev_k, dev_v, dev_idx)

    if tier == "host":
        t = _median_time(to_device, repeats, device)
    else:
        with tempfile.TemporaryDirectory(prefix="sgl-spec-restore-") as d:
            paths = []
            for s in slots.tolist():         # one page per token (--page-size 1)
                paths.append(os.path.join(d, f"{s}.bin"))
                arena.export(torch.tensor([s])).numpy().tofile(paths[-1])

            def from_file():
                for s, path in zip(slots.tolist(), paths):
                    page = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
                    if not arena.load(torch.tensor([s]), page):
                        raise RuntimeError(f"page {path} failed its checksum")
                to_device()

            t = _median_time(from_file, repeats, device)
    return t / (tokens * L)


def load_into(arena: Arena, slots: torch.Tensor, dev_k: list[torch.Tensor],
              dev_v: list[torch.Tensor], dev_idx: torch.Tensor) -> None:
    """Every layer's rows of ``slots`` into the device buffers at ``dev_idx``, one layer
    at a time (what ``KrulHostPool.load_to_device_per_layer`` does per layer)."""
    for layer in range(arena.L):
        k, v, _ = arena.read(layer, slots)
        dev_k[layer][dev_idx] = k.to(dev_idx.device, non_blocking=True)
        dev_v[layer][dev_idx] = v.to(dev_idx.device, non_blocking=True)


@torch.no_grad()
def measure_pipeline(model, tokens: int, share: float, dtype: torch.dtype, codec: str,
                     repeats: int, device: torch.device) -> dict:
    """A restore of a ``tokens``-long conversation at a forced recompute ``share``, run
    serially and as a pipeline, as ``--spec-krul-restore`` runs it (median seconds of
    ``repeats``, the orders interleaved):

    * the recompute T_C: the pre-pass (``prepass.run``, the served loop) over the model's
      own layers (transformers' modules: ``hf_ops``) for the pyramid's unstored rows;
    * the load T_L: every layer's stored rows read from the arena through its codec into
      the device buffers (``Arena.read_into``, what the Krul host pool's per-layer load
      does), on a side stream on CUDA (as sglang's loader: its load stream);
    * serial: the recompute to completion, then the load; pipelined: the recompute
      issued first (CUDA: its kernels queued on the compute stream; CPU: on a worker
      thread), the load meanwhile, then both joined; on CUDA also ``pipelined_thread``:
      the pre-pass launched from a worker thread while this one loads (both halves are
      host work where the GPU is fast: kernel launches, the codec's reads).

    Not sglang's loader or model modules (a GPU machine without sglang can run this)."""
    from concurrent.futures import ThreadPoolExecutor

    from sgl_spec.attention.extend import exact_extend

    from . import prepass
    from .hf_ops import HFOps
    from .pyramid import restore_lengths

    shape = ModelShape.of(model.config)
    L, H, D = shape.num_layers, shape.kv_heads, shape.head_dim
    unstored = pyramid(tokens, L, share)
    R = restore_lengths(unstored, 0, tokens)
    arena, slots = _filled_arena(shape, tokens, dtype, codec)
    dev_k = [torch.zeros(tokens, H, D, dtype=dtype, device=device) for _ in range(L)]
    dev_v = [torch.zeros_like(b) for b in dev_k]
    dst = torch.arange(tokens, device=device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (R[0],), generator=gen).to(device)
    ops = HFOps(model)
    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None

    def write(layer, start, k, v):
        dev_k[layer][start:start + k.shape[0]] = k
        dev_v[layer][start:start + v.shape[0]] = v

    def attend(layer, q, end):
        return exact_extend(q, dev_k[layer][:end], dev_v[layer][:end], 0, ops.scale(layer))

    def recompute():
        with torch.no_grad():
            prepass.run(ops, ids, 0, R, write, attend)

    def load():
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            for layer, u in enumerate(unstored):
                arena.read_into(layer, slots[u:], dev_k[layer], dev_v[layer], dst[u:])
        if cuda:
            side.synchronize()

    worker = ThreadPoolExecutor(1, thread_name_prefix="sgl_spec-krul-restore")

    def pipelined():
        if cuda:
            recompute()  # queued on the compute stream; the load runs while it drains
            load()
        else:
            job = worker.submit(recompute)
            load()
            job.result()

    def pipelined_thread():  # CUDA: the pre-pass launched from a worker thread
        job = worker.submit(lambda: (recompute(), _sync(device)))
        load()
        job.result()

    def serial():
        recompute()
        _sync(device)
        load()

    fns = {"recompute": recompute, "load": load, "serial": serial, "pipelined": pipelined}
    if cuda:
        fns["pipelined_thread"] = pipelined_thread
    for fn in fns.values():  # warm-up
        fn()
        _sync(device)
    runs = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            runs[name].append(time.perf_counter() - t0)
    worker.shutdown()
    med = {name: statistics.median(v) for name, v in runs.items()}
    return {"share": share, "recompute_token_layers": sum(R), "stored_rows":
            sum(tokens - u for u in unstored), "T_C_s": med["recompute"], "T_L_s": med["load"],
            "serial_s": med["serial"], "pipelined_s": med["pipelined"],
            "pipelined_over_sum": med["pipelined"] / (med["recompute"] + med["load"]),
            "pipelined_over_serial": med["pipelined"] / med["serial"],
            **({"pipelined_thread_s": med["pipelined_thread"],
                "pipelined_thread_over_sum": med["pipelined_thread"]
                / (med["recompute"] + med["load"])} if cuda else {}),
            "max_over_sum": max(med["recompute"], med["load"])
            / (med["recompute"] + med["load"]), "runs_s": runs}


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {torch.get_num_threads()} threads"


def profile(model_path: str, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
            tokens: int = 4096, codec: str = "int8", tiers=TIERS, repeats: int = 3,
            random_weights: bool = False, progress: bool = True,
            pipeline_share: float | None = None) -> dict:
    """Measure both costs and choose each tier's recompute share for a ``tokens``-long
    conversation (all layers stored through ``codec``; no merged pairs);
    ``pipeline_share``: also a host-tier restore at that forced share, serial and
    pipelined (``measure_pipeline``)."""
    from tqdm import tqdm

    dev = torch.device(device)
    steps = tqdm(total=1 + len(tiers) + (pipeline_share is not None),
                 desc="krul: restore costs", unit="step", disable=not progress)
    model = load_model(model_path, dtype, dev, random_weights)
    shape = ModelShape.of(model.config)
    recompute_s = measure_recompute(model, tokens, repeats, dev)
    steps.update()
    pipeline = None
    if pipeline_share is not None:
        pipeline = measure_pipeline(model, tokens, pipeline_share, dtype, codec, repeats, dev)
        steps.update()
    del model
    out = {"format": _FORMAT, "model": os.path.abspath(model_path), "hardware": hardware(dev),
           "device": str(dev), "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
           "codec": codec, "shape": asdict(shape), "repeats": repeats,
           "recompute_s": recompute_s, "tiers": {}}
    if pipeline is not None:
        # The served pre-pass, timed, costs what a restore pays (on a GPU its kernel
        # launches can cost more per token-layer than a full forward's).
        out["forward_recompute_s"] = recompute_s
        out["recompute_s"] = recompute_s = (pipeline["T_C_s"]
                                            / max(1, pipeline["recompute_token_layers"]))
    weight = [1.0] * shape.num_layers
    if pipeline is not None:
        out["pipeline"] = pipeline
    # The share a pipelined restore uses: what the pipeline measured it hides, else all.
    overlap = overlap_of(out)
    overlap = 1.0 if overlap is None else overlap
    out["overlap"] = overlap
    for tier in tiers:
        load_s = measure_load(shape, tokens, dtype, codec, tier, repeats, dev)
        cost = RestoreCost(recompute_s, load_s)
        share = choose_share(cost, tokens, weight, overlap=overlap)
        t_split = restore_time(*times(cost, tokens, pyramid(tokens, shape.num_layers, share),
                                      weight), overlap)
        out["tiers"][tier] = {
            "load_s": load_s, "share": share,
            "load_only_s": times(cost, tokens, [0] * shape.num_layers, weight)[1],
            "recompute_only_s": recompute_s * tokens * shape.num_layers,
            "split_s": t_split}
        steps.update()
    steps.close()
    return out


def cost_of(prof: dict, tier: str) -> RestoreCost:
    """The RestoreCost a profile measured for ``tier``; ValueError names the valid ones."""
    if prof.get("format") != _FORMAT:
        raise ValueError(f"restore profile format {prof.get('format')!r}, expected {_FORMAT}")
    if tier not in prof["tiers"]:
        raise ValueError(f"no {tier!r} tier in the restore profile; valid: "
                         f"{', '.join(prof['tiers'])}")
    return RestoreCost(prof["recompute_s"], prof["tiers"][tier]["load_s"])


def read_profile(path: str) -> dict:
    """A profile file (``python -m sgl_spec.calibrate restore --out``), checked: its format
    and a ``host`` tier, whose share the server uses. OSError / ValueError otherwise."""
    import json

    with open(path) as f:
        try:
            prof = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path!r} is not JSON ({exc})") from None
    try:
        cost_of(prof, "host")
        int(prof["tokens"]), int(prof["shape"]["num_layers"])
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"{path!r} is not a restore profile (python -m sgl_spec.calibrate "
                         "restore writes one)") from None
    return prof


def overlap_of(prof: dict) -> float | None:
    """The share of the shorter part of a restore that the pipelined restore ran beside
    the longer, as the profile measured it (``--pipeline-share``): (T_C + T_L -
    pipelined) / min(T_C, T_L), in [0, 1]; None where it was not measured."""
    p = prof.get("pipeline")
    if not p:
        return None
    tc, tl = p["T_C_s"], p["T_L_s"]
    return min(1.0, max(0.0, (tc + tl - p["pipelined_s"]) / max(min(tc, tl), 1e-12)))


def host_share(prof: dict, num_layers: int, load_weight: list[float] | None = None,
               pipelined: bool = True) -> float:
    """The recompute share for a model of ``num_layers`` from a profile's host tier: T_C
    and T_L both grow with the history, so the share chosen at the profile's length holds
    for others; ``load_weight`` (per layer, 1 = an own row) as ``pyramid.times``. A
    serial restore (``pipelined`` False) pays T_C + T_L; a pipelined one max(T_C, T_L)
    plus what the profile measured it did not hide (``overlap_of``; all hidden where not
    measured, the paper's model). A profile's ``share`` field fixes the share (a made-up
    profile for experiments: ``bench.sessions --krul-share``)."""
    if prof["shape"]["num_layers"] != num_layers:
        raise ValueError(f"the restore profile was measured for {prof['shape']['num_layers']} "
                         f"layers; this model has {num_layers}")
    if prof.get("share") is not None:
        return float(prof["share"])
    weight = [1.0] * num_layers if load_weight is None else load_weight
    overlap = (1.0 if overlap_of(prof) is None else overlap_of(prof)) if pipelined else 0.0
    return choose_share(cost_of(prof, "host"), int(prof["tokens"]), weight, overlap=overlap)
