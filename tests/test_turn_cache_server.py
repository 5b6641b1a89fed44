"""The turn-aware cache on a real server: ``GET /sgl_spec/cache``, Prometheus
gauges, and turn-aware eviction of dead reasoning branches; with sglang's
``--api-key``, sgl_spec's route asks for the key as sglang's own routes do, and
nothing sgl_spec adds shows prompt text."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import requests

from conftest import COMMON_FLAGS, EARLY_SERVERS, SPEC_CHECKS, Early, early_server
from sgl_spec.bench.server import SPEC

pytestmark = pytest.mark.server
DATA = Path(__file__).parent / "data"
QUESTIONS = ["Name a color.", "Name a fruit.", "Name a city.", "Name an animal."]


def cache_summary(url: str, key: str | None = None) -> dict:
    r = requests.get(url + "/sgl_spec/cache", headers=_auth(key), timeout=30)
    r.raise_for_status()
    return r.json()


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def chatml_tokens(hf_tok, role: str, content: str) -> int:
    return len(hf_tok.encode(f"<|im_start|>{role}\n{content}<|im_end|>\n",
                             add_special_tokens=False))


def check_four_rounds(summary: dict, hf_tok, system: str, turns, last_completion: int,
                      cut_by_length: bool):
    """The newest branch is the conversation: round 0 = system, rounds 1-4 =
    (user, assistant) with ChatML token counts; the last answer is still open.

    A stopped answer is cached through its stop token (<|im_end|>, counted as
    output). An answer cut at max_tokens is cached without its last token: it
    was sampled but never fed back, so it has no KV. Which one happens depends
    on the random session string, so both must hold."""
    branch = summary["branches"][0]
    rounds = branch["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3, 4]
    assert [t["role"] for t in rounds[0]["turns"]] == ["system"]
    assert rounds[0]["tokens"] == chatml_tokens(hf_tok, "system", system)
    for r, (question, answer) in zip(rounds[1:], turns):
        assert [t["role"] for t in r["turns"]] == ["user", "assistant"]
        assert r["turns"][0]["tokens"] == chatml_tokens(hf_tok, "user", question)
        assert r["tier"] == "device" and r["host_tokens"] == 0
        if r["round"] < 4:
            assert r["turns"][1]["tokens"] == chatml_tokens(hf_tok, "assistant", answer)
    opener = len(hf_tok.encode("<|im_start|>assistant\n", add_special_tokens=False))
    cached = last_completion - 1 if cut_by_length else last_completion
    assert rounds[4]["turns"][1]["tokens"] == opener + cached


def test_endpoint_reports_chat_api_rounds(spec_server, hf_tok):
    import openai

    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none")
    system = f"You are terse. Session {uuid.uuid4().hex[:8]}."
    msgs = [{"role": "system", "content": system}]
    turns = []
    for q in QUESTIONS:
        msgs.append({"role": "user", "content": q})
        r = client.chat.completions.create(model="default", messages=msgs,
                                           max_tokens=12, temperature=0)
        answer = r.choices[0].message.content
        msgs.append({"role": "assistant", "content": answer})
        turns.append((q, answer))
    s = cache_summary(spec_server.url)
    assert s["eviction_policy"] == "lru"
    assert set(s["turn_format"]["openers"]) == {"system", "user", "assistant", "tool"}
    check_four_rounds(s, hf_tok, system, turns, r.usage.completion_tokens,
                      r.choices[0].finish_reason == "length")


@pytest.mark.parametrize("max_tokens", [2, 12])  # 2: every answer is cut by length
def test_endpoint_reports_frontend_rounds(spec_server, hf_tok, max_tokens):
    import sglang as sgl

    system = f"You are terse. Session {uuid.uuid4().hex[:8]}."

    @sgl.function
    def four_rounds(s):
        s += sgl.system(system)
        for i, q in enumerate(QUESTIONS):
            s += sgl.user(q)
            s += sgl.assistant(sgl.gen(f"a{i}", max_tokens=max_tokens, temperature=0))

    state = four_rounds.run(backend=sgl.RuntimeEndpoint(spec_server.url))
    turns = [(q, state[f"a{i}"]) for i, q in enumerate(QUESTIONS)]
    meta = state.get_meta_info("a3")
    check_four_rounds(cache_summary(spec_server.url), hf_tok, system, turns,
                      meta["completion_tokens"], meta["finish_reason"]["type"] == "length")


# ---- a reasoning-style conversation under --spec-cache-eviction turn -----------

POOL = 1024
KEY = "sgl-spec-test-key"  # this server also runs with sglang's --api-key


def _turn_flags(model_path: str) -> list[str]:
    return ["--model-path", model_path, *COMMON_FLAGS, *SPEC_CHECKS,
            "--chat-template", str(DATA / "chatml_reasoning.jinja"),
            "--reasoning-parser", "qwen3", "--spec-cache-eviction", "turn",
            "--max-total-tokens", str(POOL), "--enable-metrics", "--api-key", KEY]


EARLY_SERVERS["turn_server"] = Early(SPEC, _turn_flags, lazy=True)  # not beside the unit
# tests: ten float32 servers at once leave the last one to boot no memory for its KV pool


@pytest.fixture(scope="module")
def turn_server(model_path):
    yield from early_server("turn_server", model_path)


def _generate(url: str, ids: list[int]) -> dict:
    r = requests.post(url + "/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
        headers=_auth(KEY), timeout=300)
    r.raise_for_status()
    return r.json()


def test_dead_reasoning_branches_are_evicted_first(turn_server, hf_tok):
    template = (DATA / "chatml_reasoning.jinja").read_text()

    def ids(msgs, gen=False):
        text = hf_tok.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                          add_generation_prompt=gen)
        return hf_tok.encode(text, add_special_tokens=False)

    # A reasoning model's turn caches prompt + <think>...</think> + answer; the
    # next prompt renders that turn without its reasoning, so the cached
    # reasoning branch is dead. Reproduce that token stream for 3 rounds.
    msgs = [{"role": "system", "content": "You think before you answer."}]
    for i, q in enumerate(["What is 2+2?", "And 3+3?", "And 4+4?"]):
        msgs.append({"role": "user", "content": q})
        _generate(turn_server.url, ids(msgs, gen=True))
        thought = f"<think>\nThe user asks sum number {i}. " + "Let me add. " * 8 + "\n</think>\n\n"
        msgs.append({"role": "assistant", "content": thought + f"It is {2 * (i + 2)}."})
        _generate(turn_server.url, ids(msgs))
    s = cache_summary(turn_server.url, KEY)
    dead = [b for b in s["branches"] if b["dead_reasoning"]]
    assert len(dead) == 3
    for b in dead:  # each holds one round's reasoning (and the answer after it)
        assert b["rounds"][-1]["turns"][-1]["reasoning_tokens"] > 30
    dead_tokens = sum(b["dead_tokens"] for b in dead)
    assert all(49 <= b["dead_tokens"] <= b["exclusive_tokens"] for b in dead)
    assert s["freed_tokens_by_rule"] == {
        "dead_reasoning": 0, "inactive_conversation": 0, "lru": 0}

    # Fill the pool with an unrelated request that needs about half of the dead
    # tokens evicted: only dead branches go.
    cached = s["totals"]["by_tier"]["device"]
    filler = hf_tok.encode(" filler words" * 2000, add_special_tokens=False)
    need = POOL - cached + dead_tokens // 2 - 8
    _generate(turn_server.url, filler[:need])
    s = cache_summary(turn_server.url, KEY)
    freed = s["freed_tokens_by_rule"]
    assert 0 < freed["dead_reasoning"] <= dead_tokens
    assert freed["inactive_conversation"] == 0 and freed["lru"] == 0

    # A request that needs more than every dead branch: all dead tokens are
    # freed, then whole inactive conversations.
    _generate(turn_server.url, filler[1000:1000 + POOL - 64])
    s = cache_summary(turn_server.url, KEY)
    freed = s["freed_tokens_by_rule"]
    assert freed["dead_reasoning"] == dead_tokens
    assert freed["inactive_conversation"] > 0
    assert not any(b["dead_reasoning"] for b in s["branches"])


def test_prometheus_metrics_beside_sglangs(turn_server):
    text = requests.get(turn_server.url + "/metrics", timeout=30).text  # open, as sglang's
    assert "sglang:num_running_reqs" in text
    gauges = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines() if line.startswith("sgl_spec:cached_tokens{")
    }
    s = cache_summary(turn_server.url, KEY)
    device = gauges['sgl_spec:cached_tokens{role="all",tier="device"}']
    assert device == s["totals"]["by_tier"]["device"] > 0
    for role in ("system", "user", "assistant"):
        assert gauges[f'sgl_spec:cached_tokens{{role="{role}",tier="all"}}'] == s[
            "totals"]["by_role"].get(role, 0)
    # The eviction counters agree with the endpoint (the test above evicted).
    for rule, n in s["freed_tokens_by_rule"].items():
        assert f'sgl_spec:evicted_tokens_total{{rule="{rule}"}} {float(n)}' in text
    assert s["freed_tokens_by_rule"]["dead_reasoning"] > 0


# ---- access: sglang's --api-key ------------------------------------------------------

def _status(url: str, path: str, key: str | None) -> int:
    return requests.get(url + path, headers=_auth(key), timeout=60).status_code


@pytest.mark.parametrize("key", [None, "wrong-key", KEY], ids=["no-key", "wrong-key", "key"])
def test_spec_route_needs_the_key_as_sglangs_routes_do(turn_server, key):
    """``/sgl_spec/cache`` answers as ``/server_info`` (sglang's read-only state route,
    the same auth level) does for each key; ``/metrics`` (sgl_spec's gauges beside
    sglang's) stays open, as sglang keeps it for Prometheus."""
    url = turn_server.url
    ours, theirs = _status(url, "/sgl_spec/cache", key), _status(url, "/server_info", key)
    assert ours == theirs == (200 if key == KEY else 401)
    assert _status(url, "/metrics", key) == 200


def test_nothing_spec_adds_shows_prompt_text(turn_server, hf_tok):
    """A prompt with a canary: neither the cache route, nor sgl_spec's part of
    ``/server_info``, nor sgl_spec's metrics carry its text or its token ids."""
    canary = f"zebra{uuid.uuid4().hex[:10]}quartz"
    ids = hf_tok.encode(f"<|im_start|>user\nRemember {canary}.<|im_end|>\n<|im_start|>"
                        "assistant\n", add_special_tokens=False)
    _generate(turn_server.url, ids)
    summary = cache_summary(turn_server.url, KEY)
    assert summary["totals"]["by_tier"]["device"] >= len(ids)    # it is cached
    info = requests.get(turn_server.url + "/server_info", headers=_auth(KEY), timeout=60).json()
    ours = [s["sgl_spec_cache"] for s in info["internal_states"] if "sgl_spec_cache" in s]
    metrics = [line for line in requests.get(turn_server.url + "/metrics", timeout=30)
               .text.splitlines() if line.startswith("sgl_spec")]
    canary_ids = hf_tok.encode(canary, add_special_tokens=False)
    for shown in (summary, ours, metrics):
        text = json.dumps(shown)
        assert canary not in text and "zebra" not in text
        assert not _has_run(shown, canary_ids)


def _has_run(obj, run: list[int]) -> bool:
    """Whether any list of ints in ``obj`` contains ``run`` contiguously."""
    if isinstance(obj, dict):
        return any(_has_run(v, run) for v in obj.values())
    if isinstance(obj, list):
        if len(obj) >= len(run) and all(isinstance(x, int) for x in obj):
            return any(obj[i:i + len(run)] == run for i in range(len(obj) - len(run) + 1))
        return any(_has_run(v, run) for v in obj)
    return False
