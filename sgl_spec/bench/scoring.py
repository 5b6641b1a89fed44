"""Scores of the multi-turn QA dataset (``sgl_spec.bench.dataset``): exact match and F1.

The answer is the first non-empty line of the model's reply (of a long-style question:
the whole reply, which restates the subject before the value); it is normalised as in
SQuAD (lowercase, no punctuation, no articles, single spaces) and scored by exact
match (the gold tokens appear as a contiguous run in it) and SQuAD token F1.
``accuracy`` aggregates per question position and per question source, as
LoopServe's Table 4 reports (Sec. 6.2.1). How closely two servers' outputs agree
token by token is ``sgl_spec.bench.agreement``.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sgl_spec.bench.dataset import POSITIONS, SOURCES, STYLES, Turn

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """SQuAD normalisation: lowercase, punctuation and articles removed, spaces collapsed."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def extract_answer(prediction: str, style: str = "short") -> str:
    """The first non-empty line of ``prediction``, stripped ('' when there is none); of a
    long-style answer, all of it on one line."""
    if style == "long":
        return " ".join(prediction.split())
    for line in prediction.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _contains(tokens: list[str], run: list[str]) -> bool:
    n = len(run)
    return any(tokens[i: i + n] == run for i in range(len(tokens) - n + 1))


def exact_match(prediction: str, gold: str, style: str = "short") -> bool:
    """True when the normalised gold answer is, or appears as a contiguous token run
    in, the normalised first line of ``prediction`` ("The code is 4817." matches
    "4817"; "48170" does not)."""
    pred = normalize(extract_answer(prediction, style)).split()
    ref = normalize(gold).split()
    if not ref:
        return not pred
    return _contains(pred, ref)


def token_f1(prediction: str, gold: str, style: str = "short") -> float:
    """SQuAD token F1 between the normalised first line of ``prediction`` and ``gold``
    (long style: 1.0 where the gold appears, else F1 of the whole reply)."""
    if style == "long" and exact_match(prediction, gold, style):
        return 1.0
    pred = normalize(extract_answer(prediction, style)).split()
    ref = normalize(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True)
class TurnScore:
    """One answered QA turn. ``position``/``source`` as in ``dataset.Turn``."""

    conversation: str
    turn: int  # 0-based
    position: str
    source: str
    prediction: str
    answer: str
    exact_match: bool
    f1: float
    style: str = "short"

    def __post_init__(self) -> None:
        if self.position not in POSITIONS or self.source not in SOURCES:
            raise ValueError(f"position must be in {POSITIONS} and source in {SOURCES}, "
                             f"got {self.position!r}, {self.source!r}")
        if not 0.0 <= self.f1 <= 1.0:
            raise ValueError(f"f1 must be in [0, 1], got {self.f1}")


def score_turn(conversation: str, turn: Turn, prediction: str) -> TurnScore:
    """Score the model's reply ``prediction`` to ``turn``."""
    return TurnScore(
        conversation=conversation, turn=turn.index, position=turn.position,
        source=turn.source, prediction=prediction, answer=turn.answer,
        exact_match=exact_match(prediction, turn.answer, turn.style),
        f1=token_f1(prediction, turn.answer, turn.style), style=turn.style,
    )


def answer_step(tokens: Sequence[str], gold: str) -> int | None:
    """How many output tokens came before the gold answer: the index of the token where
    ``gold`` starts in the concatenated ``tokens`` (the texts of the output tokens, in
    order); None when the output never says it. The decode steps before the answer."""
    text, ends = "", []
    for t in tokens:
        text += t
        ends.append(len(text))
    m = re.search(rf"(?<![0-9A-Za-z]){re.escape(gold)}(?![0-9A-Za-z])", text, re.IGNORECASE)
    if m is None:
        return None
    return next(i for i, end in enumerate(ends) if end > m.start())


def _summary(scores: list[TurnScore]) -> dict:
    n = len(scores)
    return {
        "n": n,
        "exact_match": sum(s.exact_match for s in scores) / n if n else None,
        "f1": sum(s.f1 for s in scores) / n if n else None,
    }


def accuracy(scores: Iterable[TurnScore]) -> dict:
    """Mean exact match and F1 overall, by position, by source and by both
    (``"middle/earlier_turn"``); only groups that occur are listed."""
    scores = list(scores)

    def by(keys, key) -> dict:
        groups = {k: [s for s in scores if key(s) == k] for k in keys}
        return {k: _summary(v) for k, v in groups.items() if v}

    return {
        "overall": _summary(scores),
        "by_position": by(POSITIONS, lambda s: s.position),
        "by_source": by(SOURCES, lambda s: s.source),
        "by_position_source": by([f"{p}/{s}" for p in POSITIONS for s in SOURCES],
                                 lambda s: f"{s.position}/{s.source}"),
        "by_style": by(STYLES, lambda s: s.style),
    }
