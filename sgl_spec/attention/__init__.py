"""sgl_spec's attention path (plan/run), free of sglang; ``build_core`` assembles it."""

from __future__ import annotations

import logging

import torch

from sgl_spec.config import SpecConfig
from sgl_spec.requests import RequestHub
from sgl_spec.sparse.policy import AttnShape

from .core import AttentionCore
from .decode import Decoder

logger = logging.getLogger(__name__)

__all__ = ["AttentionCore", "build_core"]


def build_core(cfg: SpecConfig, shape: AttnShape, device: torch.device | str,
               enable_metrics: bool = False, head=None, pool_layers=None,
               impl: str | None = None, tiers=None) -> AttentionCore:
    """The attention path of ``cfg``: exact or sparse decode, exact or sparse prefill.

    The core's ``hub`` (a new ``RequestHub``) is what the radix cache shares with it: a
    sparse decode policy's states are freed through its releases (the radix cache's;
    with another tree cache, by the stale-rid fallback).
    ``head``: the retrieval head (``sgl_spec.head.runtime.HeadRuntime``) that
    ``specontext`` needs; ``pool_layers(layer) -> (K, V)``: the KV pool, for its
    prefetcher; ``impl``: the decode kernel (None: the fastest for the device).
    """
    hub = RequestHub()
    policy, metrics = None, None
    if cfg.decode.mode != "exact":
        from sgl_spec.sparse import get_policy

        policy = get_policy(cfg.decode.mode, cfg.decode, shape, device)
        if enable_metrics:
            from .metrics import SparseMetrics

            metrics = SparseMetrics()
    if cfg.decode.retrieval_head:
        if head is None:
            raise ValueError("--spec-mode specontext needs a retrieval head")
        policy.attach(head)
        if enable_metrics:
            from .metrics import SpeContextMetrics

            policy.metrics = SpeContextMetrics()
    pass_metrics = None
    if enable_metrics:
        from .metrics import PassMetrics

        pass_metrics = PassMetrics()
    decoder = Decoder(shape, policy, impl=impl, metrics=metrics, prefetch=cfg.decode.prefetch,
                      pool_layers=pool_layers, pass_metrics=pass_metrics,
                      track_sparse_kv=policy is not None and cfg.decode.drops_sparse_kv)
    if policy is not None:
        hub.add_release_listener(decoder.release)
        hub.add_live_source("decode_states", lambda: decoder.live_states)
        hub.add_live_source("policy_states", lambda: policy.live_states)
        hub.add_live_source("policy_slots", lambda: len(policy.slots))
        hub.add_rows_source(decoder.rows)
    observer = None
    if cfg.krul.enable and cfg.krul.strategy == "conversation":
        from .observe import KrulObserver

        observer = KrulObserver(shape.num_layers, device=device)
        hub.add_release_listener(observer.release)
        hub.add_live_source("krul_stats", lambda: observer.live_states)
    rounds = None
    if cfg.rounds.enable and tiers is not None:
        from sgl_spec.rounds.runtime import RoundRuntime

        r = cfg.rounds
        rounds = RoundRuntime(tiers, r.strategy, r.recent, r.min_rounds, r.drop_after)
        hub.add_release_listener(rounds.release)
        hub.add_idle_listener(rounds.idle)
        hub.add_live_source("round_seeds", lambda: len(rounds.seeds))
        hub.add_live_source("round_working_sets", lambda: rounds.live_states)
        hub.add_live_source("round_upper_slots", lambda: rounds.tiers.slots.used())
    prefill = None
    if cfg.prefill.mode != "exact":
        # round mode: the upper layers attend the working set; LoopServe the ones below
        layers = shape.num_layers if rounds is None else tiers.first_layer + tiers.split
        prefill = _sparse_prefill(cfg, layers, torch.device(device), enable_metrics, hub)
    logger.info("sgl_spec attention: decode %s (%s), prefill %s, %s%s%s", cfg.decode.mode,
                cfg.decode, cfg.prefill.mode, shape,
                ", Krul's estimator observes each conversation" if observer else "",
                f", round mode from layer {tiers.first_layer + tiers.split}"
                if rounds is not None else "")
    return AttentionCore(decoder, prefill, head if cfg.decode.retrieval_head else None,
                         observer, hub, rounds)


def _sparse_prefill(cfg: SpecConfig, layers: int, device: torch.device,
                    enable_metrics: bool, hub: RequestHub):
    """LoopServe's prefill over layers 0..``layers`` - 1 (round mode: those below L_w)."""
    from .prefill import SparsePrefill

    metrics = None
    if enable_metrics:
        from .metrics import PrefillMetrics

        metrics = PrefillMetrics()
    kernel = "torch ops"
    if device.type == "cpu":
        from sgl_spec.kernels.vslash import cpu_kernel

        # Build (or load) the C++ slash kernel now, not inside the first long prefill.
        if cpu_kernel.load_kernel() is not None:
            kernel = "cpp"
    logger.info("sgl_spec sparse prefill: %s, CPU line kernel: %s", cfg.prefill, kernel)
    return SparsePrefill(cfg.prefill, layers, metrics=metrics, hub=hub)
