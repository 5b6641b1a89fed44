"""sglang 0.5.23 on hosts without CUDA: the import hooks (``hooks``) that supply
``sgl_kernel`` (``sgl_kernel_shim``), make torchvision's CUDA wheel importable
(``torchvision_ops``) and make HiCache work on CPU (``hicache``). Reached from every
Python process of the environment through ``sgl_spec.boot`` (``sgl_spec_cpu.pth``);
uninstalling sgl_spec removes the ``.pth`` file and with it every patch here."""
