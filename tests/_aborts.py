"""Streams that the client cuts at chosen points, and the per-request structures a
server holds afterwards (``GET /sgl_spec/cache``'s ``live_requests``)."""

from __future__ import annotations

import threading
import time

import requests


def abort_streams(url: str, prompts: list[str], cut_after: list[int],
                  max_new_tokens: int = 64) -> None:
    """Stream ``prompts[i]`` (greedy, ``ignore_eos``) and close the connection after
    ``cut_after[i]`` chunks (0: before the first token, usually during prefill), all
    at once; returns when every client has gone."""

    def stream_and_drop(text: str, n_chunks: int) -> None:
        body = {"text": text, "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                    "ignore_eos": True}}
        with requests.post(url + "/generate", json=body, stream=True, timeout=300) as r:
            for k, _ in enumerate(r.iter_lines()):
                if k >= n_chunks:
                    break  # leaving the block closes the connection

    threads = [threading.Thread(target=stream_and_drop, args=(p, n))
               for p, n in zip(prompts, cut_after, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)


def live_requests(url: str, headers: dict | None = None) -> dict[str, int]:
    resp = requests.get(url + "/sgl_spec/cache", headers=headers, timeout=60)
    resp.raise_for_status()
    return resp.json()["live_requests"]


def wait_until_freed(url: str, timeout_s: float = 60.0) -> dict[str, int]:
    """``live_requests`` once every count is 0, or as it stands at the timeout (the
    scheduler sees a disconnect within a step or two)."""
    deadline = time.monotonic() + timeout_s
    live = live_requests(url)
    while any(live.values()) and time.monotonic() < deadline:
        time.sleep(1)
        live = live_requests(url)
    return live
