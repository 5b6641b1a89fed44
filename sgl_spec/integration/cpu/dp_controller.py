"""sglang's DP controller, made to wait for requests instead of spinning (CPU hosts).

In sglang 0.5.23 ``DataParallelController.event_loop`` calls a non-blocking
``recv`` in a bare ``while True``: the controller process holds one core at 100%
whether or not requests come. On a 2-core CPU host that is half the machine, taken
from the two schedulers of ``--dp-size 2``. The patched loop blocks in ``zmq``'s
``poll`` until a message is there (it wakes at once; at most every second to feed the
soft watchdog) and then drains the socket exactly as the original does, in order.
"""

from __future__ import annotations

POLL_MS = 1000  # the longest wait between watchdog feeds while idle


def patch_event_loop(module) -> None:
    """Replace ``module.DataParallelController.event_loop`` (module:
    ``sglang.srt.managers.data_parallel_controller``). Idempotent."""
    cls = module.DataParallelController
    if getattr(cls.event_loop, "_sgl_spec", False):
        return
    import zmq

    sock_recv = module.sock_recv

    def event_loop(self):
        while True:
            self.soft_watchdog.feed()
            if not self.recv_from_tokenizer.poll(timeout=POLL_MS):
                continue
            while True:
                try:
                    recv_req = sock_recv(self.recv_from_tokenizer, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
                self._request_dispatcher(recv_req)

    event_loop._sgl_spec = True
    cls.event_loop = event_loop
