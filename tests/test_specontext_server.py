"""SpeContext on a real server: a head trained here (the quick form of
``sgl_spec.train_head``), ``--spec-mode specontext`` decoding sparse from the first
step, elastic loading and the head's counters, a follow-up turn over the cached
prefix (head keys from the pool), the exact fallback below ``--spec-min-context``,
states freed on finish, and the head's keys evicted to the HiCache host tier and loaded
back with the token's KV."""

from __future__ import annotations

import pytest
import requests

from _aborts import abort_streams, wait_until_freed
from sgl_spec.bench import sparse_counters
from sgl_spec.bench.server import SPEC, flush_cache
from sgl_spec.tiers import restore_clock
from test_sparse_backend import EXACT, SPARSE, _doc, chatml, delta, generate, sparse_metrics

from conftest import SPECONTEXT_BUDGET as BUDGET

SINK, WINDOW = 4, 64
ROWS = SINK + BUDGET + WINDOW  # staged per request, layer and KV head


@pytest.fixture(scope="module")
def server(specontext_server):
    return specontext_server


@pytest.mark.server
class TestSpeContextServer:
    def test_long_prompt_decodes_sparse_every_step_with_elastic_loads(self, server):
        prompt = chatml("What does this module do?\n" + _doc("json", 5000))
        before, c0 = sparse_metrics(server.url), sparse_counters.read(server.url)
        out = generate(server.url, prompt, 48, ignore_eos=True)
        after, c1 = sparse_metrics(server.url), sparse_counters.read(server.url)
        assert 800 <= out["meta_info"]["prompt_tokens"] <= 1300
        assert out["meta_info"]["completion_tokens"] == 48 and out["text"].strip()
        # No dense warm-up: every one of the 47 decode steps attends the head's selection
        # (overlap scheduling may run one more).
        assert delta(after, before, EXACT) == 0
        assert 47 <= delta(after, before, SPARSE) <= 48
        d = sparse_counters.delta(c1, c0)
        # The first step loads all ROWS positions per KV head; later ones only what
        # changed, so the mean is well under a full reload.
        assert ROWS / 48 < d["rows_loaded_per_step"] < 0.75 * ROWS
        assert 0.25 < d["selection_overlap"] <= 1.0
        assert d["head_ms_per_pass"] > 0
        assert after["sgl_spec:sparse_live_states"] == 0

    def test_follow_up_turn_reuses_the_cached_prefix(self, server):
        first = chatml("Summarize this text.\n" + _doc("argparse", 4000))
        a = generate(server.url, first, 16)
        follow = (first + a["text"] + "<|im_end|>\n"
                  + "<|im_start|>user\nName one class it mentions.<|im_end|>\n"
                  + "<|im_start|>assistant\n")
        before = sparse_metrics(server.url)
        b = generate(server.url, follow, 24, ignore_eos=True)
        after = sparse_metrics(server.url)
        # --spec-sparse-kv-cache auto is drop under specontext: every decode step was
        # sparse (step k writes position p + k), so only the prompt's KV is reused
        p, n = a["meta_info"]["prompt_tokens"], a["meta_info"]["completion_tokens"]
        assert n >= 8 and p - 1 <= b["meta_info"]["cached_tokens"] <= p
        assert b["meta_info"]["completion_tokens"] == 24 and b["text"].strip()
        assert 23 <= delta(after, before, SPARSE) <= 24
        assert after["sgl_spec:sparse_live_states"] == 0

    def test_short_prompt_decodes_exactly(self, server):
        before = sparse_metrics(server.url)
        out = generate(server.url, chatml("What is the capital of France?"), 24,
                       ignore_eos=True)
        after = sparse_metrics(server.url)
        assert out["meta_info"]["prompt_tokens"] + 24 < 256
        assert delta(after, before, SPARSE) == 0
        assert 23 <= delta(after, before, EXACT) <= 24
        assert after["sgl_spec:sparse_live_states"] == 0

    def test_aborted_and_retracted_streams_free_their_states(self, server):
        """Four ~330-token prompts at once in a pool of 1400 tokens that holds a ~600-token
        probe (queued, retracted, evicted to the host tier), cut by the client at seeded
        points: every head-driven decode state and slot is freed, and a greedy request
        answers as before."""
        import random

        probe = chatml("What does this module do?\n" + _doc("json", 2500))
        generate(server.url, probe, 1)  # cached: before and after, the prompt's last token
        reference = generate(server.url, probe, 24, ignore_eos=True)["output_ids"]
        rng = random.Random(7)
        cut_after = [rng.choice([0, 1, 10, 30]) for _ in range(4)]
        prompts = [chatml(f"Summarize it ({i}).\n" + _doc(m, 1400))
                   for i, m in enumerate(["argparse", "logging", "csv", "random"])]
        abort_streams(server.url, prompts, cut_after, max_new_tokens=40)
        live = wait_until_freed(server.url)
        assert live == {"prefill_lines_offered": 0, "prefill_seeds": 0, "decode_states": 0,
                        "policy_states": 0, "policy_slots": 0}
        # Evicted past the host tier, the probe is recomputed: cache it again first, so
        # that, as for the reference, only its last token is computed with the answer.
        generate(server.url, probe, 1)
        assert generate(server.url, probe, 24, ignore_eos=True)["output_ids"] == reference
        assert sparse_metrics(server.url)["sgl_spec:sparse_live_states"] == 0


