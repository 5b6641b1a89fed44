"""The side-by-side benchmark without servers: its rows, bench_serving's command, the SSE
shim for llama.cpp's keep-alive lines, and the summary's ratios and tables."""

from __future__ import annotations

import pytest

from sgl_spec.bench import side_by_side as sbs


def test_every_row_names_a_server_and_the_default_rows_exist():
    assert set(sbs.DEFAULT_ROWS) <= set(sbs.ROWS)
    assert sbs.ROWS["stock"].module == "sglang.launch_server"
    assert "--attention-backend" in sbs.ROWS["stock"].flags
    assert sbs.ROWS["sgl_spec"].flags == ()  # its defaults: exact attention
    assert {r.gguf for r in sbs.ROWS.values() if r.kind == "llama.cpp"} == {"bf16", "f16",
                                                                             "quant"}


def test_every_sglang_row_gets_one_pool_that_holds_the_workload_at_once():
    c32 = sbs.workload("serving", (1, 8, 32))
    pools = {name: sbs.sglang_args(sbs.ROWS[name], "/m", c32) for name in ("stock", "sgl_spec")}
    sizes = {name: int(a[a.index("--max-total-tokens") + 1]) for name, a in pools.items()}
    assert sizes["stock"] == sizes["sgl_spec"] >= 32 * (1024 + 128)
    c8 = sbs.workload("serving", (8,))  # never below the launcher's CPU default
    assert c8.pool_tokens == sbs.CPU_MAX_TOTAL_TOKENS > 8 * c8.ctx


def test_bench_serving_runs_through_the_openai_backend_at_the_given_concurrency():
    cmd = sbs.bench_serving_cmd("http://h:1", "/m", "/o.jsonl", "random-ids", 64, 8)
    assert cmd[1:3] == ["-m", "sgl_spec.bench.bench_serving_sse"]
    def flag(name):
        return cmd[cmd.index(name) + 1]

    assert flag("--backend") == "sglang-oai" and flag("--max-concurrency") == "8"
    assert flag("--random-input-len") == "1024" and flag("--random-output-len") == "128"
    gsp = sbs.bench_serving_cmd("http://h:1", "/m", "/o.jsonl", "generated-shared-prefix",
                                64, 8)
    assert "--gsp-system-prompt-len" in gsp and "--random-input-len" not in gsp
    assert gsp[gsp.index("--gsp-prompts-per-group") + 1] == "8"


def test_sse_comment_lines_are_skipped_and_data_lines_kept():
    from sgl_spec.bench.bench_serving_sse import skip_comments

    def remove_prefix(text, prefix):
        return text[len(prefix):] if text.startswith(prefix) else text

    f = skip_comments(remove_prefix)
    assert f(":", "data: ") == "[DONE]"  # llama-server's keep-alive
    assert f('data: {"a": 1}', "data: ") == '{"a": 1}'
    assert f("data: [DONE]", "data: ") == "[DONE]"


def test_the_quantized_gguf_is_known_only_for_prepared_models():
    with pytest.raises(ValueError, match="valid models: SmolLM2-135M-Instruct"):
        sbs.quant_gguf("/somewhere/Unknown-1B")


def _serving(tok_s):
    return {str(c): {"output_throughput": t, "mean_ttft_ms": 100.0, "mean_tpot_ms": 50.0}
            for c, t in zip((1, 8), tok_s)}


def test_serving_ratios_are_against_the_first_row_with_their_spread():
    played = {"stock": [_serving((10, 40)), _serving((12, 40))],
              "sgl_spec": [_serving((11, 60)), _serving((12, 44))]}
    s = sbs.summarize("serving", played)
    assert s["sgl_spec"]["8"]["output_throughput"] == (44, 52.0, 60)
    assert s["sgl_spec"]["8"]["vs_first"] == pytest.approx((1.1, 1.3, 1.5))
    assert s["stock"]["1"]["vs_first"] == (1.0, 1.0, 1.0)
    md = sbs.markdown({"summary": s, "workload": "serving", "meta": {"git": "x"},
                       "config": {"model": "m", "rounds": 2}})
    assert "| sgl_spec | 11.50 (11.00-12.00) | 52.00 (44.00-60.00) |" in md
    assert "1.30 (1.10-1.50)" in md


def test_doc_chat_reports_ttft_per_turn_and_agreement_with_sgl_spec():
    def chat(ttfts, texts):
        return {"doc-3k": [{"ttft_s": t, "text": x} for t, x in zip(ttfts, texts)]}

    played = {"stock": [chat((2.0, 1.0), ("a", "b"))],
              "sgl_spec": [chat((1.0, 0.5), ("a", "b"))],
              "llama.cpp-bf16": [chat((1.0, 0.25), ("a", "c"))]}
    s = sbs.summarize("doc-chat", played)
    assert s["sgl_spec"]["ttft_vs_first"][1] == 0.5
    assert s["llama.cpp-bf16"]["answers_equal_sgl_spec"] == 0.5
    assert s["llama.cpp-bf16"]["ttft_s"]["doc-3k/2"] == (0.25, 0.25, 0.25)
    md = sbs.markdown({"summary": s, "workload": "doc-chat", "meta": {"git": "x"},
                       "config": {"model": "m", "rounds": 1}})
    assert "TTFT doc-3k/1 | TTFT doc-3k/2" in md and "| 0.50 |" in md


def test_agent_speed_is_the_first_rows_seconds_over_the_rows_and_answers_are_compared():
    def agent(seconds, cached, answers):
        return {d: {"elapsed_s": seconds, "hit_ratio": cached, "prompt_tokens": 100,
                    "plan": "p", "sub_answers": list(answers), "report": "r",
                    "follow_up": "f"} for d in sbs.AGENT_DOCS}

    played = {"stock": [agent(20.0, 0.8, "ab")], "sgl_spec": [agent(10.0, 0.9, "ab")],
              "llama.cpp-bf16": [agent(40.0, 0.5, "ax")]}
    s = sbs.summarize("agent", played)
    assert s["sgl_spec"]["json"]["vs_first"] == (2.0, 2.0, 2.0)       # twice as fast
    assert s["llama.cpp-bf16"]["json"]["vs_first"] == (0.5, 0.5, 0.5)
    # 5 texts per run (plan, 2 answers, report, follow-up), one answer differs
    assert s["llama.cpp-bf16"]["answers_equal_sgl_spec"] == pytest.approx(
        (4 * len(sbs.AGENT_DOCS)) / (5 * len(sbs.AGENT_DOCS)))
    md = sbs.markdown({"summary": s, "workload": "agent", "meta": {"git": "x"},
                       "config": {"model": "m", "rounds": 1}})
    assert "| row | textwrap s | json s | argparse s | cached textwrap |" in md
    assert "| sgl_spec | 10.00 (10.00-10.00) | 10.00 (10.00-10.00) |" in md
    assert "| 0.90 (0.90-0.90) | 2.00 (2.00-2.00) |" in md and md.endswith("| 0.80 |\n")


def test_bad_flags_exit_2_naming_the_valid_choices(capsys):
    with pytest.raises(SystemExit) as e:
        sbs.main(["--workload", "serving", "--rows", "vllm", "--out", "/tmp/x"])
    assert e.value.code == 2 and "llama.cpp-bf16" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        sbs.main(["--workload", "serving", "--prompts", "4", "--out", "/tmp/x"])
    assert e.value.code == 2 and "--prompts >= 8" in capsys.readouterr().err
