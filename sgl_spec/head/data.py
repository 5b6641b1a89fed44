"""Training sequences for the retrieval head: local text only.

Each sequence is a chat in the target's own template: one or two user turns of prose
from :mod:`sgl_spec.corpus` (Python's docstrings) with a few planted records ("The
ledger number of the quiet harbour is 7316.") and a question about one of them at
the beginning, middle or end of the turn, and the assistant's answer written out
(teacher forcing). The head learns the target's attention at two kinds of query
positions: the answer's tokens (decode steps that must find the record) and random
positions in the last third of the prose (generic decoding over a long history).

The words here are deliberately not those of the evaluation harness
(``sgl_spec.bench.dataset``): the head is judged on prompts it was not fitted to.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sgl_spec import corpus

KINDS = ("ledger number", "vault combination", "registry code", "tracking number",
         "permit number", "catalogue number")
ADJECTIVES = ("quiet", "northern", "crooked", "silver", "hollow", "distant", "narrow",
              "ancient", "windy", "sunken", "painted", "frozen")
NOUNS = ("harbour", "orchard", "observatory", "mill", "chapel", "granary", "quarry",
         "ferry", "bridge", "archive", "vineyard", "foundry")
POSITIONS = ("begin", "middle", "end")


@dataclass(frozen=True)
class Sample:
    ids: tuple[int, ...]  # the whole chat, template applied
    queries: tuple[int, ...]  # positions whose attention the head learns (ascending)
    answer: tuple[int, int]  # [start, end) of the last answer's tokens


def _record(rng: random.Random, used: set[str]) -> tuple[str, str]:
    while True:
        key = f"{rng.choice(KINDS)} of the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
        if key not in used:
            used.add(key)
            return key, str(rng.randint(1000, 9999))


def _turn(tokenizer, rng: random.Random, n_tokens: int, records: int, seed: int,
          used: set[str]) -> tuple[str, str, str]:
    """``(user message, question's record key, its value)``."""
    paras = [p.text for p in corpus.passages(tokenizer, n_tokens, seed=seed)]
    facts = [_record(rng, used) for _ in range(records)]
    for key, value in facts:
        at = rng.randint(0, len(paras))
        paras.insert(at, f"The {key} is {value}.")
    key, value = rng.choice(facts)
    question = f"What is the {key}? Answer with one sentence."
    where = rng.choice(POSITIONS)
    if where == "begin":
        paras.insert(0, question)
    elif where == "middle":
        paras.insert(len(paras) // 2, question)
    else:
        paras.append(question)
    return corpus.SEPARATOR.join(paras), key, value


def _ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def make(tokenizer, n_tokens: int, seed: int, generic_queries: int = 48) -> Sample:
    """One sequence of about ``n_tokens`` tokens (one turn, or two of half each)."""
    rng = random.Random(seed)
    turns = rng.choice((1, 2)) if n_tokens >= 2048 else 1
    used: set[str] = set()
    messages: list[dict] = []
    answer = ""
    for t in range(turns):
        user, key, value = _turn(tokenizer, rng, n_tokens // turns - 64, rng.randint(1, 3),
                                 seed * 7919 + t, used)
        answer = f"The {key} is {value}."
        messages.append({"role": "user", "content": user})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": answer})
    prefix = _ids(tokenizer, messages, generation_prompt=True)
    full = _ids(tokenizer, [*messages, {"role": "assistant", "content": answer}], False)
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template does not extend the prompt with the answer")
    end = len(prefix) + len(tokenizer.encode(answer, add_special_tokens=False))
    lo = (2 * len(prefix)) // 3
    generic = rng.sample(range(lo, len(prefix)), min(generic_queries, len(prefix) - lo))
    queries = sorted({*generic, *range(len(prefix), min(end, len(full)))})
    return Sample(tuple(full), tuple(queries), (len(prefix), end))


def samples(tokenizer, count: int, lengths: tuple[int, int], seed: int = 0) -> list[Sample]:
    """``count`` sequences of lengths drawn uniformly from ``lengths`` (tokens)."""
    rng = random.Random(seed)
    return [make(tokenizer, rng.randint(*lengths), seed=seed * 100003 + i)
            for i in range(count)]
