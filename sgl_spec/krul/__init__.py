"""Krul (issue 17): inactive conversations kept as compressed cross-layer KV.

Pure parts, no sglang: which layer pairs a conversation shares (``select``), the
running attention-similarity statistics they are chosen from (``similarity``), the
MiniCache merge of a pair (``merge``, reference in ``merge_ref``) and the
recompute/load split of a restore (``pyramid``). The serving side lives in
``sgl_spec.integration``. Design: docs/design/krul.md.
"""
