"""Where KV lives across tiers and how it moves between them, in torch alone (the sglang
side is ``sgl_spec.integration.tiers``).

``free_list``: free indices with a double-free check (host rows, device slots);
``working_set``: the upper layers' device slots of a layer-tiered pool, mapped from the
full pool's slots (Round Attention's working sets);
``pool``: a tiered pool's buffers and per-tier device bytes (the pool inside sglang is
``sgl_spec.integration.tiers.tiered_pool``);
``blocks``: a round's upper-layer KV as one contiguous host block, stored and loaded with
one copy each;
``arena``: Krul's compressed host and file rows (logical slots over shared rows; the
codecs are ``sgl_spec.krul``'s, the dequant kernels ``sgl_spec.kernels.dequant``);
``restore_clock``: the host-tier restore stage's clock (admitted, refused, tokens, time;
a Krul restore's recompute, copy and their overlap);
``offload``: SpeContext's Algorithms 1-2, the lengths past which layers leave the device,
and the moves (served on sglang's pool by ``sgl_spec.integration.tiers.offload``).
"""
