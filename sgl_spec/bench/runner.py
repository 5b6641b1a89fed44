"""Play the evaluation workloads on servers and assemble ``results.json``.

Two ways to run (``python -m sgl_spec.bench``):

* against a running OpenAI-compatible server (``against_url``);
* side by side (``side_by_side``): for every row of a configuration set in turn,
  start its server, warm it up, play the multi-turn QA dataset (``dataset``) and
  the long-generation prompts (``longgen``), stop it. Every configuration gets the
  same prompts; each plays its own answers as the chat history, so accuracy is what
  a user of that configuration would see.

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
from dataclasses import asdict, dataclass
from typing import NamedTuple

import requests

from sgl_spec.bench import chat_client, longgen, plots, provenance, summary, tables, workloads
from sgl_spec.bench.compare import _flush_cache, _warmup
from sgl_spec.bench.configset import ConfigSet, ServerConfig
from sgl_spec.bench.dataset import Conversation, DatasetConfig
from sgl_spec.bench.server import ServerProcess, ServerStartError, tail

logger = logging.getLogger(__name__)

SOLVABLE_EM = 0.5  # the bar for end-position, this-turn questions


class ConfigRunError(RuntimeError):
    """A configuration's server came up but failed while the workloads played."""


@dataclass(frozen=True)
class RunPlan:
    """What each configuration plays. ``longgen_max_tokens`` caps every long-generation
    prompt's own budget (``longgen.LongGenPrompt.max_tokens``) to fit the run time."""

    dataset: str  # a DatasetConfig preset
    longgen: tuple[str, ...]  # prompt names
    longgen_max_tokens: int
    concurrency: int = 1

    def __post_init__(self) -> None:
        DatasetConfig.preset(self.dataset)  # raises on an unknown preset
        names = {p.name for p in longgen.PROMPTS}
        bad = [n for n in self.longgen if n not in names]
        if bad:
            raise ValueError(f"unknown long-generation prompt(s) {bad}; valid: {sorted(names)}")
        if self.longgen_max_tokens <= 0:
            raise ValueError(f"longgen_max_tokens must be positive, got {self.longgen_max_tokens}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    @classmethod
    def preset(cls, quick: bool, concurrency: int = 1) -> RunPlan:
        if quick:  # ~2 min per configuration on 2 cores
            return cls("quick", ("long-division",), 256, concurrency)
        return cls("default", ("long-division", "animals"), 1024, concurrency)

    def longgen_items(self) -> list[tuple[workloads.Conversation, int]]:
        by_name = {p.name: p for p in longgen.PROMPTS}
        return [(by_name[n].to_workload(), min(by_name[n].max_tokens, self.longgen_max_tokens))
                for n in self.longgen]


class ConfigRun(NamedTuple):
    """What one configuration answered; ``server`` is None for a URL run."""

    name: str
    config: dict | None  # asdict(ServerConfig)
    server: dict | None
    chat: list[chat_client.TurnResult]
    longgen: list[chat_client.TurnResult]


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


def play_all(url: str, model: str, items: Sequence[tuple[workloads.Conversation, int]],
             concurrency: int, progress: _Progress, label: str) -> list[chat_client.TurnResult]:
    """Play every ``(conversation, max_tokens)``, ``concurrency`` conversations at a time;
    results in the order of ``items``, turn by turn."""
    client = chat_client.make_client(url)

    def one(item):
        conv, max_tokens = item
        return chat_client.play(client, model, conv, max_tokens,
                                on_turn=lambda t: progress.turn(label, t))

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        per_conv = list(pool.map(one, items))
    return [t for turns in per_conv for t in turns]


def _play_workloads(url: str, model: str, plan: RunPlan, convs: Sequence[Conversation],
                    answer_tokens: int, progress: _Progress, label: str):
    _flush_cache(url)  # every configuration starts with an empty prefix cache
    chat = play_all(url, model, [(c.to_workload(), answer_tokens) for c in convs],
                    plan.concurrency, progress, label)
    _flush_cache(url)
    lg = play_all(url, model, plan.longgen_items(), plan.concurrency, progress, label)
    return chat, lg


def run_config(cfg: ServerConfig, model: str, plan: RunPlan, convs: Sequence[Conversation],
               answer_tokens: int, out_dir: str, progress: _Progress) -> ConfigRun:
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
        chat, lg = _play_workloads(server.url, model, plan, convs, answer_tokens, progress,
                                   cfg.name)
    except Exception as exc:
        server.stop()
        raise ConfigRunError(f"configuration {cfg.name!r} failed while playing: {exc!r}; "
                             f"log {log_path}:\n{tail(log_path)}") from exc
    finally:
        server.stop()
    info = {"module": cfg.module, "args": args, "start_s": start_s,
            "peak_rss_bytes": server.peak_rss_bytes, "log": log_path}
    return ConfigRun(cfg.name, asdict(cfg), info, chat, lg)


def _dump_turns(out_dir: str, slug: str, run: ConfigRun) -> None:
    """Every TurnResult with ids and logprobs, for later diagnosis."""
    with open(os.path.join(out_dir, f"turns-{slug}.json"), "w") as f:
        json.dump({"chat": [asdict(t) for t in run.chat],
                   "longgen": [asdict(t) for t in run.longgen]}, f)


def build_results(meta: dict, dataset_config: DatasetConfig, convs: Sequence[Conversation],
                  plan: RunPlan, runs: Sequence[ConfigRun], reference: str | None) -> dict:
    """``results.json``: every figure of every configuration, in run order."""
    from sgl_spec.bench import dataset

    by_name = {r.name: r for r in runs}
    ref = by_name.get(reference) if reference else None
    configs = []
    for run in runs:
        entry = {"name": run.name, "config": run.config, "server": run.server,
                 **summary.config_figures(summary.score_conversations(convs, run.chat),
                                          run.longgen)}
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
        "configs": configs,
    }
    results["acceptance"] = acceptance(results)
    return results


