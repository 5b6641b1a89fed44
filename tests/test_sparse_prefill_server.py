"""LoopServe sparse prefill on a real server: a long prompt with a planted fact takes
the sparse path and answers like exact mode; a short prompt is exact mode's, token
for token. The LoopServe server is the session's (conftest), shared with the
sparse decode tests."""

from __future__ import annotations

import pytest
import requests

from _aborts import abort_streams, wait_until_freed
from sgl_spec import corpus
from sgl_spec.bench.dataset import Fact

QUESTION = "What is the capital of France?"
FACT = Fact(turn=0, colour="golden", object="lighthouse", kind="number", value="4817")
SPARSE = 'sgl_spec:sparse_prefill_extends_total{path="sparse"}'
EXACT = 'sgl_spec:sparse_prefill_extends_total{path="exact"}'
SEEDED = "sgl_spec:sparse_prefill_seeded_extends_total"


def chatml(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def long_prompt(hf_tok) -> str:
    """~1500 tokens of corpus prose, the fact planted at a sentence end in the middle."""
    text = corpus.document(hf_tok, 1450, seed=11)
    cut = text.find(". ", len(text) // 2) + 1 or len(text) // 2
    return chatml(f"{text[:cut]} {FACT.sentence}{text[cut:]}\n\n{FACT.question()}")


def generate(url: str, text: str, max_new_tokens: int) -> dict:
    body = {"text": text, "sampling_params": {"temperature": 0,
                                              "max_new_tokens": max_new_tokens}}
    resp = requests.post(url + "/generate", json=body, timeout=300)
    resp.raise_for_status()
    return resp.json()


def extends(url: str) -> dict[str, float]:
    out = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(("sgl_spec:sparse_prefill_extends_total", SEEDED)):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.mark.server
class TestSparsePrefill:
    @pytest.fixture(scope="class")
    @classmethod
    def servers(cls, hf_tok, spec_server, loopserve_server):
        """The shared LoopServe server (conftest: sparse prefill from 600 new tokens at
        the default alpha, decode covered by its budget) and the exact reference from the
        session's exact server, both caches flushed first."""
        prompts = {"long": long_prompt(hf_tok), "short": chatml(QUESTION)}
        for server in (spec_server, loopserve_server):
            requests.post(f"{server.url}/flush_cache", timeout=60).raise_for_status()
        reference = {k: generate(spec_server.url, p, 24) for k, p in prompts.items()}
        return loopserve_server, prompts, reference

    def test_long_prompt_prefills_sparse_and_answers_like_exact(self, servers):
        server, prompts, reference = servers
        before = extends(server.url)
        out = generate(server.url, prompts["long"], 24)
        after = extends(server.url)
        assert 1300 <= out["meta_info"]["prompt_tokens"] <= 1700
        assert delta(after, before, SPARSE) >= 1  # chunked prefill may split it
        assert delta(after, before, EXACT) == 0
        want = reference["long"]
        if FACT.value in want["text"]:
            assert FACT.value in out["text"], (out["text"], want["text"])
        else:  # exact mode misses the fact too: the answers must still agree closely
            assert out["output_ids"][:4] == want["output_ids"][:4], (out["text"], want["text"])

    def test_short_prompt_is_exact_modes(self, servers):
        server, prompts, reference = servers
        before = extends(server.url)
        out = generate(server.url, prompts["short"], 24)
        after = extends(server.url)
        assert out["meta_info"]["prompt_tokens"] < 256
        assert out["output_ids"] == reference["short"]["output_ids"]
        assert delta(after, before, SPARSE) == 0 and delta(after, before, EXACT) == 1

    def test_next_turn_is_seeded_with_the_lines_kept_on_the_tree(self, servers, hf_tok):
        """LoopServe prefill with reuse runs the turn-tagged tree core: turn 1's lines
        become a payload of its node, and turn 2, which continues it, selects seeded."""
        server, prompts, _ = servers
        cache = requests.get(server.url + "/sgl_spec/cache", timeout=30).json()
        assert cache["tree_core"] == "tagged" and cache["eviction_policy"] == "lru"
        first = generate(server.url, prompts["long"], 8)
        follow_up = corpus.document(hf_tok, 650, seed=12)  # >= 600 new tokens
        second = (prompts["long"] + first["text"] + "<|im_end|>\n"
                  + chatml(f"{follow_up}\n\nWhat was the secret number?"))
        before = extends(server.url)
        out = generate(server.url, second, 8)
        after = extends(server.url)
        assert out["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"]
        assert delta(after, before, SPARSE) >= 1
        assert delta(after, before, SEEDED) >= 1


@pytest.mark.server
def test_streams_aborted_in_prefill_and_decode_leave_no_lines_or_states(loopserve_server,
                                                                        hf_tok):
    """A long prompt (sparse prefill, lines offered to the tree and kept on its node) is
    answered; then, at once, another long prompt is cut by the client before its first
    token (during prefill) and a follow-up of the first (seeded by its kept lines) is
    cut mid-decode: no offered lines, seeds or decode states are left, and the server
    answers as before."""
    url = loopserve_server.url
    probe = chatml(QUESTION)
    generate(url, probe, 1)  # cached: before and after, its last token is recomputed
    reference = generate(url, probe, 16)["output_ids"]
    first = chatml(corpus.document(hf_tok, 650, seed=40))
    answer = generate(url, first, 4)["text"]
    follow = first + answer + "<|im_end|>\n" + chatml(corpus.document(hf_tok, 620, seed=41))
    abort_streams(url, [chatml(corpus.document(hf_tok, 620, seed=42)), follow], [0, 3],
                  max_new_tokens=24)
    assert generate(url, probe, 16)["output_ids"] == reference  # passes: seeds expire
    assert wait_until_freed(url) == {"prefill_lines_offered": 0, "prefill_seeds": 0,
                                     "decode_states": 0, "policy_states": 0,
                                     "policy_slots": 0}
