"""sgl_spec's attention kernels, installed as ``sgl_spec.kernels``.

Each kernel (Triton / FlashInfer paths for the sparse decode and sparse prefill
modes) lives beside a pure-torch reference that the tests compare it with. The
exact mode needs none: it runs torch's SDPA (sgl_spec.attention.backend).
"""