def acceptance(results: dict) -> dict:
    """The issue's checks: the reference solves the dataset, and every other
    exact-attention row agrees with it on every answer (a row is not expected to
    agree unless it is exact; the table shows every row's figures)."""
    ref_name = results["reference"]
    out = {}
    for c in results["configs"]:
        e = c["end_this_turn_short"]
        if c["name"] == ref_name or ref_name is None:
            em = e["exact_match"]
            verdict = "PASS" if em is not None and em >= SOLVABLE_EM else "FAIL"
            out[f"{c['name']}: end-position this-turn EM, history < "
                f"{e['max_history_tokens']} tokens"] = (
                f"{'n/a' if em is None else f'{em:.2f}'} of {e['n']} questions "
                f"(need >= {SOLVABLE_EM}): {verdict}")
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
            out_dir: str) -> dict:
    meta["duration_s"] = time.perf_counter() - t0
    meta["load_average_after"] = provenance.load_average()
    results = build_results(meta, dataset_config, convs, plan, runs, reference)
    write_results(results, out_dir)
    return results


def side_by_side(configset: ConfigSet, model: str, plan: RunPlan, dataset_config: DatasetConfig,
                 convs: Sequence[Conversation], out_dir: str, quick: bool) -> dict:
    """Every configuration of ``configset`` in file order, one server at a time."""
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
            run = run_config(cfg, model, plan, convs, dataset_config.max_tokens, out_dir,
                             progress)
            _dump_turns(out_dir, cfg.slug, run)  # kept if a later configuration fails
            runs.append(run)
    finally:
        progress.close()
    return _finish(meta, t0, dataset_config, convs, plan, runs, configset.reference.name,
                   out_dir)


def served_model(url: str) -> str:
    """The first model id a server lists at /v1/models."""
    r = requests.get(url.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def against_url(url: str, name: str, plan: RunPlan, dataset_config: DatasetConfig,
                convs: Sequence[Conversation], out_dir: str, quick: bool) -> dict:
    """Play everything on an already running server (no memory figure, no agreement)."""
    url = url.rstrip("/").removesuffix("/v1")
    t0 = time.perf_counter()
    model = served_model(url)
    meta = _meta(f"url {url}", model, plan, quick)
    progress = _Progress(sum(len(c.turns) for c in convs) + len(plan.longgen))
    try:
        chat, lg = _play_workloads(url, model, plan, convs, dataset_config.max_tokens,
                                   progress, name)
    finally:
        progress.close()
    run = ConfigRun(name, None, {"url": url}, chat, lg)
    _dump_turns(out_dir, "url", run)
    return _finish(meta, t0, dataset_config, convs, plan, [run], None, out_dir)
