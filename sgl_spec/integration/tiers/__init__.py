"""KV across tiers, the sglang side (the torch side is ``sgl_spec.tiers``).

* ``tiered_pool``, ``platform``: round mode's layer-tiered MHA pool and the platform hook
  that builds it (``--spec-rounds`` on a CPU host);
* ``krul``, ``krul_restore``: Krul's compressed host pool under sglang's HiCache, its
  demotion of inactive conversations and their restore (load and recompute);
* ``hicache_cpu``: sglang's HiCache transfer ops and host buffers on a CPU host;
* ``offload``: SpeContext's layers moved to the host as the pool fills
  (``--spec-offload auto``: Algorithm 2 before every forward pass).
"""
