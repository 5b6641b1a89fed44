"""The long-generation offload benchmark without a server: one device KV byte budget for
every row, and the summary's ratios, budget check and agreement."""

from __future__ import annotations

from sgl_spec.bench import offload


def test_every_row_gets_the_same_device_kv_bytes():
    row, layers, budget = 768, 30, 4 * 640 * 30 * 768
    sparse = ["--x", "--spec-prefetch", "thread"]
    tokens = {r: offload.row_flags(r, budget, 12_000, row, layers, sparse)[1] for r in
              offload.ROWS}
    pool = {r: int(f[f.index("--max-total-tokens") + 1]) for r, f in tokens.items()}
    assert pool["stock"] == pool["exact"] == 2560  # 4 x 640 tokens at every layer
    assert pool["specontext"] == budget // (31 * row)  # + the head's layer
    off = tokens["specontext-offload"]
    assert off[off.index("--spec-offload-kv-bytes") + 1] == str(budget)
    assert pool["specontext-offload"] == 12_000 and "--x" in off
    inline = tokens["specontext-offload-inline"]
    assert inline[inline.index("--spec-prefetch") + 1] == "inline" and inline.count(
        "--spec-prefetch") == 1 and sparse[2] == "thread"  # the caller's list untouched
    assert [f for f in inline if f not in ("inline", "thread")] == [
        f for f in off if f not in ("inline", "thread")]


def _run(tok_s, texts, offload_report=None, alone=None):
    out = {"output_tok_s": tok_s, "decoding_at_once": 2, "retracted": 0,
           "completion_tokens": [3, 3], "texts": texts, "offload": offload_report}
    if alone is not None:
        out["alone"] = alone
    return out


def test_the_summary_checks_the_budget_and_compares_at_the_same_batch(hf_tok):
    rep = {"peak_device_bytes": 90, "over_budget": False,
           "last": {"host_layers": [28, 29], "host_loads": {"hidden_share": 0.5}}}
    played = {"exact": [_run(10.0, ["a", "b"])],
              "specontext": [_run(12.0, ["x y", "z"], alone=["one two", "three"])],
              "specontext-offload": [_run(25.0, ["q", "r"], rep, alone=["one two", "four"])]}
    s = offload.summarize(played, hf_tok, budget_bytes=100)
    o = s["specontext-offload"]
    assert o["tok_s_vs_exact"][1] == 2.5 and o["host_layers"] == 2 and o["hidden_share"] == 0.5
    assert offload._within(o) == "yes"
    ag = o["agreement_with_specontext"]
    assert ag["outputs"] == "each prompt alone" and ag["prefix"][0] == len(
        hf_tok.encode("one two", add_special_tokens=False))
    res = {"config": {"model": "m", "requests": 2, "prompt_tokens": 1, "gen_tokens": 3,
                      "budget_bytes": 100, "budget_tokens": 1, "kv_dtype": "bfloat16",
                      "specontext_budget": 64},
           "summary": s, "meta": {"git": {"commit": "abcdef123", "dirty": False}}}
    md = offload.markdown(res)
    assert "| specontext-offload | 2 / 2 | 0 | 25.00" in md and "abcdef1" in md
    o["peak_device_bytes"] = 101
    assert offload._within(o) == "no"
