"""CPU platform support for sglang 0.5.23 on hosts without CUDA.

Installed for every Python process of the environment by ``sgl_spec_cpu.pth``
(which imports :mod:`sgl_spec.cpu.boot`), so it reaches sglang's spawned scheduler
and detokenizer processes and stock ``python -m sglang.launch_server`` alike.
Uninstalling sgl_spec removes the ``.pth`` file and with it every patch here.
"""
