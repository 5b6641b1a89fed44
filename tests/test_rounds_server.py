"""Round mode in a real server (issue 44): the default model, a layer-tiered pool (L_w 12 of
30, an upper tier of half the full pool's slots), with HiCache, Krul, turn eviction,
LoopServe's prefill (below L_w; its turns here are shorter than its 2048-token minimum, so
this starts the composition, and test_round_runtime checks its sparse extends) and the
opt-in dropping of rounds no selection kept (Sec. 3.4) on,
conversations played turn by turn through the chat API. A conversation with fewer earlier
rounds than the threshold attends all of them and answers as the exact server does, with
the same cached tokens per turn; a long one selects rounds (kept share under 1), keeps each
finished round as host blocks and gives every upper slot back; aborted streams free their
working sets; a conversation demoted to the host tier (Krul-compressed lower layers, its
rounds' blocks on its nodes) comes back with its history cached and the same answer."""

from __future__ import annotations

import pytest
import requests

from _aborts import abort_streams, wait_until_freed
from conftest import COMMON_FLAGS, EARLY_SERVERS, SPEC_CHECKS, Early, early_server, krul_stats
from sgl_spec import boot
from sgl_spec.bench.agreement import NEAR_TIE_NATS, first_divergence
from sgl_spec.bench.server import SPEC
from sgl_spec.rounds.conversations import conversation

pytestmark = [pytest.mark.server,
              pytest.mark.skipif(boot.cuda_host(), reason="round mode serves on CPU hosts only")]

WATERSHED = 12  # the default model's calibrated L_w (docs/results/2026-11-28-watershed.md)
POOL = 2048  # two ~1k-token conversations do not fit: the older one goes to the host tier
UPPER = POOL // 2
MIN_ROUNDS = 4
DROP_AFTER = 6  # Sec. 3.4, opt-in: a round no selection kept for 6 questions in a row


def _flags(model_path: str) -> list[str]:
    flags = list(COMMON_FLAGS)
    flags[flags.index("--max-total-tokens") + 1] = str(POOL)
    return ["--model-path", model_path, *flags, *SPEC_CHECKS, "--spec-rounds",
            "--spec-round-watershed", str(WATERSHED), "--spec-round-upper-tokens", str(UPPER),
            "--spec-round-min-rounds", str(MIN_ROUNDS),
            "--spec-round-drop-after", str(DROP_AFTER),
            "--enable-hierarchical-cache", "--hicache-ratio", "2", "--enable-cache-report",
            "--spec-krul", "--spec-krul-stats", krul_stats(model_path),
            "--spec-cache-eviction", "turn", "--spec-prefill", "loopserve"]


if not boot.cuda_host():  # launched lazily (conftest), as the module before its tests starts
    EARLY_SERVERS["rounds_server"] = Early(SPEC, _flags, lazy=True)


@pytest.fixture(scope="module")
def rounds_server(model_path):
    yield from early_server("rounds_server", model_path)


def _tiers(url: str) -> dict:
    return requests.get(url + "/sgl_spec/cache", timeout=60).json()["tiers"]


def _play(url: str, conv, answer_tokens: int = 12) -> tuple[list[int], str]:
    """Every round's user turn as one request over the scripted history, then the
    question: the cached tokens of each request and the question's greedy answer."""
    msgs, cached = list(conv.messages), []
    for r in range(1, conv.rounds + 2):
        last = r == conv.rounds + 1
        body = {"model": "m", "messages": msgs if last else msgs[: 2 * r],
                "max_tokens": answer_tokens if last else 1, "temperature": 0}
        out = requests.post(url + "/v1/chat/completions", json=body, timeout=300)
        out.raise_for_status()
        out = out.json()
        cached.append((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return cached, out["choices"][0]["message"]["content"]


def test_few_rounds_attend_all_of_them_and_answer_as_exact(rounds_server, spec_server, hf_tok):
    conv = conversation(hf_tok, rounds=MIN_ROUNDS - 1, round_tokens=(40, 80), seed=11, asked=1)
    before = _tiers(rounds_server.url)
    got = _play(rounds_server.url, conv)
    want = _play(spec_server.url, conv)
    # the answer, and the cached tokens of every turn over its own history (the first
    # turn's: the shared system prompt, which the exact server may hold a few tokens
    # further, the user turn's opener: round mode reuses no more than its stored rounds)
    assert got[1] == want[1] and got[0][1:] == want[0][1:], (got, want)
    t = _tiers(rounds_server.url)
    exact = t["exact_selections"] - before["exact_selections"]
    assert exact == t["selections"] - before["selections"] >= conv.rounds  # < 4 candidates
    # A second question over the same history branches inside the first one's user turn:
    # it reuses as many tokens as on the exact server (the stored rounds reach every
    # turn's end, not only a round's).
    other = [*conv.messages[:-1], {"role": "user", "content": "What is the first fact?"}]
    again = [requests.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "m", "messages": other, "max_tokens": 1, "temperature": 0}).json()["usage"]
        ["prompt_tokens_details"]["cached_tokens"] for url in (rounds_server.url,
                                                               spec_server.url)]
    assert again[0] == again[1], again


