"""Summaries, sgl_spec/stock ratios, output divergences and the markdown table.

Pure functions over plain data (no server, no I/O), so they are unit-tested.
A ratio is always ``sgl_spec / stock``: below 1 is better for times, above 1 for
throughput.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from sgl_spec.bench.chat_client import TurnResult

# Two greedy runs may pick different tokens only where the top two are this close
# (nats): bf16 arithmetic in a different attention kernel moves logits by ~1e-2.
NEAR_TIE_NATS = 0.1


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def ratio(spec: float | None, stock: float | None) -> float | None:
    """``spec / stock``, or None when either is missing or stock is 0."""
    if spec is None or stock is None or stock == 0:
        return None
    return spec / stock


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
        ttft_later_median_s=_median([t.ttft_s for t in later]),
        tpot_mean_s=_mean(tpots),
        tpot_median_s=_median(tpots),
        output_tokens=out_tokens,
        output_tok_per_s=out_tokens / busy if busy > 0 else None,
        prompt_tokens_later_mean=_mean([t.prompt_tokens for t in later]),
        cached_tokens_later_mean=_mean([t.cached_tokens for t in later]),
        cached_tokens_total=sum(t.cached_tokens for t in turns),
    )


def ratios(spec: dict, stock: dict) -> dict[str, float | None]:
    """``spec[k] / stock[k]`` for every numeric key both share."""
    out = {}
    for key, value in spec.items():
        other = stock.get(key)
        if isinstance(value, (int, float)) and isinstance(other, (int, float)):
            out[key] = ratio(float(value), float(other))
    return out


@dataclass(frozen=True)
class Divergence:
    """Where two greedy outputs for the same prompt first differ.

    ``position`` indexes the output tokens; the margins are top1 - top2 logprob
    (nats) at that position as each server saw it (None past the logprobs, i.e.
    at the final EOS).
    """

    position: int
    stock_token: int | None  # None: that output ended here
    spec_token: int | None
    stock_margin: float | None
    spec_margin: float | None
    near_tie: bool


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (a prefix differs at its end);
    None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def margin(top: Sequence[Sequence[tuple[str, float]]], position: int) -> float | None:
    """top1 - top2 logprob at ``position``, from per-position top-2 lists."""
    if position >= len(top) or len(top[position]) < 2:
        return None
    return top[position][0][1] - top[position][1][1]


def divergence(stock: TurnResult, spec: TurnResult,
               near_tie_nats: float = NEAR_TIE_NATS) -> Divergence | None:
    pos = first_divergence(stock.output_ids, spec.output_ids)
    if pos is None:
        return None
    m_stock = margin(stock.top_logprobs, pos)
    m_spec = margin(spec.top_logprobs, pos)
    known = [m for m in (m_stock, m_spec) if m is not None]
    return Divergence(
        position=pos,
        stock_token=stock.output_ids[pos] if pos < len(stock.output_ids) else None,
        spec_token=spec.output_ids[pos] if pos < len(spec.output_ids) else None,
        stock_margin=m_stock,
        spec_margin=m_spec,
        near_tie=bool(known) and min(known) <= near_tie_nats,
    )


def compare_turns(stock: Sequence[TurnResult], spec: Sequence[TurnResult],
                  near_tie_nats: float = NEAR_TIE_NATS) -> list[dict]:
    """Per turn: identical or not, and the divergence; pairs by (conversation, turn)."""
    by_key = {(t.conversation, t.turn): t for t in spec}
    out = []
    for a in stock:
        b = by_key.get((a.conversation, a.turn))
        if b is None:
            raise ValueError(f"sgl_spec has no result for {a.conversation} turn {a.turn}")
        div = divergence(a, b, near_tie_nats)
        out.append({
            "conversation": a.conversation,
            "turn": a.turn,
            "same_prompt": a.prompt_sha1 == b.prompt_sha1,
            "identical": div is None,
            "divergence": asdict(div) if div else None,
        })
    return out


def agreement(comparisons: Sequence[dict]) -> dict:
    """Counts over ``compare_turns`` output; ``acceptable`` = identical or near-tie."""
    n = len(comparisons)
    identical = sum(c["identical"] for c in comparisons)
    ties = sum(1 for c in comparisons if c["divergence"] and c["divergence"]["near_tie"])
    return {
        "turns": n,
        "identical": identical,
        "near_tie_divergences": ties,
        "other_divergences": n - identical - ties,
        "same_prompts": sum(c["same_prompt"] for c in comparisons),
        "acceptable": identical + ties == n,
    }


# --------------------------------------------------------------------------- markdown


def _fmt(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x * scale:.{digits}f}"


def _fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}x"


def _outputs_cell(agree: dict | None) -> str:
    if agree is None:
        return "n/a"
    if "requests" in agree:  # bench_serving: texts only, batched so not bit-stable
        return f"{agree['identical_texts']}/{agree['requests']} texts identical"
    if agree["identical"] == agree["turns"]:
        return f"identical ({agree['turns']}/{agree['turns']})"
    return (f"{agree['identical']}/{agree['turns']} identical, "
            f"{agree['near_tie_divergences']} near-tie, {agree['other_divergences']} other")


def markdown(results: dict) -> str:
    """The readable table of a ``results.json`` document."""
    lines = [
        f"# sgl_spec vs stock sglang (torch_native), {results['meta']['started']}",
        "",
        f"Model `{results['meta']['model']}`; ratios are sgl_spec / stock, measured in "
        "the same run (lower is better for times, higher for throughput). "
        "TTFT and TPOT in ms.",
        "",
        "| workload | server | TTFT turn 1 | TTFT turns >= 2 (mean) | TPOT (median) "
        "| output tok/s | cached tokens / turn >= 2 | outputs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, w in results["workloads"].items():
        for server in ("stock", "spec"):
            s = w[server]
            lines.append(
                f"| {name} | {server} | {_fmt(s.get('ttft_turn1_mean_s'), 1e3, 0)} "
                f"| {_fmt(s.get('ttft_later_mean_s'), 1e3, 0)} "
                f"| {_fmt(s.get('tpot_median_s'), 1e3, 1)} "
                f"| {_fmt(s.get('output_tok_per_s'))} "
                f"| {_fmt(s.get('cached_tokens_later_mean'), digits=0)} | |"
            )
        r = w["ratio"]
        lines.append(
            f"| {name} | **ratio** | {_fmt_ratio(r.get('ttft_turn1_mean_s'))} "
            f"| **{_fmt_ratio(r.get('ttft_later_mean_s'))}** "
            f"| {_fmt_ratio(r.get('tpot_median_s'))} "
            f"| {_fmt_ratio(r.get('output_tok_per_s'))} "
            f"| {_fmt_ratio(r.get('cached_tokens_later_mean'))} "
            f"| {_outputs_cell(w.get('agreement'))} |"
        )
    lines += ["", "For the bench_serving row, 'TTFT turn 1' is its mean TTFT over all "
              "requests (single-turn) and cached tokens are the total reported.", ""]
    lines += ["| server | start to healthy (s) | peak RSS (GiB) |", "|---|---|---|"]
    for server in ("stock", "spec"):
        srv = results["servers"][server]
        lines.append(f"| {server} | {_fmt(srv['start_s'], digits=1)} "
                     f"| {_fmt(srv['peak_rss_bytes'] / 2**30)} |")
    divs = [(name, c) for name, w in results["workloads"].items()
            for c in w.get("turns_compared", []) if not c["identical"]]
    if divs:
        lines += ["", "## Divergent turns", "",
                  "| workload | conversation | turn | position | stock token | sgl_spec token "
                  "| stock margin | sgl_spec margin | near tie |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, c in divs:
            d = c["divergence"]
            lines.append(
                f"| {name} | {c['conversation']} | {c['turn']} | {d['position']} "
                f"| {d['stock_token']} | {d['spec_token']} | {_fmt(d['stock_margin'], digits=3)} "
                f"| {_fmt(d['spec_margin'], digits=3)} | {d['near_tie']} |"
            )
    lines += ["", "Chat histories are fixed to stock's answers on both servers, so each "
              "turn compares the same prompt (see `same_prompt` in results.json).", ""]
    return "\n".join(lines)
