"""SpeContext's retrieval head inside sglang: its KV-pool layer and the model's taps.

* **One extra KV-pool layer** (``patch_kv_pool``, an import hook on
  ``mem_cache.kv_cache_configurator``): with ``--spec-mode specontext`` the MHA pool
  is built with ``num_layers + 1`` layers. Layer ``num_layers`` holds, per token slot,
  the head's key (K buffer) and the hidden part of the next position's key (V
  buffer). Every KV operation sglang does per slot (radix-cache sharing and freeing,
  HiCache write-back and load, which copy all of the pool's layers) therefore keeps
  the head's state with the token's KV. The model never reads that layer.
* **Taps** (``install_capture``): a forward pre-hook on each of the head's aux
  layers hands the layer's ``capture_output`` (sglang's EAGLE-3 capture: the residual
  stream entering the layer) to the head runtime as well; a capture already asked
  for (EAGLE-3 speculative decoding) still gets it.
* ``build_runtime``: the head (``--spec-draft-path``, an EAGLE-3 checkpoint) bound to
  the runner's pool and embedding.
"""

from __future__ import annotations

import logging

import torch

from sgl_spec.config import current

logger = logging.getLogger(__name__)

HEAD_LAYERS = 1


def patch_kv_pool(module) -> None:
    """After ``kv_cache_configurator`` executes: its MHA pool class gets the head's
    layer when this server runs a retrieval head (else nothing changes)."""
    cfg = current()
    if cfg.disable or not cfg.decode.retrieval_head:
        return
    base = module.MHATokenToKVPool
    if getattr(base, "_sgl_spec_head_layers", 0):
        return

    class HeadKVPool(base):
        """sglang's MHA pool plus the retrieval head's layer(s) after the model's."""

        _sgl_spec_head_layers = HEAD_LAYERS

        def __init__(self, *args, layer_num: int, end_layer=None, **kwargs):
            if end_layer is not None:
                end_layer += HEAD_LAYERS
            super().__init__(*args, layer_num=layer_num + HEAD_LAYERS, end_layer=end_layer,
                             **kwargs)

    HeadKVPool.__name__ = HeadKVPool.__qualname__ = base.__name__
    module.MHATokenToKVPool = HeadKVPool
    logger.info("sgl_spec: KV pool with %d extra layer for the retrieval head", HEAD_LAYERS)


def build_runtime(runner, device):
    """``(HeadRuntime, pool_layers)`` for this runner; ValueError says what is wrong."""
    from sgl_spec.head import eagle3
    from sgl_spec.head.model import RetrievalHead
    from sgl_spec.head.runtime import HeadRuntime, HeadStore

    cfg = current().decode
    if not cfg.draft_path:
        raise ValueError("--spec-mode specontext needs --spec-draft-path (the launcher "
                         "fills in the prepared head when it is not given)")
    head_cfg, weights, n_aux = eagle3.load(cfg.draft_path)
    mc = runner.model_config
    layers = mc.num_hidden_layers
    aux = head_cfg.resolve_aux_layers(layers)
    if head_cfg.target_hidden_size != mc.hidden_size:
        raise ValueError(f"the draft at {cfg.draft_path} reads target hidden states of "
                         f"{head_cfg.target_hidden_size}, the model has {mc.hidden_size}")
    pool = runner.token_to_kv_pool
    if getattr(pool, "layer_num", 0) != layers + HEAD_LAYERS:
        raise ValueError(f"the KV pool has {getattr(pool, 'layer_num', '?')} layers, the "
                         f"retrieval head needs {layers + HEAD_LAYERS} ({type(pool).__name__}"
                         " is not the MHA pool sgl_spec extends)")
    embed = None
    if weights.embed is None:
        embed = runner.model.model.embed_tokens.weight
        if embed.shape[0] < head_cfg.vocab_size or embed.shape[1] != head_cfg.hidden_size:
            raise ValueError(f"the draft has no embedding and the target's "
                             f"{tuple(embed.shape)} does not fit its vocab "
                             f"{head_cfg.vocab_size} x hidden {head_cfg.hidden_size}")
    head = RetrievalHead(head_cfg, weights, n_aux, device)
    store = HeadStore(lambda: (pool.get_key_buffer(layers), pool.get_value_buffer(layers)),
                      embed)
    runtime = HeadRuntime(head, store, device)
    install_capture(runner.model, aux, runtime)
    logger.info("sgl_spec retrieval head %s: %d q / %d kv heads, aux layers %s, %s embedding",
                cfg.draft_path, head_cfg.num_q_heads, head_cfg.num_kv_heads, aux,
                "own" if embed is None else "the target's")

    def pool_layers(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return pool.get_key_buffer(layer), pool.get_value_buffer(layer)

    return runtime, pool_layers


def install_capture(model, aux_layers: tuple[int, ...], runtime) -> None:
    """Feed ``runtime.capture(k, hidden)`` from the k-th aux layer of ``model``."""
    try:
        decoder_layers = model.model.layers
    except AttributeError:
        raise ValueError(f"{type(model).__name__} has no model.layers: the retrieval head "
                         "taps decoder layers of Llama-style models") from None
    for k, i in enumerate(aux_layers):
        decoder_layers[i].register_forward_pre_hook(_tap(k, runtime), with_kwargs=True)


def _tap(k: int, runtime):
    def hook(module, args, kwargs):
        asked = kwargs.get("capture_output")

        def capture(hidden, *, owned: bool = False):
            runtime.capture(k, hidden)  # reads it now, keeps nothing
            if asked is not None:
                asked(hidden, owned=owned)

        return args, {**kwargs, "capture_output": capture}

    return hook