def test_a_long_conversation_selects_rounds_and_gives_every_slot_back(rounds_server, hf_tok):
    conv = conversation(hf_tok, rounds=9, round_tokens=(60, 120), seed=12, asked=2)
    before = _tiers(rounds_server.url)
    cached, answer = _play(rounds_server.url, conv)
    assert answer and all(c > 0 for c in cached[1:])  # every later turn reuses its history
    t = _tiers(rounds_server.url)
    picked = t["selections"] - before["selections"] - (t["exact_selections"]
                                                       - before["exact_selections"])
    assert picked >= conv.rounds + 1 - MIN_ROUNDS  # from the 5th question on
    seen = t["tokens_seen"] - before["tokens_seen"]
    kept = t["tokens_kept"] - before["tokens_kept"]
    assert 0 < kept < 0.8 * seen, (kept, seen)
    assert t["host_blocks"] > conv.rounds and t["host_bytes"] > 0
    assert t["blocks_loaded"] > before["blocks_loaded"]
    per_token = t["token_bytes"]
    assert t["device_bytes"]["upper"] == per_token["upper"] * (UPPER + 1)
    assert t["device_bytes"]["lower"] == per_token["lower"] * (POOL + 1)
    assert t["upper_slots_used"] == 0 and t["working_sets"] == 0
    assert t["watershed"] == WATERSHED and t["unstored_tokens"] == 0
    # the question's selection, as the endpoint shows it: the candidates' shares, the
    # system prompt's round and the last one kept
    sel = t["last_selections"][-1]
    assert len(sel["share"]) == len(sel["rounds"]) and abs(sum(sel["share"]) - 1) < 1e-3
    assert {0, sel["rounds"][-1]} <= set(sel["kept"]) and sel["rid"], sel
    # six selections (the 5th question to the last): a round none kept is dropped, its
    # host rows freed
    assert t["dropped_rounds"] - before["dropped_rounds"] >= 1, t


def test_aborted_streams_free_their_working_sets(rounds_server, hf_tok):
    conv = conversation(hf_tok, rounds=6, round_tokens=(60, 120), seed=13, asked=3)
    _play(rounds_server.url, conv, answer_tokens=1)
    text = hf_tok.apply_chat_template(list(conv.messages), tokenize=False,
                                      add_generation_prompt=True)
    abort_streams(rounds_server.url, [text, text + " Please.", text], cut_after=[0, 3, 8],
                  max_new_tokens=200)
    live = wait_until_freed(rounds_server.url)
    assert live["round_working_sets"] == 0 and live["round_upper_slots"] == 0, live
    t = _tiers(rounds_server.url)
    assert t["upper_slots_used"] == 0 and t["stale_slots"] == 0, t


def _generate(url: str, text: str) -> tuple[list[int], dict]:
    body = {"text": text, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"temperature": 0, "max_new_tokens": 12}}
    out = requests.post(url + "/generate", json=body, timeout=300)
    out.raise_for_status()
    meta = out.json()["meta_info"]
    return [t[1] for t in meta["output_token_logprobs"]], meta


def _state(url: str) -> dict:
    return requests.get(url + "/sgl_spec/cache", timeout=60).json()


def test_a_demoted_conversation_comes_back_from_the_host_tier(rounds_server, hf_tok):
    """HiCache's host pool holds the lower tier's layers (Krul compresses them there); the
    rounds' upper blocks stay on the radix nodes. After another conversation takes the
    pool, the first one's question is served from its host copy: its history cached (host
    hits), round selection as before, the same greedy answer (or a first divergence at a
    near tie: Krul's k8v4 rows are not the float32 ones)."""
    url = rounds_server.url
    conv = conversation(hf_tok, rounds=6, round_tokens=(60, 120), seed=14, asked=2)
    _play(url, conv, answer_tokens=1)
    text = hf_tok.apply_chat_template(list(conv.messages), tokenize=False,
                                      add_generation_prompt=True)
    ids, meta = _generate(url, text)
    other = conversation(hf_tok, rounds=10, round_tokens=(100, 160), seed=15, asked=3)
    _play(url, other, answer_tokens=1)  # more than the pool holds beside the first one
    before = _state(url)
    again, again_meta = _generate(url, text)
    after = _state(url)
    host = (again_meta.get("cached_tokens_details") or {}).get("host", 0)
    assert host > 200 and again_meta["cached_tokens"] >= meta["cached_tokens"] - 16, again_meta
    assert after["krul"]["nodes"] >= 1 and after["restore"]["loads"] > before["restore"]["loads"]
    t0, t1 = before["tiers"], after["tiers"]
    assert t1["selections"] - t0["selections"] == 1 and t1["exact_selections"] == \
        t0["exact_selections"]  # six earlier rounds: a selection, not all of them
    assert t1["upper_slots_used"] == 0 and t1["working_sets"] == 0
    if again != ids:
        j = first_divergence(ids, again)
        top = meta["output_top_logprobs"]
        assert j < len(top) and top[j][0][0] - top[j][1][0] <= NEAR_TIE_NATS, (ids, again, top)
