"""Play the evaluation workloads on servers and assemble ``results.json``.

Two ways to run (``python -m sgl_spec.bench``):

* against a running OpenAI-compatible server (``against_url``);
* side by side (``side_by_side``): for every row of a configuration set in turn,
  start its server, warm it up, play the multi-turn QA dataset (``dataset``) and
  the long-generation prompts (``longgen``), stop it. Every configuration gets the
  same prompts; each plays its own answers as the chat history, so accuracy is what
  a user of that configuration would see.

What is played is a ``plan.RunPlan``. Around each workload the runner reads the
server's sparse-decode counters (``sparse_counters``), so the report says how many
decode steps actually attended a KV subset.

Conversations run ``concurrency`` at a time; the turns of one conversation are
sequential. The figures are computed by ``summary``, the table by ``tables`` and
the plots by ``plots``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import NamedTuple

import requests

from sgl_spec.bench import chat_client, plots, provenance, sparse_counters, summary, tables
from sgl_spec.bench.chat_client import PlayItem
from sgl_spec.bench.compare import _flush_cache, _warmup
from sgl_spec.bench.configset import ConfigSet, ServerConfig
from sgl_spec.bench.dataset import POSITIONS, Conversation, DatasetConfig
from sgl_spec.bench.plan import RunPlan
from sgl_spec.bench.server import ServerProcess, ServerStartError, tail

logger = logging.getLogger(__name__)

SOLVABLE_EM = 0.5  # the bar for end-position, this-turn questions


class ConfigRunError(RuntimeError):
    """A configuration's server came up but failed while the workloads played."""


class ConfigRun(NamedTuple):
    """What one configuration answered; ``server`` is None for a URL run."""

    name: str
    config: dict | None  # asdict(ServerConfig)
    server: dict | None
    chat: list[chat_client.TurnResult]
    longgen: list[chat_client.TurnResult]
    # workload -> sparse_counters.delta (None: the server exports no such counters)
    sparse: dict[str, dict | None] | None = None


