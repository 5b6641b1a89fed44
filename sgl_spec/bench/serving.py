"""The harness' serving row: ``sglang.bench_serving --dataset-name random-ids`` on a server.

Concurrent single-turn requests of random token ids (no prefix reuse), played on a
row when its plan says ``serving = true`` (or a ``PRESETS`` name; ``plan.RunPlan``).
bench_serving runs as a subprocess of this interpreter; it appends one JSON line per
run to ``--output-file``. With ``--output-details`` that line also holds every
generated text, so rows' outputs can be compared (``figures``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

# Figures copied from bench_serving's result line (ms for times, tok/s for rates).
METRICS = (
    "completed", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "input_throughput", "output_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "mean_e2e_latency_ms", "median_e2e_latency_ms",
)


@dataclass(frozen=True)
class ServingConfig:
    """Arguments of one ``sglang.bench_serving`` run (random-ids dataset)."""

    num_prompts: int = 16
    input_len: int = 512  # exactly, per prompt (--random-range-ratio 1.0)
    output_len: int = 64
    seed: int = 1

    def __post_init__(self) -> None:
        if min(self.num_prompts, self.input_len, self.output_len) <= 0:
            raise ValueError(f"ServingConfig values must be positive: {self}")


PRESETS: dict[str, ServingConfig] = {
    "default": ServingConfig(),
    "quick": ServingConfig(num_prompts=4, input_len=256, output_len=32),
}


def preset(name: str) -> ServingConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown serving preset {name!r}; valid: {sorted(PRESETS)}")
    return PRESETS[name]


@dataclass(frozen=True)
class ServingResult:
    metrics: dict[str, float]
    cached_tokens: int | None  # over all requests, when bench_serving reported it
    generated_texts: tuple[str, ...]
    command: tuple[str, ...]


def command(cfg: ServingConfig, base_url: str, model: str, output_file: str) -> list[str]:
    return [
        sys.executable, "-m", "sglang.bench_serving",
        "--backend", "sglang", "--base-url", base_url,
        "--dataset-name", "random-ids",
        "--num-prompts", str(cfg.num_prompts),
        "--random-input-len", str(cfg.input_len),
        "--random-output-len", str(cfg.output_len),
        "--random-range-ratio", "1.0",  # exactly input_len / output_len tokens
        "--seed", str(cfg.seed),
        "--temperature", "0",
        "--tokenizer", model, "--model", model,
        "--output-file", output_file, "--output-details",
        "--cache-report", "--disable-tqdm",
    ]


def parse(output_file: str) -> dict:
    """The last result line of a bench_serving JSONL file."""
    with open(output_file) as f:
        lines = [line for line in f if line.strip()]
    if not lines:
        raise RuntimeError(f"bench_serving wrote no result to {output_file}")
    return json.loads(lines[-1])


def run_command(cmd: list[str], output_file: str, num_prompts: int, log_path: str,
                timeout_s: float = 1800.0) -> dict:
    """Run one bench_serving command line; its parsed output file. Raises with the log
    tail when it fails, or when fewer than ``num_prompts`` requests completed."""
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=timeout_s)
    if proc.returncode != 0:
        from sgl_spec.bench.server import tail

        raise RuntimeError(
            f"bench_serving exited with {proc.returncode}; log {log_path}:\n{tail(log_path)}"
        )
    raw = parse(output_file)
    if raw.get("completed") != num_prompts:
        raise RuntimeError(
            f"bench_serving completed {raw.get('completed')} of {num_prompts} "
            f"requests; errors: {[e for e in raw.get('errors', []) if e][:3]}; log {log_path}"
        )
    return raw


def run(cfg: ServingConfig, base_url: str, model: str, output_file: str,
        log_path: str, timeout_s: float = 1800.0) -> ServingResult:
    """Run bench_serving once; raises with the log tail when it fails."""
    cmd = command(cfg, base_url, model, output_file)
    raw = run_command(cmd, output_file, cfg.num_prompts, log_path, timeout_s)
    cache = raw.get("cache_report") or {}
    return ServingResult(
        metrics={k: raw[k] for k in METRICS if k in raw},
        cached_tokens=cache.get("total_cached_tokens"),
        generated_texts=tuple(raw.get("generated_texts", ())),
        command=tuple(cmd),
    )


def figures(result: ServingResult) -> dict:
    """A row's serving figures for results.json (seconds, tok/s), with bench_serving's
    own result line and the generated texts (to compare rows)."""
    m = result.metrics
    ms = lambda key: m[key] / 1e3 if key in m else None  # noqa: E731
    return {
        "ttft_mean_s": ms("mean_ttft_ms"),
        "ttft_median_s": ms("median_ttft_ms"),
        "tpot_mean_s": ms("mean_tpot_ms"),
        "tpot_median_s": ms("median_tpot_ms"),
        "output_tok_per_s": m.get("output_throughput"),
        "cached_tokens_total": result.cached_tokens,
        "bench_serving": m,
        "command": list(result.command),
        "generated_texts": list(result.generated_texts),
    }
