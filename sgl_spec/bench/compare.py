"""``python -m sgl_spec.bench.compare --out DIR [--quick]``: sgl_spec vs stock sglang.

In one run: start stock ``sglang.launch_server`` (torch_native attention), drive it
with every workload (``sgl_spec.bench.workloads``), stop it; then the same for
``sgl_spec.launch_server`` with the same model and flags. Writes
``DIR/results.json`` (every figure, per server and workload, sgl_spec/stock ratios,
per-turn records, machine/commit/flags) and ``DIR/results.md`` (the table), plus
the server and bench_serving logs.

Chat histories: stock plays each conversation with its own answers in the history;
sgl_spec is then sent the same conversation with *stock's* answers in the history.
Every turn therefore sends both servers the identical prompt, and one divergent
answer cannot make all later turns differ. Outputs are compared token by token;
where they differ, the top1-top2 logprob margin at the first divergent position
(as each server computed it while generating) says whether it was a near tie.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import asdict, dataclass

import requests

from sgl_spec.bench import chat_client, provenance, report, serving, workloads
from sgl_spec.bench.configset import ServerConfig
from sgl_spec.bench.server import SPEC, STOCK, ServerProcess

logger = logging.getLogger(__name__)

# Flags both servers get, so that only sgl_spec's components differ.
REQUIRED_TTFT_SPEEDUP = 5.0
CHAT_WORKLOADS = ("doc_chat", "growing")


@dataclass(frozen=True)
class CompareConfig:
    out_dir: str
    model: str
    quick: bool
    port: int
    server_args: tuple[str, ...]
    near_tie_nats: float
    workloads: workloads.WorkloadConfig

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65534:
            raise ValueError(f"--port must be in 0..65534 (0: free ports), got {self.port}")
        ServerConfig("--server-arg", "sgl_spec", flags=self.server_args)  # no --port etc.
        if self.near_tie_nats < 0:
            raise ValueError(f"--near-tie must be >= 0, got {self.near_tie_nats}")


def _server_args(cfg: CompareConfig, stock: bool) -> list[str]:
    row = ServerConfig("stock" if stock else "sgl_spec", "stock" if stock else "sgl_spec",
                       flags=cfg.server_args)
    return row.server_args(cfg.model)


def _flush_cache(url: str) -> None:
    """Empty the radix cache so no workload starts with another's prefixes cached."""
    r = requests.post(url + "/flush_cache", timeout=60)
    if r.status_code != 200:
        logger.warning("flush_cache answered %s: %s", r.status_code, r.text[:200])


def _warmup(client, model: str) -> None:
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8, temperature=0.0,
    )


class _Runner:
    """Runs every workload on one server after the other; owns the progress bar."""

    def __init__(self, cfg: CompareConfig, convs: dict[str, list[workloads.Conversation]]):
        from tqdm import tqdm

        self.cfg = cfg
        self.convs = convs
        per_server = 2 + sum(len(c.user_turns) for cs in convs.values() for c in cs)
        self.bar = tqdm(total=2 * per_server, desc="compare", unit="step", dynamic_ncols=True)

    def step(self, desc: str) -> None:
        self.bar.set_description(desc)
        self.bar.update(1)

    def run_server(self, name: str, stock_turns: dict | None) -> dict:
        cfg = self.cfg
        module = STOCK if name == "stock" else SPEC
        port = 0 if cfg.port == 0 else cfg.port + (name != "stock")
        log_path = os.path.join(cfg.out_dir, f"server-{name}.log")
        self.bar.set_description(f"{name}: starting server")
        t0 = time.perf_counter()
        out: dict = {"workloads": {}}
        with ServerProcess(module, _server_args(cfg, name == "stock"), port=port,
                           log_path=log_path) as server:
            start_s = time.perf_counter() - t0
            self.step(f"{name}: warmup")
            client = chat_client.make_client(server.url)
            _warmup(client, cfg.model)

            _flush_cache(server.url)
            self.bar.set_description(f"{name}: bench_serving")
            out["workloads"]["serving"] = serving.run(
                cfg.workloads.serving, server.url, cfg.model,
                os.path.join(cfg.out_dir, f"bench_serving-{name}.jsonl"),
                os.path.join(cfg.out_dir, f"bench_serving-{name}.log"),
            )
            self.step(f"{name}: bench_serving done")

            for wname in CHAT_WORKLOADS:
                _flush_cache(server.url)
                chat_cfg = getattr(cfg.workloads, wname)
                turns = []
                for conv in self.convs[wname]:
                    history = None
                    if stock_turns is not None:
                        history = [t.text for t in stock_turns[wname]
                                   if t.conversation == conv.name]
                    turns += chat_client.play(
                        client, cfg.model, conv, chat_cfg.max_tokens, history,
                        on_turn=lambda t: self.step(
                            f"{name}: {t.conversation} turn {t.turn} "
                            f"ttft {t.ttft_s:.2f}s"),
                    )
                out["workloads"][wname] = turns
        out["server"] = {
            "module": module, "args": _server_args(cfg, name == "stock"), "port": port,
            "start_s": start_s, "peak_rss_bytes": server.peak_rss_bytes, "log": log_path,
        }
        return out


