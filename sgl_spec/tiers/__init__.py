"""Where KV lives across tiers and how it moves between them, in torch alone (the sglang
side is ``sgl_spec.integration``).

``free_list``: free indices with a double-free check (host rows, device slots);
``working_set``: the upper layers' device slots of a layer-tiered pool, mapped from the
full pool's slots (Round Attention's working sets, SpeContext's offloaded layers);
``blocks``: a round's upper-layer KV as one contiguous host block, stored and loaded with
one copy each. Krul's compressed host rows (``sgl_spec.krul.arena``) draw their rows from
a ``FreeList`` too.
"""