class _Progress:
    """One tqdm bar over all turns of all configurations, shared by worker threads."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="bench", unit="turn", dynamic_ncols=True)
        self.lock = threading.Lock()

    def describe(self, text: str) -> None:
        with self.lock:
            self.bar.set_description(text)

    def turn(self, label: str, t: chat_client.TurnResult) -> None:
        with self.lock:
            self.bar.set_description(f"{label}: {t.conversation} turn {t.turn} "
                                     f"ttft {t.ttft_s:.2f}s")
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def play_all(url: str, model: str, items: Sequence[PlayItem], concurrency: int,
             progress: _Progress, label: str) -> list[chat_client.TurnResult]:
    """Play every item, ``concurrency`` conversations at a time; results in the order
    of ``items``, turn by turn."""
    client = chat_client.make_client(url)

    def one(item: PlayItem):
        return chat_client.play(client, model, item.conversation, item.max_tokens,
                                on_turn=lambda t: progress.turn(label, t),
                                ignore_eos=item.ignore_eos)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        per_conv = list(pool.map(one, items))
    return [t for turns in per_conv for t in turns]


def _play_workloads(url: str, model: str, plan: RunPlan, convs: Sequence[Conversation],
                    answer_tokens: int, longgen_items: Sequence[PlayItem],
                    progress: _Progress, label: str):
    """Chat, then long generation; and the sparse-decode counters of each."""
    _flush_cache(url)  # every configuration starts with an empty prefix cache
    before = sparse_counters.read(url)  # after the warm-up
    chat = play_all(url, model, [PlayItem(c.to_workload(), answer_tokens) for c in convs],
                    plan.concurrency, progress, label)
    after_chat = sparse_counters.read(url)
    _flush_cache(url)
    lg = play_all(url, model, longgen_items, plan.concurrency, progress, label)
    after_lg = sparse_counters.read(url)
    sparse = {"chat": sparse_counters.delta(after_chat, before),
              "longgen": sparse_counters.delta(after_lg, after_chat)}
    return chat, lg, sparse


def run_config(cfg: ServerConfig, model: str, plan: RunPlan, convs: Sequence[Conversation],
               longgen_items: Sequence[PlayItem], answer_tokens: int, out_dir: str,
               progress: _Progress) -> ConfigRun:
    """Start ``cfg``'s server, play everything on it, stop it. Raises ServerStartError
    (with the tail of the server log) if it does not come up."""
    log_path = os.path.join(out_dir, f"server-{cfg.slug}.log")
    args = cfg.server_args(model)
    progress.describe(f"{cfg.name}: starting server")
    t0 = time.perf_counter()
    try:
        server = ServerProcess(cfg.module, args, log_path=log_path).start()
    except ServerStartError as exc:
        raise ServerStartError(f"configuration {cfg.name!r}: the server did not come up. "
                               f"{exc}") from None
    try:
        start_s = time.perf_counter() - t0
        _warmup(chat_client.make_client(server.url), model)
        chat, lg, sparse = _play_workloads(server.url, model, plan, convs, answer_tokens,
                                           longgen_items, progress, cfg.name)
    except Exception as exc:
        server.stop()
        raise ConfigRunError(f"configuration {cfg.name!r} failed while playing: {exc!r}; "
                             f"log {log_path}:\n{tail(log_path)}") from exc
    finally:
        server.stop()
    info = {"module": cfg.module, "args": args, "start_s": start_s,
            "peak_rss_bytes": server.peak_rss_bytes, "log": log_path}
    return ConfigRun(cfg.name, asdict(cfg), info, chat, lg, sparse)


def _dump_turns(out_dir: str, slug: str, run: ConfigRun) -> None:
    """Every TurnResult with ids and logprobs, for later diagnosis."""
    with open(os.path.join(out_dir, f"turns-{slug}.json"), "w") as f:
        json.dump({"chat": [asdict(t) for t in run.chat],
                   "longgen": [asdict(t) for t in run.longgen]}, f)


def build_results(meta: dict, dataset_config: DatasetConfig, convs: Sequence[Conversation],
                  plan: RunPlan, runs: Sequence[ConfigRun], reference: str | None,
                  within_points: dict[str, float] | None = None) -> dict:
    """``results.json``: every figure of every configuration, in run order.
    ``within_points``: row -> the most exact-match points it may lose to the
    reference at any query position (``acceptance``)."""
    from sgl_spec.bench import dataset

    by_name = {r.name: r for r in runs}
    ref = by_name.get(reference) if reference else None
    configs = []
    for run in runs:
        entry = {"name": run.name, "config": run.config, "server": run.server,
                 **summary.config_figures(summary.score_conversations(convs, run.chat),
                                          run.longgen),
                 "sparse_decode": run.sparse or {"chat": None, "longgen": None}}
        if ref is not None and run is not ref:
            entry["agreement"] = {
                "chat": summary.agreement_figures(ref.chat, run.chat),
                "longgen": summary.agreement_figures(ref.longgen, run.longgen),
            }
        configs.append(entry)
    results = {
        "meta": meta,
        "dataset": {"config": asdict(dataset_config), "stats": dataset.stats(list(convs))},
        "longgen": {"prompts": list(plan.longgen), "max_tokens": plan.longgen_max_tokens},
        "reference": reference,
        "checks": {"within_points": dict(within_points or {})},
        "configs": configs,
    }
    results["acceptance"] = acceptance(results)
    return results


def position_deltas(row: dict, ref: dict) -> dict[str, float | None]:
    """Exact match of ``row`` minus the reference's, in points (0-100), per query
    position; None where either has no question at that position."""
    out = {}
    for p in POSITIONS:
        a, b = row["accuracy"]["by_position"].get(p), ref["accuracy"]["by_position"].get(p)
        ok = a and b and a.get("n") and b.get("n")
        out[p] = 100.0 * (a["exact_match"] - b["exact_match"]) if ok else None
    return out


def _position_check(row: dict, ref: dict, tolerance: float | None) -> str:
    deltas = position_deltas(row, ref)
    text = ", ".join(f"{p} {'n/a' if d is None else f'{d:+.1f}'}" for p, d in deltas.items())
    if tolerance is None:
        return f"{text} points"
    ok = all(d is not None and d >= -tolerance - 1e-9 for d in deltas.values())
    return f"{text} points (need >= {-tolerance:g} each): {'PASS' if ok else 'FAIL'}"


def acceptance(results: dict) -> dict:
    """The issue's checks: the reference solves the dataset, every other row's
    exact-match change against it per query position (PASS/FAIL for the rows of
    ``results["checks"]["within_points"]``: losing at most that many points at every
    position), and whether each row agrees with it on every answer (a row is not
    expected to agree unless it is exact; the table shows every row's figures)."""
    ref_name = results["reference"]
    within = (results.get("checks") or {}).get("within_points") or {}
    ref = next((c for c in results["configs"] if c["name"] == ref_name), None)
    out = {}
    for c in results["configs"]:
        e = c["end_this_turn_short"]
        if c["name"] == ref_name or ref_name is None:
            em = e["exact_match"]
            if em is None:  # the dataset has no such question (e.g. only long turns)
                verdict = "n/a (no such question in this dataset)"
            else:
                verdict = "PASS" if em >= SOLVABLE_EM else "FAIL"
            out[f"{c['name']}: end-position this-turn EM, history < "
                f"{e['max_history_tokens']} tokens"] = (
                f"{'n/a' if em is None else f'{em:.2f}'} of {e['n']} questions "
                f"(need >= {SOLVABLE_EM}): {verdict}")
        if ref is not None and c is not ref:
            tol = within.get(c["name"])
            key = (f"{c['name']}: exact match vs {ref_name} by query position" if tol is None
                   else f"{c['name']}: exact match within {tol:g} points of {ref_name} at "
                   f"every query position")
            out[key] = _position_check(c, ref, tol)
        agree = c.get("agreement")
        if agree:
            chat, lg = agree["chat"]["counts"], agree["longgen"]["counts"]
            out[f"{c['name']}: identical to {ref_name}"] = (
                f"chat {chat['identical']}/{chat['turns']}, long-gen "
                f"{lg['identical']}/{lg['turns']}")
    return out


def write_results(results: dict, out_dir: str) -> list[str]:
    """results.json, results.md and the plots; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "results.json")
    md_path = os.path.join(out_dir, "results.md")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    with open(md_path, "w") as f:
        f.write(tables.markdown(results))
    return [json_path, md_path, *plots.write_plots(results, out_dir)]


def _meta(configset: str, model: str, plan: RunPlan, quick: bool) -> dict:
    return {
        "configset": configset, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": model, "quick": quick, "dataset_preset": plan.dataset,
        "concurrency": plan.concurrency, "plan": asdict(plan),
        "load_average_before": provenance.load_average(),
        "machine": provenance.machine(), "git": provenance.git(),
    }


def _finish(meta: dict, t0: float, dataset_config, convs, plan, runs, reference,
            out_dir: str, within_points: dict[str, float] | None = None) -> dict:
    meta["duration_s"] = time.perf_counter() - t0
    meta["load_average_after"] = provenance.load_average()
    results = build_results(meta, dataset_config, convs, plan, runs, reference,
                            within_points)
    write_results(results, out_dir)
    return results


def side_by_side(configset: ConfigSet, model: str, plan: RunPlan, dataset_config: DatasetConfig,
                 convs: Sequence[Conversation], longgen_items: Sequence[PlayItem],
                 out_dir: str, quick: bool) -> dict:
    """Every configuration of ``configset`` in file order, one server at a time;
    ``longgen_items`` are ``plan.longgen_items(tokenizer)``."""
    if plan.concurrency > 1:
        logger.warning("concurrency %d batches requests: timings and greedy outputs then "
                       "depend on scheduling, so agreement may drop", plan.concurrency)
    t0 = time.perf_counter()
    meta = _meta(configset.name, model, plan, quick)
    meta["configset_description"] = configset.description
    per_config = sum(len(c.turns) for c in convs) + len(plan.longgen)
    progress = _Progress(per_config * len(configset.configs))
    runs = []
    try:
        for cfg in configset.configs:
            run = run_config(cfg, model, plan, convs, longgen_items,
                             dataset_config.max_tokens, out_dir, progress)
            _dump_turns(out_dir, cfg.slug, run)  # kept if a later configuration fails
            runs.append(run)
    finally:
        progress.close()
    return _finish(meta, t0, dataset_config, convs, plan, runs, configset.reference.name,
                   out_dir, dict(configset.within_points))


def served_model(url: str) -> str:
    """The first model id a server lists at /v1/models."""
    r = requests.get(url.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def against_url(url: str, name: str, plan: RunPlan, dataset_config: DatasetConfig,
                convs: Sequence[Conversation], longgen_items: Sequence[PlayItem],
                out_dir: str, quick: bool) -> dict:
    """Play everything on an already running server (no memory figure, no agreement)."""
    url = url.rstrip("/").removesuffix("/v1")
    t0 = time.perf_counter()
    model = served_model(url)
    meta = _meta(f"url {url}", model, plan, quick)
    progress = _Progress(sum(len(c.turns) for c in convs) + len(plan.longgen))
    try:
        chat, lg, sparse = _play_workloads(url, model, plan, convs,
                                           dataset_config.max_tokens, longgen_items,
                                           progress, name)
    finally:
        progress.close()
    run = ConfigRun(name, None, {"url": url}, chat, lg, sparse)
    _dump_turns(out_dir, "url", run)
    return _finish(meta, t0, dataset_config, convs, plan, [run], None, out_dir)
