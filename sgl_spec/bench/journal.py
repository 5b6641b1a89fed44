"""A row's finished QA conversations, written as each one finishes, so that an
interrupted row resumes where it stopped (``python -m sgl_spec.bench --resume``).

``journal-<row>.jsonl`` in the output directory: a first line with the row's fingerprint
(``runner.fingerprint``: its flags, the model, the plan and the inputs), then one line
per finished conversation: its turns and the sparse-decode counters the server added
while it played (``sparse_counters``: the delta since the previous line of the same
server, or since the workload began). A resumed row plays only the conversations the
journal lacks, on a fresh server, and adds the journal's counters to its own. With
``concurrency`` 1 each line's counters are exactly its conversation's; above that, a
line may carry counters of conversations still in flight, which a killed run replays,
so the total can count a few steps twice.

A resumed conversation starts on a server whose prefix cache lacks the conversations
played before the interruption, as the first conversation of a row does: its prompt is
the same, and only where a cached prefix would have changed the prefill's chunking can
a near-tie answer differ. The long generations and speed chats are not journaled
(minutes, not hours): an interrupted row plays them again. The journal is removed once
the whole row is saved (``turns-<row>.json``).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict

from sgl_spec.bench import sparse_counters
from sgl_spec.bench.chat_client import TurnResult
from sgl_spec.bench.sparse_counters import SparseCounters


class Done:
    """What earlier runs of the row finished: turns by conversation, summed counters."""

    def __init__(self):
        self.turns: dict[str, list[TurnResult]] = {}
        self.counters: SparseCounters | None = None


class Journal:
    def __init__(self, out_dir: str, slug: str, fingerprint: str, resume: bool):
        """Open the row's journal: read back (``resume``, same fingerprint) or start it."""
        self.path = os.path.join(out_dir, f"journal-{slug}.jsonl")
        self.done = Done()
        self._lock = threading.Lock()
        self._last: SparseCounters | None = None
        if resume:
            self._read(fingerprint)
        if not self.done.turns:
            with open(self.path, "w") as f:
                f.write(json.dumps({"fingerprint": fingerprint}) + "\n")

    def _read(self, fingerprint: str) -> None:
        try:
            with open(self.path) as f:
                lines = f.read().splitlines()
        except OSError:
            return
        try:
            if not lines or json.loads(lines[0]).get("fingerprint") != fingerprint:
                return  # another row's inputs: start over
        except ValueError:
            return
        kept = lines[:1]
        for line in lines[1:]:
            try:
                rec = json.loads(line)
                turns = [TurnResult.from_json(t) for t in rec["turns"]]
            except (ValueError, KeyError, TypeError):
                break  # a line cut short by the interruption: the rest is replayed
            kept.append(line)
            self.done.turns[rec["conversation"]] = turns
            if rec.get("counters") is not None:
                self.done.counters = sparse_counters.plus(
                    self.done.counters, SparseCounters(*rec["counters"]))
        with open(self.path, "w") as f:  # without a torn line, so this run appends after
            f.write("".join(line + "\n" for line in kept))

    def start(self, counters: SparseCounters | None) -> None:
        """The server's counters as the workload begins (the first line's baseline)."""
        self._last = counters

    def record(self, conversation: str, turns: list[TurnResult] | None,
               counters: SparseCounters | None) -> None:
        """A finished conversation, with the server's counters read after it; ``turns``
        None: it failed, and the steps it made belong to no line (it is replayed)."""
        with self._lock:
            d = sparse_counters.minus(counters, self._last)
            self._last = counters
            if turns is None:
                return
            line = {"conversation": conversation, "turns": [asdict(t) for t in turns],
                    "counters": list(d) if d is not None else None}
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")

    def remove(self) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