def _serving_entry(stock: serving.ServingResult, spec: serving.ServingResult) -> dict:
    def summary(r: serving.ServingResult) -> dict:
        m = r.metrics
        return {
            "ttft_turn1_mean_s": m["mean_ttft_ms"] / 1e3,
            "ttft_median_s": m["median_ttft_ms"] / 1e3,
            "tpot_mean_s": m["mean_tpot_ms"] / 1e3,
            "tpot_median_s": m["median_tpot_ms"] / 1e3,
            "output_tok_per_s": m["output_throughput"],
            "cached_tokens_later_mean": r.cached_tokens,
            "bench_serving": m,
        }

    a, b = summary(stock), summary(spec)
    same = sum(x == y for x, y in zip(stock.generated_texts, spec.generated_texts))
    return {
        "stock": a, "spec": b, "ratio": report.ratios(b, a),
        "agreement": {"requests": len(stock.generated_texts), "identical_texts": same},
        "command": list(stock.command),
    }


def _chat_entry(stock: list, spec: list, near_tie: float) -> dict:
    compared = report.compare_turns(stock, spec, near_tie)
    a = asdict(report.summarize_turns(stock))
    b = asdict(report.summarize_turns(spec))
    return {
        "stock": a, "spec": b, "ratio": report.ratios(b, a),
        "agreement": report.agreement(compared),
        # Same prompts on both servers, so the radix caches must hit the same.
        "cached_tokens": {
            "turns": len(stock),
            "identical": sum(a.cached_tokens == b.cached_tokens
                             for a, b in zip(stock, spec)),
        },
        "turns_compared": compared,
        "turns": {"stock": [_turn_dict(t) for t in stock],
                  "spec": [_turn_dict(t) for t in spec]},
    }


def _turn_dict(t: chat_client.TurnResult) -> dict:
    d = asdict(t)
    d["tpot_s"] = t.tpot_s
    return d


def _dump_turns(cfg: CompareConfig, name: str, server_out: dict) -> None:
    turns = {w: [_turn_dict(t) for t in server_out["workloads"][w]] for w in CHAT_WORKLOADS}
    with open(os.path.join(cfg.out_dir, f"turns-{name}.json"), "w") as f:
        json.dump(turns, f, indent=1)


