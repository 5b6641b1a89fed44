"""Where KV lives across tiers and how it moves between them, in torch alone (the sglang
side is ``sgl_spec.integration``).

``free_list``: free indices with a double-free check (host rows, device slots);
``working_set``: the upper layers' device slots of a layer-tiered pool, mapped from the
full pool's slots (Round Attention's working sets, SpeContext's offloaded layers);
``pool``: a tiered pool's buffers and per-tier device bytes (the pool inside sglang is
``sgl_spec.integration.tiered_pool``);
``blocks``: a round's upper-layer KV as one contiguous host block, stored and loaded with
one copy each. Krul's compressed host rows (``sgl_spec.krul.arena``) draw their rows from
a ``FreeList`` too.
"""
