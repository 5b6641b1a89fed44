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
    first_at: float | None = None  # perf_counter of the first and the last token
    last_at: float | None = None
    rid: str | None = None  # the server's request id (the chunks' id)


def peak_overlap(replies: list[Reply]) -> int:
    """The most replies decoding at one time (between their first and last tokens), from
    the client's clock: sglang's running-request gauge is refreshed only every
    --decode-log-interval steps."""
    events = sorted([(r.first_at, 1) for r in replies if r.first_at is not None]
                    + [(r.last_at, -1) for r in replies if r.first_at is not None])
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


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
    stamps, parts, usage, rid = [], [], {}, None
    with requests.post(url + "/v1/chat/completions", json=body, stream=True,
                       timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            rid = rid or chunk.get("id")
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
    return Reply("".join(parts), ttft, rate, n, cached, usage.get("prompt_tokens", 0),
                 stamps[0] if stamps else None, stamps[-1] if stamps else None, rid)


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
    """Polls ``/metrics`` while a phase runs: the retractions during it; with ``pool``, also ``GET /sgl_spec/cache``: the sample
    with the most device KV bytes in use (full-pool slots x bytes per slot, plus the upper
    tier's slots in use x theirs, read from the pool)."""

    RUNNING = "sglang:num_running_reqs"
    RETRACTED = "sglang:num_retracted_requests_total"

    def __init__(self, url: str, every_s: float = 0.5, pool: bool = False):
        self.url, self.every_s, self.pool = url, every_s, pool
        self.peak_bytes, self.peak_sample = 0, None
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
            if self.pool:
                self._sample_pool(int(m.get(self.RUNNING, 0)))
            self._stop.wait(self.every_s)

    def _sample_pool(self, running: int) -> None:
        try:
            st = requests.get(self.url + "/sgl_spec/cache", timeout=30).json()
        except (requests.RequestException, ValueError):
            return
        pool, tiers = st.get("pool"), st.get("tiers")
        if not pool:
            return
        if tiers:
            tb = tiers["token_bytes"]
            used = pool["used_slots"] * tb["lower"] + tiers["upper_slots_used"] * tb["upper"]
        else:
            used = pool["used_slots"] * pool["device_bytes"] / (pool["slots"] + 1)
        if used > self.peak_bytes:
            self.peak_bytes = int(used)
            self.peak_sample = {"running": running, "used_slots": pool["used_slots"],
                                "upper_slots_used": tiers and tiers["upper_slots_used"],
                                "bytes": int(used)}

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.retracted = int(metrics(self.url).get(self.RETRACTED, 0.0) - self._first)
