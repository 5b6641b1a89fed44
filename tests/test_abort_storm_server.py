"""Aborted streams, malformed and over-limit requests at once, then the answers of a
fresh cache (issue 48): for exact, loopserve (sparse decode and sparse prefill) and
specontext, each on a server that checks sgl_spec's invariants after every step.

The storm: concurrent streamed chat requests cut by the client at seeded points (0
chunks: before the first token, during their prefill; later: during decode, sparse
where the history allows), the first one over a long shared system prompt, while the
six malformed requests of ``sgl_spec.bench.aborts`` go in beside them. The specontext
server's pool (1400 tokens, HiCache) cannot hold the storm, so its requests also queue,
retract and restore from the host tier. Afterwards every per-request structure is
empty, the invariant checks found nothing, and greedy answers to short questions (the
chat template's system prompt, which the storm's requests computed first) and to a
question over the shared system prompt equal those the server gave on an empty cache
before the storm, or differ at a near tie, margin shown.
"""

from __future__ import annotations

import random

import pytest
import requests

from _aborts import wait_until_freed
from sgl_spec import corpus
from sgl_spec.bench import aborts
from sgl_spec.bench.agreement import divergence
from sgl_spec.bench.server import SPEC, flush_cache

pytestmark = [pytest.mark.server, pytest.mark.heavy]

def user(text: str) -> dict:
    return {"role": "user", "content": text}


def system(text: str) -> dict:
    return {"role": "system", "content": text}


@pytest.fixture(scope="module")
def texts(hf_tok):
    """The shared system prompt (~150 tokens) and the storm's documents."""
    docs = [corpus.document(hf_tok, n, seed=40 + i) for i, n in enumerate((300, 330, 120, 380))]
    return corpus.document(hf_tok, 150, seed=39), docs


def probes(shared: str) -> list[list[dict]]:
    return [*aborts.PROBE_CHATS[:3],
            [system(shared), user("In one sentence, what is this text about?")]]


def storm(url: str, shared: str, docs: list[str], seed: int) -> list[int]:
    """The storm; returns the malformed requests' statuses."""
    rng = random.Random(seed)
    plan = [([system(shared), user(docs[0] + "\n\nSummarise.")], 20)]  # sparse prefill first
    plan += [([user(d + "\n\nSummarise.")], rng.choice([0, 1, 5, 20])) for d in docs[1:]]
    plan += [([user(docs[2] + "\n\nName one thing it defines.")], 0)]
    statuses: list[int] = []
    aborts.cut_streams(url, plan, gap_s=0.3, max_tokens=40, api_key=None,
                       beside=lambda: statuses.extend(aborts.malformed(url, api_key=None)))
    return statuses


SERVERS = ["spec_server", "small_budget_server", "specontext_server"]


@pytest.mark.parametrize("name", SERVERS, ids=["exact", "loopserve", "specontext"])
def test_answers_after_an_abort_storm_equal_a_fresh_caches(name, request, texts):
    server = request.getfixturevalue(name)
    shared, docs = texts
    flush_cache(server.url)
    reference = aborts.probe(server.url, probes(shared), api_key=None)
    flush_cache(server.url)  # the storm's requests compute the shared prefixes first
    statuses = storm(server.url, shared, docs, seed=SERVERS.index(name))
    assert statuses == [400] * 6
    live = wait_until_freed(server.url)
    assert not any(live.values()), live
    answers = aborts.probe(server.url, probes(shared), api_key=None)
    state = requests.get(server.url + "/sgl_spec/cache", timeout=60).json()
    inv = state["invariants"]
    assert inv["checks"] > 0 and inv["idle_checks"] > 0, inv
    assert inv["violations"] == 0, inv["messages"]
    for ref, got in zip(reference, answers, strict=True):
        div = divergence(ref, got)  # margins: top1 - top2 at the first differing token
        assert div is None or div.near_tie, (ref.conversation, ref.text, got.text, div)
