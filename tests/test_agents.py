"""The research-assistant agent: its plan parser (no server) and a real end-to-end run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sgl_spec.agents.research_assistant import (
    FALLBACK_SUB_QUESTIONS,
    AgentConfig,
    load_document,
    parse_sub_questions,
    stdlib_document,
    truncate,
)


@pytest.mark.parametrize(
    "plan, expected",
    [
        ("1. What does wrap do?\n2. What is dedent for?\n3. How is fill used?",
         ["What does wrap do?", "What is dedent for?", "How is fill used?"]),
        ("- What does wrap do?\n* What is dedent for?",
         ["What does wrap do?", "What is dedent for?"]),
        ("Here are the questions:\n\n1) What does wrap do?\n\n2) What is dedent for?\n",
         ["What does wrap do?", "What is dedent for?"]),
        ("Q1: What does wrap do?\nQuestion 2: What is dedent for?",
         ["What does wrap do?", "What is dedent for?"]),
        ("1. What is this module for?\n2. How do you use it?\n3. What is this module for?",
         ["What is this module for?", "How do you use it?"]),
        ("1. Explain how wrapping works in detail\n2. What is dedent for?",
         ["What is dedent for?", "Explain how wrapping works in detail"]),
        ("1. What does wrap do?\n2. What is dedent for?\n3. How is fill used?\n4. What is shorten?",
         ["What does wrap do?", "What is dedent for?", "How is fill used?"]),
    ],
    ids=["numbered", "bullets", "preamble-blank-lines", "q-labels", "duplicates",
         "statement-after-questions", "capped"],
)
def test_parse_sub_questions(plan, expected):
    assert parse_sub_questions(plan, max_questions=3) == expected


@pytest.mark.parametrize(
    "plan",
    ["", "The module wraps text.", "1. What?\n2. Why?", "1. What does wrap do?\n1. What does wrap do?"],
    ids=["empty", "no-questions", "too-short", "only-duplicates"],
)
def test_parse_sub_questions_falls_back(plan):
    assert parse_sub_questions(plan, max_questions=3) == list(FALLBACK_SUB_QUESTIONS[:3])
    assert parse_sub_questions(plan, max_questions=2) == list(FALLBACK_SUB_QUESTIONS[:2])


def test_truncate_cuts_at_paragraph():
    text = "a" * 60 + "\n\n" + "b" * 60
    assert truncate(text, 100) == "a" * 60
    assert truncate(text, 1000) == text


def test_default_document_is_bounded_prose():
    doc = stdlib_document("textwrap", max_chars=7000)
    assert 3000 < len(doc) <= 7000
    assert "dedent" in doc and "wrap" in doc


def test_load_document_from_file(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("Para one.\n\nPara two is here.\n")
    assert load_document(str(path), max_chars=12) == "Para one."
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        load_document(str(tmp_path / "empty.txt"))


@pytest.mark.parametrize("n", [1, 5], ids=["too-few", "too-many"])
def test_config_rejects_bad_sub_question_count(n):
    with pytest.raises(ValueError, match="valid: 2..4"):
        AgentConfig(max_sub_questions=n)


@pytest.mark.server
def test_agent_end_to_end_through_the_cli(spec_server):
    """The agent as a user runs it (``--json``), with shorter generations than its
    defaults (CPU time); the calls are the same."""
    out = subprocess.run(
        [sys.executable, "-m", "sgl_spec.agents.research_assistant",
         "--port", str(spec_server.port), "--sub-questions", "2", "--max-doc-chars", "2400",
         "--plan-tokens", "40", "--answer-tokens", "16", "--report-tokens", "24",
         "--follow-up-tokens", "16",
         "--follow-up", "Which function removes common leading whitespace?", "--json"],
        capture_output=True, text=True, timeout=1200, env=dict(os.environ),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    # Fork/join happened: one non-empty answer per sub-question, then a report.
    assert len(data["sub_questions"]) == len(data["sub_answers"]) == 2
    assert all(a.strip() for a in data["sub_answers"]) and data["report"].strip()
    assert data["follow_up"] and data["follow_up"].strip()
    calls = {c["name"]: c for c in data["calls"]}
    assert list(calls) == ["plan", "answer[0]", "answer[1]", "report", "follow_up"]
    assert data["prompt_tokens"] == sum(c["prompt_tokens"] for c in data["calls"])
    assert data["cached_tokens"] == sum(c["cached_tokens"] for c in data["calls"])
    assert data["hit_ratio"] == pytest.approx(data["cached_tokens"] / data["prompt_tokens"])
    plan = calls["plan"]
    assert plan["prompt_tokens"] > 400  # the document is in the prompt
    for i in range(2):
        fork = calls[f"answer[{i}]"]
        # The fork shares the document + plan prefix: at least the whole plan prompt is cached.
        assert fork["cached_tokens"] >= plan["prompt_tokens"], fork
        assert fork["prompt_tokens"] > fork["cached_tokens"] and fork["completion_tokens"] > 0
    # The report and the follow-up extend the main conversation, which stays cached.
    assert calls["report"]["cached_tokens"] >= plan["prompt_tokens"]
    assert calls["follow_up"]["cached_tokens"] >= calls["report"]["cached_tokens"]
    assert data["hit_ratio"] > 0.5


@pytest.mark.server
def test_agent_through_the_openai_api(spec_server):
    """The same calls through sglang's OpenAI chat API (what the llama.cpp rows of
    bench.side_by_side use): the forks share the plan's cached prefix; a second run pinned
    to the first is sent the same prompts, whatever it answers."""
    from sgl_spec.agents import research_assistant as ra

    config = ra.AgentConfig(max_sub_questions=2, plan_tokens=40, answer_tokens=8,
                            report_tokens=8)
    doc = ra.stdlib_document(max_chars=2400)
    first = ra.run_research_openai(spec_server.url, doc, config=config)
    again = ra.run_research_openai(spec_server.url, doc, config=config, pinned=first)
    for res in (first, again):
        names = [c.name for c in res.calls]
        assert names == ["plan", *(f"answer[{i}]" for i in range(len(res.sub_questions))),
                         "report"], names
        assert res.follow_up is None and res.report and all(res.sub_answers)
    plan = first.calls[0]
    assert plan.prompt_tokens > 400
    for fork in first.calls[1:-1]:  # the document, the plan and its answer were cached
        assert plan.prompt_tokens <= fork.cached_tokens < fork.prompt_tokens, fork
    assert [c.prompt_tokens for c in again.calls] == [c.prompt_tokens for c in first.calls]
    assert again.calls[0].cached_tokens >= plan.prompt_tokens - 1  # all but the last token


@pytest.mark.parametrize("argv", [["--answer-tokens", "0"], ["--sub-questions", "9"],
                                  ["--max-doc-chars", "-1"], ["--model", "m"],
                                  ["--api", "openai", "--chat-template", "chatml"],
                                  ["--api", "vllm"]])
def test_cli_bad_values_exit_2_naming_the_flag(argv, capsys):
    from sgl_spec.agents import research_assistant

    with pytest.raises(SystemExit) as exc:
        research_assistant.main(["--port", "1", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert any(m in err for m in ("must be positive", "valid: 2..4", "valid: drop it",
                                  "choose from 'sglang', 'openai'")), err
