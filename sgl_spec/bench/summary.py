"""Per-configuration figures of an evaluation run, from the per-turn results.

Pure functions over ``chat_client.TurnResult`` and ``dataset`` objects (no server,
no I/O), so they are unit-tested with synthetic results. The figures of one
configuration (``config_figures``):

* accuracy (exact match, F1) overall, by query position, by question source, by
  both, by conversation size (``tokens_per_turn``) and by history length;
* speed: TTFT / TPOT / output tokens per second / cached tokens (``report.summarize_turns``)
  on the chat dataset and on the long-generation workload, and TTFT and TPOT per
  history-length bucket;
* greedy agreement with the reference configuration, turn by turn
  (``agreement_figures``).

History length is the prompt's token count at that turn: the chat template, every
earlier user message and answer, and the new user message.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from sgl_spec.bench import report, scoring
from sgl_spec.bench.chat_client import TurnResult
from sgl_spec.bench.dataset import Conversation

# Upper bounds (exclusive) of the history-length buckets, in prompt tokens; the
# last bucket is open. SmolLM2's window is 8192.
HISTORY_EDGES: tuple[int, ...] = (1024, 2048, 3072, 4096, 6144)
# "The smallest history size" of the solvability check: the first two buckets.
SHORT_HISTORY = 2048


def history_bucket(prompt_tokens: int, edges: Sequence[int] = HISTORY_EDGES) -> str:
    """``"0-1k"``, ``"1k-2k"``, ..., ``">=6k"`` for the default edges."""
    def k(n: int) -> str:
        return f"{n // 1024}k" if n % 1024 == 0 and n else str(n)

    lo = 0
    for hi in edges:
        if prompt_tokens < hi:
            return f"{k(lo)}-{k(hi)}"
        lo = hi
    return f">={k(lo)}"


def bucket_order(edges: Sequence[int] = HISTORY_EDGES) -> list[str]:
    """Every bucket label, shortest histories first."""
    return [history_bucket(e - 1, edges) for e in edges] + [history_bucket(edges[-1], edges)]


@dataclass(frozen=True)
class ChatTurn:
    """One dataset turn as one configuration answered it."""

    result: TurnResult
    score: scoring.TurnScore
    size: int  # the conversation's tokens_per_turn (the dataset's size axis)

    @property
    def history(self) -> str:
        return history_bucket(self.result.prompt_tokens)


def score_conversations(conversations: Sequence[Conversation],
                        results: Sequence[TurnResult]) -> list[ChatTurn]:
    """Pair every dataset turn with its result (by conversation name and turn) and score
    it; in dataset order. Raises ValueError if a turn has no result."""
    by_key = {(r.conversation, r.turn): r for r in results}
    out = []
    for conv in conversations:
        for turn in conv.turns:
            result = by_key.get((conv.name, turn.index + 1))  # TurnResult.turn is 1-based
            if result is None:
                raise ValueError(f"no result for {conv.name} turn {turn.index + 1}")
            out.append(ChatTurn(result, scoring.score_turn(conv.name, turn, result.text),
                                conv.tokens_per_turn))
    return out


def accuracy_by(turns: Iterable[ChatTurn], key: Callable[[ChatTurn], object],
                order: Sequence | None = None) -> dict:
    """``scoring.accuracy`` per group of ``key``; groups in ``order`` (else sorted),
    only those that occur. Keys are made strings (JSON)."""
    turns = list(turns)
    keys = list(order) if order is not None else sorted({key(t) for t in turns})
    out = {}
    for k in keys:
        group = [t.score for t in turns if key(t) == k]
        if group:
            out[str(k)] = scoring.accuracy(group)
    return out


def end_this_turn_short(turns: Sequence[ChatTurn], max_history: int = SHORT_HISTORY) -> dict:
    """The issue's solvability figure: end-position questions about the current turn
    among the turns with the shortest histories (prompt < ``max_history`` tokens: the
    first two history buckets, where the default dataset has enough such questions;
    its smallest conversation size alone has one or two)."""
    group = [t.score for t in turns if t.result.prompt_tokens < max_history
             and t.score.position == "end" and t.score.source == "this_turn"]
    n = len(group)
    return {
        "max_history_tokens": max_history,
        "n": n,
        "exact_match": sum(s.exact_match for s in group) / n if n else None,
        "f1": sum(s.f1 for s in group) / n if n else None,
    }


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def speed_by_history(results: Iterable[TurnResult],
                     edges: Sequence[int] = HISTORY_EDGES) -> dict:
    """Per history-length bucket (in order): turns, median prompt tokens, TTFT and TPOT."""
    results = list(results)
    out = {}
    for bucket in bucket_order(edges):
        group = [r for r in results if history_bucket(r.prompt_tokens, edges) == bucket]
        if not group:
            continue
        tpots = [r.tpot_s for r in group if r.tpot_s is not None]
        out[bucket] = {
            "n": len(group),
            "prompt_tokens_median": _median([r.prompt_tokens for r in group]),
            "ttft_median_s": _median([r.ttft_s for r in group]),
            "ttft_mean_s": statistics.fmean(r.ttft_s for r in group),
            "tpot_median_s": _median(tpots),
            "cached_tokens_mean": statistics.fmean(r.cached_tokens for r in group),
        }
    return out


def agreement_figures(reference: Sequence[TurnResult], candidate: Sequence[TurnResult],
                      near_tie_nats: float = report.NEAR_TIE_NATS) -> dict:
    """Greedy agreement of ``candidate`` with ``reference`` (the same prompts), per turn.

    ``counts``: identical turns, divergences at a near tie (top1-top2 margin below
    ``near_tie_nats``) and others, and how many turns were sent the same prompt
    (each configuration plays its own answers as history, so after a divergence
    later prompts differ). ``tokens``: tokens before the first divergence and share
    of matching positions (``scoring.greedy_agreement``). ``turns``: per turn,
    with ``report.compare_turns``' "stock" meaning the reference.
    """
    compared = report.compare_turns(reference, candidate, near_tie_nats)
    by_key = {(t.conversation, t.turn): t for t in candidate}
    tokens = [scoring.greedy_agreement(r.output_ids, by_key[(r.conversation, r.turn)].output_ids)
              for r in reference]
    return {
        "counts": report.agreement(compared),
        "tokens": scoring.agreement_summary(tokens),
        "turns": compared,
    }


def turn_record(turn: ChatTurn) -> dict:
    """A chat turn for results.json: scores, timing and sizes, not ids or logprobs."""
    r = turn.result
    return {
        **asdict(turn.score),
        "size": turn.size,
        "history": turn.history,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "output_tokens": r.output_tokens,
        "ttft_s": r.ttft_s,
        "tpot_s": r.tpot_s,
        "latency_s": r.latency_s,
        "finish_reason": r.finish_reason,
    }


def config_figures(turns: Sequence[ChatTurn], longgen: Sequence[TurnResult]) -> dict:
    """Every figure of one configuration that does not need another configuration."""
    chat = [t.result for t in turns]
    return {
        "accuracy": scoring.accuracy(t.score for t in turns),
        "accuracy_by_size": accuracy_by(turns, lambda t: t.size),
        "accuracy_by_history": accuracy_by(turns, lambda t: t.history, bucket_order()),
        "end_this_turn_short": end_this_turn_short(turns),
        "speed": {
            "chat": asdict(report.summarize_turns(chat)),
            "longgen": asdict(report.summarize_turns(longgen)),
        },
        "speed_by_history": speed_by_history(chat),
        "turns": [turn_record(t) for t in turns],
        "longgen_turns": [
            {"prompt": r.conversation, "prompt_tokens": r.prompt_tokens,
             "output_tokens": r.output_tokens, "finish_reason": r.finish_reason,
             "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "latency_s": r.latency_s}
            for r in longgen
        ],
    }
