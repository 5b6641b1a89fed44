"""Krul on a real server: a demoted conversation is compressed in the host tier and
restored from it; a corrupted one is recomputed, never served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from conftest import EARLY_SERVERS, SPEC_CHECKS, Early, early_dir, early_server, krul_stats
from sgl_spec import boot
from sgl_spec import cpu as host_cpu
from sgl_spec.bench.agreement import NEAR_TIE_NATS, first_divergence
from sgl_spec.bench.server import SPEC, flush_cache
from sgl_spec.tiers import restore_clock

pytestmark = [pytest.mark.server, pytest.mark.slow,
              pytest.mark.skipif(boot.cuda_host(), reason="Krul's host pool: CPU I/O only")]

PROMPT_TOKENS = 800
MAX_NEW_TOKENS = 12


def _args(model_path: str) -> list[str]:
    return [
        "--model-path", model_path,
        # Room for one 800-token request: the next one demotes it to the host.
        "--max-total-tokens", "1100",
        "--enable-hierarchical-cache", "--hicache-ratio", "2",
        "--enable-cache-report", "--sleep-on-idle", "--enable-metrics",
        "--spec-krul", "--spec-krul-stats", krul_stats(model_path), *SPEC_CHECKS,
    ]  # fmt: skip


def _profile() -> str:
    """A restore profile whose host tier recomputes about 40% of each demoted history
    (a token-layer's recompute 1.5x a row's load; this CPU's own calibration chooses 0,
    an H200's 0.625)."""
    out = early_dir("krul_file") / "restore.json"
    out.write_text(json.dumps({
        "format": 1, "model": "test", "hardware": "test", "device": "cpu",
        "dtype": "bfloat16", "tokens": 4096, "codec": "k8v4",
        "shape": {"num_layers": 30, "kv_heads": 3, "head_dim": 64}, "repeats": 1,
        "recompute_s": 1.5e-6, "tiers": {"host": {"load_s": 1e-6}}}))
    return str(out)


def _storage(model_path: str) -> dict[str, str]:
    return {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(early_dir("krul_file") / "l3")}


# Both servers boot with the session's shared servers (conftest), beside the unit tests.
if not boot.cuda_host():
    EARLY_SERVERS["krul_file_server"] = Early(
        SPEC, lambda m: _args(m) + ["--hicache-storage-backend", "file",
                                    "--hicache-storage-prefetch-policy", "wait_complete",
                                    "--spec-krul-profile", _profile(),
                                    "--spec-krul-restore", "pipelined"],
        env=_storage, prepares=True, host_tier=True)
    EARLY_SERVERS["krul_merging_server"] = Early(
        SPEC, lambda m: _args(m) + ["--spec-krul-max-error", "1", "--spec-krul-codec", "int8"],
        env=lambda m: {"SGLSPEC_KRUL_CORRUPT": "1000"}, prepares=True,  # every node
        host_tier=True)


@pytest.fixture(scope="module")
def krul_file_server(model_path):
    yield from early_server("krul_file_server", model_path)


@pytest.fixture(scope="module")
def krul_merging_server(model_path):
    yield from early_server("krul_merging_server", model_path)


def _prompts(model_path: str) -> tuple[str, str]:
    from transformers import AutoTokenizer

    from sgl_spec import corpus

    tok = AutoTokenizer.from_pretrained(model_path)
    out = []
    for seed in (1, 2):
        body = " ".join(p.text for p in corpus.passages(tok, PROMPT_TOKENS, seed=seed))
        body = tok.decode(tok.encode(body)[:PROMPT_TOKENS])
        out.append(f"<|im_start|>user\n{body}\n\nSummarize the text above in one sentence."
                   "<|im_end|>\n<|im_start|>assistant\n")
    return out[0], out[1]


def _generate(url: str, text: str) -> tuple[list[int], dict]:
    body = {"text": text, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}}
    resp = requests.post(f"{url}/generate", json=body, timeout=600)
    resp.raise_for_status()
    out = resp.json()
    meta = out["meta_info"]
    return [t[1] for t in meta["output_token_logprobs"]], meta


