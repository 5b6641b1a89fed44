"""Krul's restore calibration (``python -m sgl_spec.calibrate restore``): the load path
it times brings the arena's rows to the device exactly, and the profile it writes
chooses a share that never predicts a slower restore than loading or recomputing alone."""

from __future__ import annotations

import json

import pytest
import torch

from sgl_spec.krul import restore_cost
from sgl_spec.krul.pyramid import RestoreCost, choose_share


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    """A 2-layer Llama with GQA (4 query heads, 2 KV heads): config.json only."""
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("tiny")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                max_position_embeddings=512).save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("codec", ["full", "int8", "k8v4"])
def test_load_into_equals_the_arenas_rows(codec):
    shape = restore_cost.ModelShape(num_layers=3, kv_heads=2, head_dim=16)
    arena, slots = restore_cost._filled_arena(shape, 10, torch.bfloat16, codec)
    dev_k = [torch.zeros(12, 2, 16, dtype=torch.bfloat16) for _ in range(3)]
    dev_v = [torch.zeros_like(b) for b in dev_k]
    idx = torch.arange(2, 12)
    restore_cost.load_into(arena, slots, dev_k, dev_v, idx)
    for layer in range(3):
        k, v, stored = arena.read(layer, slots)
        assert stored.all()
        assert torch.equal(dev_k[layer][idx], k) and torch.equal(dev_v[layer][idx], v)
        assert not dev_k[layer][:2].any()                # rows outside dev_idx untouched


def test_model_shape_reads_gqa_and_head_dim(tiny_config):
    from transformers import AutoConfig

    assert restore_cost.ModelShape.of(AutoConfig.from_pretrained(tiny_config)) == \
        restore_cost.ModelShape(num_layers=2, kv_heads=2, head_dim=16)


def test_profile_and_its_share(tiny_config):
    prof = restore_cost.profile(tiny_config, tokens=64, repeats=1, random_weights=True,
                                codec="int8", progress=False)
    assert prof["shape"] == {"num_layers": 2, "kv_heads": 2, "head_dim": 16}
    assert prof["recompute_s"] > 0 and set(prof["tiers"]) == {"host", "file"}
    for tier, t in prof["tiers"].items():
        assert t["load_s"] > 0 and 0.0 <= t["share"] <= 1.0
        # the chosen split is never predicted slower than either pure strategy
        assert t["split_s"] <= min(t["load_only_s"], t["recompute_only_s"]) * (1 + 1e-9)
        cost = restore_cost.cost_of(prof, tier)
        assert cost == RestoreCost(prof["recompute_s"], t["load_s"])
    with pytest.raises(ValueError, match="valid: host, file"):
        restore_cost.cost_of(prof, "disk")


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_pipeline_restore_fills_every_row(tiny_config, device):
    """``--pipeline-share``: the timed restore (the pre-pass and the load, alone, serial
    and pipelined) runs on the device at the pyramid of the forced share."""
    dev = torch.device(device)
    model = restore_cost.load_model(tiny_config, torch.float32, dev, random_weights=True)
    p = restore_cost.measure_pipeline(model, 64, 0.5, torch.float32, "full", 1, dev)
    assert 0 < p["recompute_token_layers"] and 0 < p["stored_rows"] < 64 * 2
    assert all(p[k] > 0 for k in ("T_C_s", "T_L_s", "serial_s", "pipelined_s"))
    assert 0.5 <= p["max_over_sum"] < 1 and len(p["runs_s"]["pipelined"]) == 1


def test_a_profile_with_the_pipeline_costs_what_the_pre_pass_costs(tiny_config):
    """With ``pipeline_share`` the profile's recompute cost is the served pre-pass's own
    (a full forward's is kept beside it) and its overlap is the measured one."""
    prof = restore_cost.profile(tiny_config, tokens=64, repeats=1, random_weights=True,
                                codec="full", tiers=("host",), progress=False,
                                pipeline_share=0.5)
    p = prof["pipeline"]
    assert prof["recompute_s"] == pytest.approx(p["T_C_s"] / p["recompute_token_layers"])
    assert prof["forward_recompute_s"] > 0
    assert prof["overlap"] == pytest.approx(restore_cost.overlap_of(prof))
    assert 0 <= prof["overlap"] <= 1


def test_the_share_follows_the_overlap_the_restore_has():
    """A serial restore pays T_C + T_L: with a row's recompute dearer than its load it
    recomputes nothing, where the paper's overlapped model balances the two. A measured
    partial overlap keeps the balance only where recomputing still pays: below the
    balance each recomputed row saves a load and costs overlap x (recompute / load) of
    one. A profile's own ``share`` wins."""
    from sgl_spec.krul.pyramid import restore_time

    assert restore_time(2.0, 1.0) == 2.0 and restore_time(2.0, 1.0, 0.0) == 3.0
    assert restore_time(2.0, 1.0, 0.5) == 2.5
    with pytest.raises(ValueError, match="valid 0 <= overlap <= 1"):
        restore_time(1.0, 1.0, 1.5)
    prof = {"format": 1, "tokens": 4096, "shape": {"num_layers": 8},
            "recompute_s": 1.5e-6, "tiers": {"host": {"load_s": 1e-6}}}
    full = restore_cost.host_share(prof, 8)
    assert 0.2 < full < 0.6
    assert restore_cost.host_share(prof, 8, pipelined=False) == 0.0
    assert restore_cost.overlap_of(prof) is None
    prof["pipeline"] = {"T_C_s": 0.06, "T_L_s": 0.08, "pipelined_s": 0.11}  # 0.03 of 0.06
    assert restore_cost.overlap_of(prof) == pytest.approx(0.5)
    assert restore_cost.host_share(prof, 8) == full            # 0.5 x 1.5 < 1: it pays
    prof["recompute_s"] = 3e-6                                  # 0.5 x 3 > 1: it does not
    assert restore_cost.host_share(prof, 8) == 0.0
    prof["share"] = 0.5
    assert restore_cost.host_share(prof, 8, pipelined=False) == 0.5


def test_share_follows_the_costs():
    """A load as dear as a recompute splits about evenly; a cheap load recomputes nothing."""
    even = choose_share(RestoreCost(recompute_s=1.0, load_s=1.0), 1000, [1.0] * 4)
    assert 0.4 <= even <= 0.6
    assert choose_share(RestoreCost(recompute_s=1.0, load_s=0.001), 1000, [1.0] * 4) == 0.0


def test_cli_writes_the_profile(tiny_config, tmp_path, capsys):
    from sgl_spec.calibrate.__main__ import main

    out = tmp_path / "p.json"
    assert main(["restore", "--model-path", tiny_config, "--random-weights", "--tokens", "32",
                 "--repeats", "1", "--tiers", "host", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == str(out)
    assert lines[-2].startswith("host ")
    assert set(json.loads(out.read_text())["tiers"]) == {"host"}


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu"], "valid: cpu"),
    (["--tokens", "8"], "--tokens must be >= 16"),
    (["--tiers", "disk"], "invalid choice: 'disk'"),
    (["--spec-krul-codec", "int4"], "invalid choice: 'int4'"),
    (["--pipeline-share", "1.5"], "valid 0 < S <= 1"),
])
def test_cli_refuses_bad_values(tiny_config, argv, message, capsys):
    from sgl_spec.calibrate.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["restore", "--model-path", tiny_config, "--random-weights", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