def _restore(url: str) -> dict:
    resp = requests.get(f"{url}/sgl_spec/cache", timeout=60)
    resp.raise_for_status()
    return resp.json()["restore"]


@pytest.mark.server
@pytest.mark.slow
def test_head_keys_survive_hicache_write_back_and_load(server, model_path):
    """The head's layer is one more layer of the pool, so HiCache writes it to the host
    with the token's KV and loads it back: a prompt evicted to the host and asked again
    decodes the same sparse tokens as when it was asked again from the device cache
    (the head's selection reads the restored keys; keys left in those slots by the
    evicting prompt would select other positions). The reference is the device-cached
    repeat, not the cold request: a cached prompt's last token is recomputed alone, and
    at a small B that rounding difference alone can change the selection."""
    import argparse
    import logging

    from transformers import AutoTokenizer

    from test_hicache_cpu import PROMPT_TOKENS, _chat_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    first, evicting = _chat_prompt(argparse, tokenizer), _chat_prompt(logging, tokenizer)
    flush_cache(server.url)  # the module's server: nothing cached, and no room for both
    assert generate(server.url, first, 8)["meta_info"]["cached_tokens"] < 16
    before = sparse_metrics(server.url)
    on_device = generate(server.url, first, 32, ignore_eos=True)
    assert generate(server.url, evicting, 8)["meta_info"]["cached_tokens"] < 16
    clock = _restore(server.url)
    from_host = generate(server.url, first, 32, ignore_eos=True)
    after = sparse_metrics(server.url)
    # the restore stage, timed on stock's host pool (GET /sgl_spec/cache -> restore)
    stage = restore_clock.delta(_restore(server.url), clock)
    assert stage["loads"] >= 1 and stage["refused"] == 0, stage
    assert stage["tokens"] >= PROMPT_TOKENS // 2 and stage["transfer_seconds"] > 0, stage
    assert 'sgl_spec:host_restore{figure="tokens"}' in requests.get(
        f"{server.url}/metrics", timeout=60).text
    assert on_device["meta_info"]["cached_tokens"] > PROMPT_TOKENS
    assert not (on_device["meta_info"].get("cached_tokens_details") or {}).get("host")
    details = from_host["meta_info"].get("cached_tokens_details") or {}
    assert details.get("host", 0) > PROMPT_TOKENS // 2, from_host["meta_info"]
    assert delta(after, before, SPARSE) >= 2 * 31  # both answers decoded sparse
    assert from_host["output_ids"] == on_device["output_ids"], (on_device["text"],
                                                               from_host["text"])
    assert after["sgl_spec:sparse_live_states"] == 0


@pytest.mark.server
def test_offloaded_layers_serve_the_same_greedy_tokens(server, offload_server):
    """--spec-offload auto under a device KV budget of ~700 tokens: a ~1100-token prompt
    moves the last layers to the host (Algorithm 2), the device bytes the pool reports stay
    within the budget, every row reports the layers it reads from the host, and the greedy
    tokens equal the same server's without offload (the move copies the KV exactly; sparse
    rows read the host layers through their elastic loads)."""
    from conftest import OFFLOAD_ELEMENT_BYTES, OFFLOAD_KV_BYTES

    prompt = chatml("What does this module do?\n" + _doc("json", 5000))
    flush_cache(server.url)
    flush_cache(offload_server.url)
    ref = generate(server.url, prompt, 48, ignore_eos=True)
    before = sparse_metrics(offload_server.url)
    out = generate(offload_server.url, prompt, 48, ignore_eos=True)
    after = sparse_metrics(offload_server.url)
    assert out["text"] == ref["text"] and out["meta_info"]["completion_tokens"] == 48
    assert 47 <= delta(after, before, SPARSE) <= 48  # sparse rows read the host layers
    rep = requests.get(f"{offload_server.url}/sgl_spec/cache", timeout=60).json()["offload"]
    layers = rep["host_layers"]
    assert layers and layers == list(range(30 - len(layers), 30)), rep  # the last ones
    assert rep["budget_bytes"] == OFFLOAD_KV_BYTES and not rep["over_budget"], rep
    assert sum(rep["device_bytes"].values()) <= OFFLOAD_KV_BYTES
    row = 2 * 3 * 64 * OFFLOAD_ELEMENT_BYTES  # K and V, 3 KV heads of 64, the served dtype
    assert rep["host_bytes"] == rep["used_slots"] * len(layers) * row
    assert rep["device_bytes"]["layers"] == rep["used_slots"] * (31 - len(layers)) * row
    assert rep["host_loads"]["passes"] >= 47 and rep["moves"]["reloaded"] == 0
    metrics = requests.get(f"{offload_server.url}/metrics", timeout=60).text
    assert f'sgl_spec:offload{{figure="host_layers"}} {float(len(layers))}' in metrics
    assert after["sgl_spec:sparse_live_states"] == 0
