"""Multi-round conversations played against a server turn by turn, as a chat client does.

Each round's user turn is one request over the scripted history before it (its answer
capped at one token: the history's assistant turns are the scripted ones); questions
then go over the whole history. Helpers read a server's ``/metrics`` (running, queued,
retracted requests) while a phase runs, and stream a question for its TTFT and decode
rate. Used by ``sgl_spec.bench.rounds``.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

import requests

from sgl_spec.rounds.conversations import Conversation


@dataclass
class Reply:
    text: str
    ttft_s: float | None
    decode_tok_s: float | None  # (tokens - 1) / (last token - first token)
    completion_tokens: int
    cached_tokens: int
    prompt_tokens: int


def history(url: str, conv: Conversation, timeout: float = 900) -> None:
    """Play every round's user turn over the scripted history (one token each)."""
    msgs = list(conv.messages)
    for r in range(1, conv.rounds + 1):
        body = {"model": "m", "messages": msgs[: 2 * r], "max_tokens": 1, "temperature": 0}
        requests.post(url + "/v1/chat/completions", json=body, timeout=timeout
                      ).raise_for_status()


def ask(url: str, messages: list[dict], max_tokens: int, ignore_eos: bool = False,
        timeout: float = 1800) -> Reply:
    """One streamed greedy chat request: its text, TTFT, decode rate and usage."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    import json

    t0 = time.perf_counter()
    stamps, parts, usage = [], [], {}
    with requests.post(url + "/v1/chat/completions", json=body, stream=True,
                       timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or ():
                if (c.get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
                    parts.append(c["delta"]["content"])
    n = usage.get("completion_tokens", len(stamps))
    ttft = stamps[0] - t0 if stamps else None
    rate = (n - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] \
        else None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Reply("".join(parts), ttft, rate, n, cached, usage.get("prompt_tokens", 0))


_METRIC = re.compile(r"^(sglang:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$")


def metrics(url: str) -> dict[str, float]:
    """sglang's Prometheus gauges and counters (summed over label sets)."""
    out: dict[str, float] = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


class Watch:
    """Polls ``/metrics`` while a phase runs: the peak running and queued requests and
    the retractions during it."""

    RUNNING, QUEUED = "sglang:num_running_reqs", "sglang:num_queue_reqs"
    RETRACTED = "sglang:num_retracted_requests_total"

    def __init__(self, url: str, every_s: float = 0.2):
        self.url, self.every_s = url, every_s
        self.peak_running = self.peak_queued = 0
        self._stop = threading.Event()
        self._first = metrics(url).get(self.RETRACTED, 0.0)
        self.retracted = 0
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                m = metrics(self.url)
            except requests.RequestException:
                m = {}
            self.peak_running = max(self.peak_running, int(m.get(self.RUNNING, 0)))
            self.peak_queued = max(self.peak_queued, int(m.get(self.QUEUED, 0)))
            self._stop.wait(self.every_s)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.retracted = int(metrics(self.url).get(self.RETRACTED, 0.0) - self._first)