def _krul(url: str) -> dict:
    """Krul's totals, with the branches' compressed bytes (``GET /sgl_spec/cache``)."""
    resp = requests.get(f"{url}/sgl_spec/cache", timeout=60)
    resp.raise_for_status()
    out = resp.json()
    branches = [(b["krul_stored_bytes"], b["krul_full_bytes"]) for b in out["branches"]
                if "krul_full_bytes" in b]
    return {**out["krul"], "branches": branches, "live": out["live_requests"],
            "restore": out["restore"]}


def _demote_and_restore(server, model_path):
    first, other = _prompts(model_path)
    ids, meta = _generate(server.url, first)
    assert meta["cached_tokens"] < 16, meta
    _generate(server.url, other)            # 1100 slots cannot hold both: first is demoted
    totals = _krul(server.url)
    again_ids, again_meta = _generate(server.url, first)
    return _Answer(ids, meta), again_ids, again_meta, totals, _krul(server.url)


class _Answer:
    """The never-evicted prompt's greedy answer, with its own top-2 logprobs per token."""

    def __init__(self, ids: list[int], meta: dict):
        self.ids, self.top2 = ids, meta["output_top_logprobs"]

    def matches(self, other: list[int]) -> bool:
        """Equal, or diverging first where this answer's top-2 were a near tie: another
        extend order (a restored or recomputed prefix) may break an exact tie the other
        way (seen on an AVX512 CPU: two first tokens at the same logprob)."""
        if other == self.ids:
            return True
        j = first_divergence(self.ids, other)
        if j >= len(self.top2):
            return False
        (a, *_), (b, *_) = self.top2[j][:2]
        return a - b <= NEAR_TIE_NATS

    def __repr__(self) -> str:
        return f"_Answer({self.ids}, margins {[round(t[0][0] - t[1][0], 3) for t in self.top2]})"


