"""The soak harness's clients: each plays a seeded, endless mix of what a chat and agent
service sends, until a deadline (``python -m sgl_spec.bench.soak``).

Kinds (``KINDS``; ``Mix`` weights them):

* ``chat``: a conversation over one of a few shared documents, 2-3 questions;
* ``growing``: the client's own conversation, one more paragraph and question per visit,
  restarted past ``grow_limit`` prompt tokens;
* ``agent``: the frontend research agent (``sgl_spec.agents.research_assistant``: plan,
  ``fork`` into sub-questions, join, report);
* ``longgen``: a long generation (``ignore_eos``);
* ``abort``: a streamed chat the client drops after 0-20 chunks (0: during prefill);
* ``over_limit``: a prompt longer than the model's context (a 400, as stock answers).

Every prompt is fixed by (seed, client, visit): assistant turns in a history are pinned
(``PINNED``), not the server's own answers, so two servers that get through the same
visits were sent the same prompts and their greedy answers compare token by token
(``agreement``). Results are ``Record``s; the clients share nothing but the list.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict, dataclass, field

import requests

from sgl_spec.bench.chat_client import TurnResult, make_client, stream_turn

KINDS = ("chat", "growing", "agent", "longgen", "abort", "over_limit")
PINNED = "Understood; I have read it."
QUESTIONS = ("What is this text about?", "Name one thing it defines.",
             "Summarize it in one sentence.", "Which detail would a user need first?",
             "Quote its first sentence.")
TOO_LONG = "hello " * 9000  # ~9k tokens: over the default model's 8192-token context


@dataclass(frozen=True)
class Mix:
    """Weights of the kinds, and their sizes (tokens)."""

    chat: float = 4
    growing: float = 2
    agent: float = 1
    longgen: float = 1
    abort: float = 2
    over_limit: float = 0.5
    answer_tokens: int = 24
    longgen_tokens: int = 96
    grow_limit: int = 900

    def __post_init__(self) -> None:
        weights = [getattr(self, k) for k in KINDS]
        if min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"kind weights must be >= 0 with a positive sum: {weights}")
        for name in ("answer_tokens", "longgen_tokens", "grow_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


@dataclass
class Record:
    """One request as a client saw it; times in seconds from the run's start.

    ``status``: ok, aborted (the client dropped it, as intended), rejected (an HTTP
    error status: ``http_status``) or failed (anything else: ``error``)."""

    key: str  # c<client>-v<visit>[-t<turn>]: the same prompt on every server
    kind: str
    start_s: float
    end_s: float = 0.0
    status: str = "ok"
    http_status: int | None = None
    error: str | None = None
    turn: dict | None = None  # TurnResult as a dict (greedy chat answers)
    output_sha1: str | None = None  # the agent's answers (no token ids through the frontend)


@dataclass
class Client:
    """One client's seeded stream of visits (thread-safe only in that each client has
    its own; ``records`` is a list shared by all, appended to atomically)."""

    index: int
    url: str
    docs: list[str]
    mix: Mix
    seed: int
    records: list[Record]
    t0: float
    growing: list[dict] = field(default_factory=list)

    def run(self, deadline: float, stop: threading.Event) -> None:
        rng = random.Random(self.seed * 10_007 + self.index)
        client = make_client(self.url, timeout_s=600)
        weights = [getattr(self.mix, k) for k in KINDS]
        visit = 0
        while time.monotonic() < deadline and not stop.is_set():
            kind = rng.choices(KINDS, weights)[0]
            key = f"c{self.index}-v{visit}"
            getattr(self, "_" + kind)(client, rng, key)
            visit += 1

    # ---------------------------------------------------------------- kinds

    def _record(self, key: str, kind: str, start: float, **kw) -> Record:
        rec = Record(key, kind, start - self.t0, time.monotonic() - self.t0, **kw)
        self.records.append(rec)
        return rec

    def _turn(self, client, key: str, kind: str, messages: list[dict], max_tokens: int,
              ignore_eos: bool = False) -> TurnResult | None:
        start = time.monotonic()
        try:
            t = stream_turn(client, "default", messages, max_tokens, key, 1, ignore_eos)
        except Exception as exc:  # noqa: BLE001  every failure is a result here
            status = getattr(exc, "status_code", None)
            self._record(key, kind, start, status="rejected" if status else "failed",
                         http_status=status, error=f"{type(exc).__name__}: {exc}"[:300])
            return None
        self._record(key, kind, start, turn=asdict(t))
        return t

    def _chat(self, client, rng: random.Random, key: str) -> None:
        doc = rng.choice(self.docs)
        messages = [{"role": "user", "content": doc + "\n\n" + rng.choice(QUESTIONS)}]
        for turn in range(rng.randint(2, 3)):
            if turn:
                messages += [{"role": "assistant", "content": PINNED},
                             {"role": "user", "content": rng.choice(QUESTIONS)}]
            if self._turn(client, f"{key}-t{turn}", "chat", messages,
                          self.mix.answer_tokens) is None:
                return

    def _growing(self, client, rng: random.Random, key: str) -> None:
        doc = rng.choice(self.docs)
        paragraph = doc[: len(doc) // 4]
        self.growing += [{"role": "user", "content": paragraph + "\n\n" + rng.choice(QUESTIONS)}]
        t = self._turn(client, key, "growing", self.growing, self.mix.answer_tokens)
        self.growing.append({"role": "assistant", "content": PINNED})
        if t is None or t.prompt_tokens > self.mix.grow_limit:
            self.growing = []

    def _agent(self, client, rng: random.Random, key: str) -> None:
        import hashlib

        from sgl_spec.agents.research_assistant import AgentConfig, run_research

        doc = rng.choice(self.docs)
        start = time.monotonic()
        try:
            result = run_research(self.url, doc, config=AgentConfig(
                max_sub_questions=2, plan_tokens=48, answer_tokens=24, report_tokens=48),
                chat_template="chatml")
        except Exception as exc:  # noqa: BLE001
            self._record(key, "agent", start, status="failed",
                         error=f"{type(exc).__name__}: {exc}"[:300])
            return
        text = "\x00".join([result.plan, *result.sub_answers, result.report])
        self._record(key, "agent", start, output_sha1=hashlib.sha1(text.encode()).hexdigest())

    def _longgen(self, client, rng: random.Random, key: str) -> None:
        topic = rng.choice(("a lighthouse", "a river town", "a clockmaker", "a long voyage"))
        self._turn(client, key, "longgen",
                   [{"role": "user", "content": f"Write a long story about {topic}."}],
                   self.mix.longgen_tokens, ignore_eos=True)

    def _abort(self, client, rng: random.Random, key: str) -> None:
        doc = rng.choice(self.docs)
        cut = rng.choice((0, 1, 5, 20))
        body = {"model": "default", "stream": True, "temperature": 0, "max_tokens": 64,
                "messages": [{"role": "user", "content": doc + "\n\nRetell it."}]}
        start = time.monotonic()
        try:
            with requests.post(self.url + "/v1/chat/completions", json=body, stream=True,
                               timeout=600) as r:
                if r.status_code != 200:
                    self._record(key, "abort", start, status="rejected",
                                 http_status=r.status_code, error=r.text[:300])
                    return
                for k, _ in enumerate(r.iter_lines()):
                    if k >= cut:
                        break  # leaving the block closes the connection
        except requests.RequestException as exc:
            self._record(key, "abort", start, status="failed", error=str(exc)[:300])
            return
        self._record(key, "abort", start, status="aborted")

    def _over_limit(self, client, rng: random.Random, key: str) -> None:
        body = {"model": "default", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": TOO_LONG}]}
        start = time.monotonic()
        try:
            r = requests.post(self.url + "/v1/chat/completions", json=body, timeout=600)
        except requests.RequestException as exc:
            self._record(key, "over_limit", start, status="failed", error=str(exc)[:300])
            return
        status = "ok" if r.status_code == 200 else "rejected"
        self._record(key, "over_limit", start, status=status, http_status=r.status_code,
                     error=None if status == "ok" else r.text[:300])


def play(url: str, docs: list[str], mix: Mix, clients: int, seconds: float, seed: int,
         on_record=None) -> tuple[list[Record], float]:
    """``clients`` threads for ``seconds`` (visits started before the deadline finish);
    the records, and the run's start (``time.monotonic()``)."""
    records: list[Record] = []
    t0 = time.monotonic()
    stop = threading.Event()
    threads = [threading.Thread(target=Client(i, url, docs, mix, seed, records, t0).run,
                                args=(t0 + seconds, stop), name=f"soak-client-{i}", daemon=True)
               for i in range(clients)]
    for t in threads:
        t.start()
    seen = 0
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        if on_record is not None:
            for rec in records[seen:len(records)]:
                on_record(rec)
            seen = len(records)
    if on_record is not None:
        for rec in records[seen:]:
            on_record(rec)
    return records, t0
