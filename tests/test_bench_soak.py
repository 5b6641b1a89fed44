"""The soak harness's pure parts (no server): RSS growth after warm-up, the summary of
a row's records and samples, greedy agreement on the visits both rows completed."""

from __future__ import annotations

import pytest

from sgl_spec.bench import soak
from sgl_spec.bench.soak_load import KINDS, Mix


def _sample(t: float, rss: float, live: dict | None = None) -> dict:
    return {"t_s": t, "rss_bytes": rss, "sglang:token_usage": 0.5, "live": live,
            "evicted_tokens": int(t)}


def test_rss_growth_compares_the_last_minute_with_the_minute_after_warmup():
    samples = [_sample(t, 100 if t < 180 else 110) for t in range(0, 600, 5)]
    assert soak.rss_growth(samples, warmup_s=120) == pytest.approx(0.10)
    assert soak.rss_growth(samples[:30], warmup_s=120) is None  # ends inside warm-up


def _turn(key: str, ids: list[int], top=None) -> dict:
    return {"conversation": key, "turn": 1, "ttft_s": 0.1, "latency_s": 0.2,
            "prompt_tokens": 10, "cached_tokens": 0, "output_tokens": len(ids),
            "finish_reason": "stop", "text": "", "prompt_sha1": "p" + key,
            "output_ids": ids, "top_logprobs": top or [[["a", -0.1], ["b", -3.0]]] * len(ids)}


def _rec(key: str, kind: str, status: str = "ok", turn=None, http=None, sha=None) -> dict:
    return {"key": key, "kind": kind, "start_s": 0.0, "end_s": 1.0, "status": status,
            "http_status": http, "error": None, "turn": turn, "output_sha1": sha}


def test_summary_counts_intended_outcomes_apart_from_failures_and_compares_greedy():
    ref = {"name": "exact", "end_live": {"decode_states": 0}, "samples": [_sample(0, 1)],
           "records": [_rec("c0-v0", "chat", turn=_turn("c0-v0", [1, 2, 3])),
                       _rec("c0-v1", "agent", sha="x"),
                       _rec("c0-v2", "longgen", turn=_turn("c0-v2", [4, 5]))]}
    tie = [[["a", -0.70], ["b", -0.72]]] * 3
    row = {"name": "pressure", "end_live": {"decode_states": 1},
           "samples": [_sample(0, 1, {"decode_states": 3}), _sample(5, 1)],
           "records": [_rec("c0-v0", "chat", turn=_turn("c0-v0", [1, 9, 3], tie)),
                       _rec("c0-v1", "agent", sha="x"),
                       _rec("c0-v3", "abort", status="aborted"),
                       _rec("c0-v4", "over_limit", status="rejected", http=400),
                       _rec("c0-v5", "chat", status="rejected", http=503),
                       _rec("c0-v6", "growing", status="failed")]}
    s = soak.summarize(row, warmup_s=0, reference=ref)
    assert s["requests"] == 6 and s["unexpected"] == 2  # the 503 and the failure
    assert s["by_kind"]["abort"] == {"aborted": 1} and set(s["by_kind"]) == set(KINDS)
    assert s["rejected_statuses"] == {"over_limit 400": 1, "chat 503": 1}
    assert not s["ended_empty"] and s["peak_live"] == {"decode_states": 3}
    assert s["evicted_tokens"] == 5
    ag = s["agreement"]
    assert ag["turns"]["turns"] == 1 and ag["turns"]["near_tie_divergences"] == 1
    assert ag["agent_runs"] == 1 and ag["agent_identical"] == 1
    assert "agreement" not in soak.summarize(ref, 0, ref)


def test_mix_rejects_bad_weights_and_sizes():
    with pytest.raises(ValueError, match="weights"):
        Mix(chat=0, growing=0, agent=0, longgen=0, abort=0, over_limit=0)
    with pytest.raises(ValueError, match="answer_tokens"):
        Mix(answer_tokens=0)
    assert soak.working_set(2, Mix()) == 2 * (900 + 96)