def test_demoted_conversation_is_stored_in_k8v4_and_restored(model_path, krul_file_server):
    """Default flags: K rows in int8 and V in 4 bits (0.39x of bf16), this model's unlike
    pairs left unmerged. With a restore profile (--spec-krul-profile) the front of each
    layer's rows (a pyramid) is not stored at all: the restore recomputes it with the
    model's layers while the rest is loaded, and the restored prompt's greedy answer is
    the never-evicted one. With the ``file`` storage backend (L3), the same compressed
    rows are the pages: after the host tier is flushed the prompt comes back from storage
    (recomputing the same front), and a page with a flipped byte is recomputed, not
    served."""
    server = krul_file_server
    storage = Path(server.env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"])
    ids, again_ids, meta, totals, after = _demote_and_restore(server, model_path)
    first, _ = _prompts(model_path)
    pages = sorted(storage.glob("*.bin"))
    flush_cache(server.url)
    l3_ids, l3_meta = _generate(server.url, first)
    l3 = _krul(server.url)
    flush_cache(server.url)
    for page in pages:                                # flip a byte of every page
        data = bytearray(page.read_bytes())
        data[len(data) // 2] ^= 1
        page.write_bytes(bytes(data))
    bad_ids, bad_meta = _generate(server.url, first)
    refused = _krul(server.url)["refused_loads"]
    # one token per page (--page-size 1): every layer's k8v4 row, a 4-byte mask of the
    # unstored ones and an 8-byte checksum
    k8v4_row = 3 * 64 + 3 * 32 + 4 * 3
    assert len(pages) >= PROMPT_TOKENS // 2
    assert {p.stat().st_size for p in pages} == {30 * k8v4_row + 4 + 8}
    assert (l3_meta.get("cached_tokens_details") or {}).get("storage", 0) > PROMPT_TOKENS // 2, l3_meta
    assert ids.matches(l3_ids), (ids, l3_ids)
    assert l3["recomputed_restores"] > after["recomputed_restores"]   # the front again
    assert refused >= 1 and bad_meta["cached_tokens"] < 16, bad_meta
    assert ids.matches(bad_ids), (ids, bad_ids)       # recomputed, not loaded
    assert totals["nodes"] >= 1 and totals["tokens"] >= PROMPT_TOKENS - 32   # less the shared head
    assert totals["pairs_skipped"] >= totals["nodes"]
    # Krul's estimator observed the conversations as they were served: their nodes use
    # their own layer pairs (Algorithm 1 on their attention), and nothing per request
    # is left once they finished
    # (the server's one-token warm-up is too short to choose from: the model's pairs)
    assert totals["conversation_strategy_nodes"] >= 2, totals
    # each conversation's prompt: one row per 128 new tokens (ObserveConfig.tokens_per_row)
    assert totals["observed_prefill_rows"] >= 2 * (PROMPT_TOKENS // 128) * 9, totals
    assert after["live"].get("krul_stats") == 0, after["live"]
    # ~39% of the token-layers unstored (the profile's share), the rest in k8v4
    share = totals["recompute_share"]
    assert 0.3 < share < 0.5, totals
    elem = 4 if host_cpu.default_dtype() == "float32" else 2  # the pool's (sgl_spec.cpu)
    k8v4 = k8v4_row / (2 * 3 * 64 * elem)
    ratio = totals["stored_bytes"] / totals["full_bytes"]
    assert k8v4 * (1 - share) * 0.9 < ratio < k8v4 * (1 - share) * 1.15, totals
    # the demoted conversation's branch shows its compressed and full bytes (the others'
    # host copies are compressed too, but their branches are still on the device)
    full_token = 30 * 2 * 3 * 64 * elem
    assert any(f >= (PROMPT_TOKENS - 32) * full_token and s < f * k8v4 * (1 - share) * 1.15
               for s, f in totals["branches"]), totals
    host = (meta.get("cached_tokens_details") or {}).get("host", 0)
    assert host > PROMPT_TOKENS // 2, meta           # restored from the compressed tier
    assert totals["recomputed_restores"] == 0
    # the restore recomputed its front: ~share of the history's token-layers
    assert after["recomputed_restores"] == 1, after
    assert 0.5 * share < after["recomputed_token_layers"] / (30 * host) < 1.5 * share, after
    assert after["refused_loads"] == 0
    # the restore stage's clock: this load-back, its tokens and its time
    stage = restore_clock.delta(after["restore"], totals["restore"])
    assert stage["loads"] == 1 and stage["refused"] == 0, stage
    assert stage["tokens"] >= host and stage["admit_seconds"] > 0, stage
    # pipelined (asked for: auto is serial on a CPU): the recompute ran on a worker beside
    # the in-line copy, and the clock has both parts (what ran at once depends on the
    # 2 cores' load: >= 0)
    assert after["restore_pipeline"] == "pipelined"
    assert stage["recompute_seconds"] > 0 and stage["load_seconds"] > 0, stage
    assert 0 <= stage["overlap_seconds"] <= min(stage["recompute_seconds"],
                                                stage["load_seconds"]) + 1e-6, stage
    assert ids.matches(again_ids), (ids, again_ids)
    # the same figures beside sglang's metrics
    metrics = requests.get(f"{server.url}/metrics", timeout=60).text
    assert 'sgl_spec:krul{figure="recomputed_restores"}' in metrics
    assert 'sgl_spec:krul{figure="stored_bytes"}' in metrics


def test_merged_pairs_are_stored_and_a_corrupted_payload_is_recomputed(model_path,
                                                                       krul_merging_server):
    """--spec-krul-max-error 1 merges every pair Algorithm 1 chose, however unlike (this
    model's are: docs/design/krul.md §11); a stored byte flipped after the checksum
    (SGLSPEC_KRUL_CORRUPT) makes the load refused and the tokens recomputed."""
    server = krul_merging_server
    ids, again_ids, meta, totals, after = _demote_and_restore(server, model_path)
    # 8 merged pairs of 30 layers, int8 rows and bf16 magnitudes: ~0.39x of a full bf16
    # copy (half that of a float32 pool's)
    assert totals["nodes"] >= 1 and totals["pairs_skipped"] == 0
    assert totals["conversation_strategy_nodes"] >= 1   # their own pairs
    ratio = totals["stored_bytes"] / totals["full_bytes"]
    elem = 4 if host_cpu.default_dtype() == "float32" else 2  # the pool's (sgl_spec.cpu)
    assert 0.3 * 2 / elem < ratio < 0.45 * 2 / elem, totals
    assert after["refused_loads"] >= 1
    stage = restore_clock.delta(after["restore"], totals["restore"])
    assert stage["refused"] >= 1, stage
    assert (meta.get("cached_tokens_details") or {}).get("host", 0) == 0, meta
    assert ids.matches(again_ids), (ids, again_ids)  # recomputed, not loaded
    assert after["recompute_share"] == 0 and after["recomputed_restores"] == 0
