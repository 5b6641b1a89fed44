"""Per-configuration figures of an evaluation run, from the per-turn results.

Pure functions over ``chat_client.TurnResult`` and ``dataset`` objects (no server,
no I/O), so they are unit-tested with synthetic results. The figures of one
configuration (``config_figures``):

* accuracy (exact match, F1) overall, by query position, by question source, by
  both, by conversation size (``tokens_per_turn``) and by history length;
* speed: TTFT / TPOT / output tokens per second / cached tokens (``summarize_turns``)
  on the chat dataset, on the long-generation workload and on each speed chat
  (``chats``), and TTFT and TPOT per history-length bucket.

Figures that compare rows are elsewhere: greedy agreement with the reference in
``agreement``, ratios against the first row (``ratios``) and the checks in
``results``. A ratio is ``row / baseline``: below 1 is better for times, above 1
for throughput.

History length is the prompt's token count at that turn: the chat template, every
earlier user message and answer, and the new user message.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from sgl_spec.bench import scoring
from sgl_spec.bench.chat_client import TurnResult
from sgl_spec.bench.dataset import Conversation
from sgl_spec.bench.timing import median

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


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def ratio(x: float | None, baseline: float | None) -> float | None:
    """``x / baseline``, or None when either is missing or the baseline is 0."""
    if x is None or baseline is None or baseline == 0:
        return None
    return x / baseline


def ratios(row: dict, baseline: dict) -> dict[str, float | None]:
    """``row[k] / baseline[k]`` for every numeric key both share."""
    out = {}
    for key, value in row.items():
        other = baseline.get(key)
        if isinstance(value, (int, float)) and isinstance(other, (int, float)):
            out[key] = ratio(float(value), float(other))
    return out


@dataclass(frozen=True)
class ChatSummary:
    """One server on one chat workload. Times in seconds."""

    turns: int
    ttft_turn1_mean_s: float | None
    ttft_later_mean_s: float | None  # turns >= 2
    ttft_later_median_s: float | None
    tpot_mean_s: float | None
    tpot_median_s: float | None
    output_tokens: int
    output_tok_per_s: float | None  # all output tokens / all request time
    prompt_tokens_later_mean: float | None
    cached_tokens_later_mean: float | None
    cached_tokens_total: int


def summarize_turns(turns: Sequence[TurnResult]) -> ChatSummary:
    first = [t for t in turns if t.turn == 1]
    later = [t for t in turns if t.turn >= 2]
    tpots = [t.tpot_s for t in turns if t.tpot_s is not None]
    busy = sum(t.latency_s for t in turns)
    out_tokens = sum(t.output_tokens for t in turns)
    return ChatSummary(
        turns=len(turns),
        ttft_turn1_mean_s=_mean([t.ttft_s for t in first]),
        ttft_later_mean_s=_mean([t.ttft_s for t in later]),
        ttft_later_median_s=median(t.ttft_s for t in later),
        tpot_mean_s=_mean(tpots),
        tpot_median_s=median(tpots),
        output_tokens=out_tokens,
        output_tok_per_s=out_tokens / busy if busy > 0 else None,
        prompt_tokens_later_mean=_mean([t.prompt_tokens for t in later]),
        cached_tokens_later_mean=_mean([t.cached_tokens for t in later]),
        cached_tokens_total=sum(t.cached_tokens for t in turns),
    )


@dataclass(frozen=True)
class ChatTurn:
    """One dataset turn as one configuration answered it."""

    result: TurnResult
    score: scoring.TurnScore
    size: int  # the conversation's tokens_per_turn (the dataset's size axis)

    @property
    def history(self) -> str:
        return history_bucket(self.result.prompt_tokens)

    @property
    def answer_step(self) -> int | None:
        """Output tokens before the gold answer (None: never said); greedy, so the top
        logprob is the token chosen."""
        tokens = [top[0][0] if top else "" for top in self.result.top_logprobs]
        return scoring.answer_step(tokens, self.score.answer)


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
            "prompt_tokens_median": median(r.prompt_tokens for r in group),
            "ttft_median_s": median(r.ttft_s for r in group),
            "ttft_mean_s": statistics.fmean(r.ttft_s for r in group),
            "tpot_median_s": median(tpots),
            "cached_tokens_mean": statistics.fmean(r.cached_tokens for r in group),
        }
    return out


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
        "answer_step": turn.answer_step,
    }


LATE_ANSWER_STEPS = 24  # "answered only after >= 24 generated tokens"


def answer_timing(turns: Sequence[ChatTurn],
                  first_sparse: Callable[[int], int | None] | None = None) -> dict:
    """Where the answers came in the output, per question style, and how many decode
    steps before them attended a KV subset: ``first_sparse(prompt_tokens)`` is the
    row's first sparse step (``DecodeConfig.first_sparse_step``); None for a dense row.
    A step before the answer is one whose output token precedes the answer's first
    token, the step that produced that token included."""
    out: dict = {"by_style": {}}
    steps = sparse = 0
    for style in sorted({t.score.style for t in turns}):
        at = [a for t in turns if t.score.style == style and (a := t.answer_step) is not None]
        out["by_style"][style] = {
            "n": sum(t.score.style == style for t in turns), "answered": len(at),
            "median_step": median(at), "min_step": min(at, default=None),
            "share_late": sum(a >= LATE_ANSWER_STEPS for a in at) / len(at) if at else None}
    for t in turns:
        a = t.answer_step
        if a is None:
            continue
        steps += a
        first = first_sparse(t.result.prompt_tokens) if first_sparse else None
        sparse += max(0, a - first) if first is not None else 0
    out.update(decode_steps_before_answer=steps, sparse_steps_before_answer=sparse,
               sparse_share_before_answer=sparse / steps if steps else None)
    return out


def config_figures(turns: Sequence[ChatTurn], longgen: Sequence[TurnResult],
                   first_sparse: Callable[[int], int | None] | None = None) -> dict:
    """Every figure of one configuration that does not need another configuration;
    ``first_sparse`` as in ``answer_timing``."""
    chat = [t.result for t in turns]
    return {
        "answer_timing": answer_timing(turns, first_sparse),
        "accuracy": scoring.accuracy(t.score for t in turns),
        "accuracy_by_size": accuracy_by(turns, lambda t: t.size),
        "accuracy_by_history": accuracy_by(turns, lambda t: t.history, bucket_order()),
        "end_this_turn_short": end_this_turn_short(turns),
        "speed": {
            "chat": asdict(summarize_turns(chat)),
            "longgen": asdict(summarize_turns(longgen)),
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
