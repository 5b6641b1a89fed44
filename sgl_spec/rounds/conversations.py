"""Multi-round conversations made from the bundled corpus (nothing downloaded).

A round is one user message and the assistant's reply (Round Attention's ``<q_m, a_m>``).
Every user message carries a passage of prose with one planted fact ("The tracking number
of the hollow ferry is 4821."), the reply acknowledges it in one sentence; the last round
asks about the fact of one earlier round. The words are those of the head's training text
(``sgl_spec.head.data``), not of the evaluation harness.

    >>> conv = conversation(tok, rounds=20, round_tokens=(60, 160), seed=0)
    >>> conv.messages        # system, then user/assistant pairs, then the question
    >>> conv.asked           # the 1-based round whose fact the question asks for
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sgl_spec import corpus
from sgl_spec.head.data import ADJECTIVES, KINDS, NOUNS

SYSTEM = "You are a helpful assistant. Remember the facts the user tells you."


@dataclass(frozen=True)
class Fact:
    key: str    # "tracking number of the hollow ferry"
    value: str  # "4821"


@dataclass(frozen=True)
class Conversation:
    messages: tuple[dict, ...]  # system, user/assistant x rounds, the final user question
    facts: tuple[Fact, ...]     # the fact of round 1..rounds (index 0: round 1)
    asked: int                  # 1-based round whose fact the final question asks for

    @property
    def rounds(self) -> int:
        return len(self.facts)


def _facts(rng: random.Random, n: int) -> list[Fact]:
    keys: list[str] = []
    while len(keys) < n:
        key = f"{rng.choice(KINDS)} of the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
        if key not in keys:
            keys.append(key)
    return [Fact(k, str(rng.randint(1000, 9999))) for k in keys]


def conversation(tokenizer: corpus.Tokenizer, rounds: int, round_tokens: tuple[int, int],
                 seed: int, asked: int | None = None) -> Conversation:
    """``rounds`` rounds of about ``round_tokens`` (lo, hi) prose tokens each, then a
    question about round ``asked`` (1-based; drawn when None). ValueError on bad sizes."""
    lo, hi = round_tokens
    if rounds < 2 or not 16 <= lo <= hi:
        raise ValueError(f"need rounds >= 2 and 16 <= lo <= hi; got rounds={rounds}, "
                         f"round_tokens={round_tokens}")
    rng = random.Random(seed)
    facts = _facts(rng, rounds)
    sizes = [rng.randint(lo, hi) for _ in range(rounds)]
    chunks = corpus.chunks(tokenizer, sizes, seed=seed)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    for fact, chunk in zip(facts, chunks, strict=True):
        paras = [p.text for p in chunk]
        paras.insert(rng.randint(0, len(paras)), f"The {fact.key} is {fact.value}.")
        messages.append({"role": "user", "content": corpus.SEPARATOR.join(paras)})
        messages.append({"role": "assistant", "content": f"Noted: the {fact.key}."})
    if asked is None:
        asked = rng.randint(1, rounds)
    if not 1 <= asked <= rounds:
        raise ValueError(f"asked must be a round in 1..{rounds}, got {asked}")
    messages.append({"role": "user", "content": f"What is the {facts[asked - 1].key}? "
                                                "Answer with the number."})
    return Conversation(tuple(messages), tuple(facts), asked)