def run(cfg: CompareConfig) -> dict:
    from transformers import AutoTokenizer

    os.makedirs(cfg.out_dir, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load_before = provenance.load_average()
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    convs = {name: workloads.conversations(tokenizer, getattr(cfg.workloads, name), name)
             for name in CHAT_WORKLOADS}
    runner = _Runner(cfg, convs)
    stock = runner.run_server("stock", None)
    _dump_turns(cfg, "stock", stock)  # kept even if the sgl_spec server fails
    spec = runner.run_server("spec", stock["workloads"])
    _dump_turns(cfg, "spec", spec)
    runner.bar.close()

    results = {
        "meta": {
            "started": started,
            "duration_s": time.perf_counter() - t0,
            "quick": cfg.quick,
            "model": cfg.model,
            "load_average_before": load_before,
            "load_average_after": provenance.load_average(),
            "machine": provenance.machine(),
            "git": provenance.git(),
            "near_tie_nats": cfg.near_tie_nats,
            "history": "both servers get stock's answers as the chat history",
            "ratio": "sgl_spec / stock",
        },
        "config": asdict(cfg),
        "servers": {"stock": stock["server"], "spec": spec["server"]},
        "workloads": {
            "serving": _serving_entry(stock["workloads"]["serving"],
                                      spec["workloads"]["serving"]),
            **{name: _chat_entry(stock["workloads"][name], spec["workloads"][name],
                                 cfg.near_tie_nats) for name in CHAT_WORKLOADS},
        },
    }
    doc = results["workloads"]["doc_chat"]
    speedup = report.ratio(doc["stock"]["ttft_later_mean_s"], doc["spec"]["ttft_later_mean_s"])
    results["acceptance"] = {
        "doc_chat_ttft_later_speedup": speedup,
        "required_speedup": REQUIRED_TTFT_SPEEDUP,
        "outputs_acceptable": doc["agreement"]["acceptable"],
        "passed": bool(speedup and speedup >= REQUIRED_TTFT_SPEEDUP
                       and doc["agreement"]["acceptable"]),
    }
    with open(os.path.join(cfg.out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(cfg.out_dir, "results.md"), "w") as f:
        f.write(report.markdown(results))
    return results


def parse_args(argv: list[str] | None = None) -> CompareConfig:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_spec.bench.compare",
        description="Benchmark sgl_spec.launch_server against stock sglang.launch_server "
        "(torch_native) in one run: bench_serving random-ids, chat over a document, and "
        "growing context. Writes DIR/results.json and DIR/results.md.",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--quick", action="store_true",
                        help="tiny workloads (~3-5 min) instead of the full run (~20 min)")
    parser.add_argument("--model-path", default=None,
                        help="HF model dir (default: sgl_spec's prepared default model)")
    parser.add_argument("--port", type=int, default=0,
                        help="stock serves on PORT, sgl_spec on PORT+1 (default: free ports)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="extra flag for both servers (repeatable; use --server-arg=--x)")
    parser.add_argument("--near-tie", type=float, default=report.NEAR_TIE_NATS,
                        help="top1-top2 logprob margin (nats) under which a divergence "
                        "counts as a near tie (default %(default)s)")
    args = parser.parse_args(argv)
    model = args.model_path
    if model is None:
        from sgl_spec.prepare_model import prepare

        model = prepare()
    try:
        return CompareConfig(
            out_dir=os.path.abspath(args.out), model=model, quick=args.quick,
            port=args.port, server_args=tuple(args.server_arg),
            near_tie_nats=args.near_tie,
            workloads=workloads.WorkloadConfig.preset(args.quick),
        )
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "openai"):  # one line per request would break the bar
        logging.getLogger(noisy).setLevel(logging.WARNING)
    cfg = parse_args(argv)
    results = run(cfg)
    print(report.markdown(results))
    acc = results["acceptance"]
    speedup = acc["doc_chat_ttft_later_speedup"]
    print(f"doc_chat TTFT turns>=2 speedup: "
          f"{'n/a' if speedup is None else f'{speedup:.2f}'}x "
          f"(required {acc['required_speedup']}x), outputs acceptable: "
          f"{acc['outputs_acceptable']} -> {'PASS' if acc['passed'] else 'FAIL'}")
    print(f"results: {os.path.join(cfg.out_dir, 'results.json')}")


if __name__ == "__main__":
    main()
