"""sgl_spec's attention kernels, installed as ``sgl_spec.kernels``.

Each kernel lives beside a pure-torch reference that the tests compare it with:
``sparse_decode`` (C++ CPU, torch, Triton, FlashInfer; exact mode's decode is its
dense subset), ``vslash`` (LoopServe's vertical/slash prefill lines) and ``dense``
(an extend over a cached prefix through the CPU's fused SDPA kernel, in two parts).
"""
