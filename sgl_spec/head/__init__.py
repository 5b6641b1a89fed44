"""SpeContext's retrieval head: its config and EAGLE-3 checkpoint layout (``config``,
``eagle3``), its math (``model``, ``rope``), its serving runtime (``runtime``: per-token
state in the KV pool) and CPU training (``train``, ``data``; ``python -m
sgl_spec.train_head``)."""
