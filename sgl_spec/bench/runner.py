"""Play the evaluation workloads on servers and assemble ``results.json``.

Two ways to run (``python -m sgl_spec.bench``):

* against a running OpenAI-compatible server (``against_url``);
* side by side (``side_by_side``): for every row of a configuration set in turn,
  start its server, warm it up, play every workload of the ``plan.RunPlan``, stop it.

The workloads, each after a cache flush:

1. the multi-turn QA dataset (``dataset``): each row plays its own answers as the
   chat history, so accuracy is what a user of that row would see;
2. the long-generation prompts (``longgen``);
3. the speed chats (``chats``: chat over a document, growing context): every row
   after the first is sent the first row's answers as the history, so all rows get
   the same prompts and their TTFTs and outputs compare turn by turn;
4. ``sglang.bench_serving`` random-ids (``serving``), when the plan asks for it.

Around 1 and 2 the runner reads the server's sparse-decode counters
(``sparse_counters``), so the report says how many decode steps attended a KV
subset. Conversations run ``concurrency`` at a time; the turns of one conversation
are sequential. A row's finished QA conversations are kept as they finish
(``journal``), so ``--resume`` continues an interrupted row where it stopped.
``results`` computes the figures and checks, ``tables`` and ``plots`` render them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import NamedTuple

import requests

from sgl_spec.bench import chat_client, cli, provenance, results, serving, sparse_counters
from sgl_spec.bench.journal import Journal
from sgl_spec.bench.chat_client import PlayItem, TurnResult
from sgl_spec.bench.configset import ConfigSet, ServerConfig
from sgl_spec.bench.dataset import Conversation, DatasetConfig
from sgl_spec.bench.plan import RunPlan
from sgl_spec.bench.results import ConfigRun
from sgl_spec.bench.server import ServerProcess, ServerStartError, flush_cache, tail
from sgl_spec.bench.timing import Stopwatch

logger = logging.getLogger(__name__)


class ConfigRunError(RuntimeError):
    """A configuration's server came up but failed while the workloads played."""


class Workloads(NamedTuple):
    """Everything a row plays, rendered once (offline) for all rows."""

    plan: RunPlan
    convs: Sequence[Conversation]  # the QA dataset
    answer_tokens: int  # the QA dataset's answer budget
    longgen: Sequence[PlayItem]  # plan.longgen_items
    chats: dict[str, list[PlayItem]]  # plan.chat_items

    @property
    def turns(self) -> int:
        """Progress steps of one row: every turn, and the serving run."""
        chats = sum(len(i.conversation.user_turns) for items in self.chats.values()
                    for i in items)
        return (sum(len(c.turns) for c in self.convs) + len(self.longgen) + chats
                + (self.plan.serving is not None))


class Progress:
    """One tqdm bar over all turns of all configurations, shared by worker threads."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="bench", unit="turn", dynamic_ncols=True)
        self.lock = threading.Lock()

    def describe(self, text: str) -> None:
        with self.lock:
            self.bar.set_description(text)

    def step(self, text: str) -> None:
        with self.lock:
            self.bar.set_description(text)
            self.bar.update(1)

    def turn(self, label: str, t: TurnResult) -> None:
        self.step(f"{label}: {t.conversation} turn {t.turn} ttft {t.ttft_s:.2f}s")

    def skip(self, turns: int) -> None:
        with self.lock:
            self.bar.update(turns)

    def close(self) -> None:
        self.bar.close()


def play_all(url: str, model: str, items: Sequence[PlayItem], concurrency: int,
             progress: Progress, label: str,
             history: dict[str, list[str]] | None = None,
             on_done: Callable[[str, list[TurnResult] | None], None] | None = None
             ) -> list[TurnResult]:
    """Play every item, ``concurrency`` conversations at a time; results in the order
    of ``items``, turn by turn. ``history`` (conversation name -> one answer per turn)
    replaces this server's own answers in the chat history; ``on_done`` is told of
    each conversation as it finishes (its turns; None where it failed)."""
    client = chat_client.make_client(url)
    failed = threading.Event()  # set by the first failure: nothing starts after it

    def one(item: PlayItem):
        if failed.is_set():
            raise _NotStarted(item.conversation.name)
        pinned = None if history is None else history[item.conversation.name]
        try:
            turns = chat_client.play(client, model, item.conversation, item.max_tokens,
                                     pinned, on_turn=lambda t: progress.turn(label, t),
                                     ignore_eos=item.ignore_eos)
        except BaseException:
            failed.set()
            if on_done is not None:
                on_done(item.conversation.name, None)
            raise
        if on_done is not None:
            on_done(item.conversation.name, turns)
        return turns

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(one, item) for item in items]
        try:
            # In order: a conversation not started (after a failure) comes after the
            # one that failed, since the pool starts them in order.
            per_conv = [f.result() for f in futures]
        except BaseException:
            failed.set()  # a failed conversation stops the ones not yet started
            for f in futures:
                f.cancel()
            raise
    return [t for turns in per_conv for t in turns]


class _NotStarted(Exception):
    """A conversation not played because an earlier one failed."""


def answers(turns: Sequence[TurnResult]) -> dict[str, list[str]]:
    """Conversation name -> its answers in turn order: the history later rows replay."""
    out: dict[str, list[str]] = {}
    for t in sorted(turns, key=lambda t: (t.conversation, t.turn)):
        out.setdefault(t.conversation, []).append(t.text)
    return out


def _play_qa(url: str, model: str, work: Workloads, progress: Progress, label: str,
             journal: Journal | None):
    """The QA dataset: the turns in dataset order, the sparse counters' record and the
    server's counters at the end; with a ``journal``, only the conversations it lacks
    are played."""
    items = [PlayItem(c.to_workload(), work.answer_tokens) for c in work.convs]
    done = journal.done if journal is not None else None
    todo = [i for i in items if done is None or i.conversation.name not in done.turns]
    if len(todo) < len(items):
        logger.info("%s: resuming after %d of %d conversations (%s)", label,
                    len(items) - len(todo), len(items), journal.path)
        progress.skip(sum(len(ts) for ts in done.turns.values()))
    before = sparse_counters.read(url)  # after the warm-up
    on_done = None
    if journal is not None:
        journal.start(before)
        on_done = lambda name, turns: journal.record(  # noqa: E731
            name, turns, sparse_counters.read(url))
    played: dict[str, list[TurnResult]] = {}
    for t in play_all(url, model, todo, work.plan.concurrency, progress, label,
                      on_done=on_done):
        played.setdefault(t.conversation, []).append(t)
    after = sparse_counters.read(url)
    counters = sparse_counters.minus(after, before)
    if done is not None:
        played |= done.turns
        counters = sparse_counters.plus(done.counters, counters)
    return ([t for i in items for t in played.get(i.conversation.name, [])],
            sparse_counters.delta(counters, None), after)


def _play_workloads(url: str, model: str, work: Workloads, progress: Progress, label: str,
                    out_dir: str, slug: str, pinned: ConfigRun | None,
                    journal: Journal | None = None) -> dict:
    """Every workload of ``work`` on one server; ConfigRun's fields that it fills."""
    concurrency = work.plan.concurrency
    flush_cache(url)  # every configuration starts with an empty prefix cache
    chat, chat_counts, after_chat = _play_qa(url, model, work, progress, label, journal)
    flush_cache(url)
    lg = play_all(url, model, work.longgen, concurrency, progress, label)
    after_lg = sparse_counters.read(url)
    speed = {}
    for name, items in work.chats.items():
        flush_cache(url)
        history = answers(pinned.chats[name]) if pinned is not None else None
        speed[name] = play_all(url, model, items, concurrency, progress, label, history)
    served = None
    if work.plan.serving_config is not None:
        flush_cache(url)
        progress.describe(f"{label}: bench_serving")
        served = serving.figures(serving.run(
            work.plan.serving_config, url, model,
            os.path.join(out_dir, f"bench_serving-{slug}.jsonl"),
            os.path.join(out_dir, f"bench_serving-{slug}.log")))
        progress.step(f"{label}: bench_serving done")
    return {"chat": chat, "longgen": lg, "chats": speed, "serving": served,
            "sparse": {"chat": chat_counts,
                       "longgen": sparse_counters.delta(after_lg, after_chat)}}


def offload_report(url: str) -> dict | None:
    """The server's ``GET /sgl_spec/cache`` -> ``offload`` (``--spec-offload auto``: the
    layers on the host, the moves, the bytes), or None (stock, offload off)."""
    try:
        return requests.get(url + "/sgl_spec/cache", timeout=60).json().get("offload")
    except (requests.RequestException, ValueError, AttributeError):
        return None


def run_config(cfg: ServerConfig, model: str, work: Workloads, out_dir: str,
               progress: Progress, pinned: ConfigRun | None = None,
               journal: Journal | None = None) -> ConfigRun:
    """Start ``cfg``'s server, play everything on it, stop it. Raises ServerStartError
    (with the tail of the server log) if it does not come up. ``pinned``: the run whose
    speed-chat answers are this row's chat history; ``journal``: the row's finished QA
    conversations (played by an earlier, interrupted run, and kept as they finish)."""
    log_path = os.path.join(out_dir, f"server-{cfg.slug}.log")
    args = cfg.server_args(model)
    progress.describe(f"{cfg.name}: starting server")
    watch = Stopwatch()
    try:
        server = ServerProcess(cfg.module, args, log_path=log_path).start()
    except ServerStartError as exc:
        raise ServerStartError(f"configuration {cfg.name!r}: the server did not come up. "
                               f"{exc}") from None
    try:
        start_s = watch.elapsed()
        chat_client.warmup(chat_client.make_client(server.url), model)
        played = _play_workloads(server.url, model, work, progress, cfg.name, out_dir,
                                 cfg.slug, pinned, journal)
        offload = offload_report(server.url)
    except Exception as exc:
        server.stop()
        raise ConfigRunError(f"configuration {cfg.name!r} failed while playing: {exc!r}; "
                             f"log {log_path}:\n{tail(log_path)}") from exc
    finally:
        server.stop()
    info = {"module": cfg.module, "args": args, "start_s": start_s,
            "peak_rss_bytes": server.peak_rss_bytes, "log": log_path}
    if offload is not None:  # --spec-offload auto: where the layers were at the end
        info["offload"] = offload
    return ConfigRun(cfg.name, asdict(cfg), info, **played)


INPUT_FILES = ("dataset.jsonl", "longgen.json", "chats.json")  # __main__._write_inputs


def fingerprint(cfg: ServerConfig, model: str, work: Workloads, out_dir: str,
                quick: bool) -> str:
    """What a row's results depend on besides the code: its configuration, the model,
    the plan and everything it is asked (the inputs ``_write_inputs`` wrote)."""
    h = hashlib.sha256(json.dumps({"config": asdict(cfg), "model": os.path.abspath(model),
                                   "plan": asdict(work.plan), "quick": quick,
                                   "answer_tokens": work.answer_tokens},
                                  sort_keys=True, default=str).encode())
    for name in INPUT_FILES:
        with open(os.path.join(out_dir, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _turns_path(out_dir: str, slug: str) -> str:
    return os.path.join(out_dir, f"turns-{slug}.json")


def _dump_turns(out_dir: str, slug: str, run: ConfigRun, fp: str | None = None) -> None:
    """Every TurnResult with ids and logprobs, for later diagnosis, and the rest of the
    row (server info, counters, serving figures, ``fp``) so ``--resume`` can reuse it."""
    def turns(ts):
        return [asdict(t) for t in ts]

    with open(_turns_path(out_dir, slug), "w") as f:
        json.dump({"chat": turns(run.chat), "longgen": turns(run.longgen),
                   "chats": {n: turns(ts) for n, ts in (run.chats or {}).items()},
                   "name": run.name, "config": run.config, "server": run.server,
                   "sparse": run.sparse, "serving": run.serving, "fingerprint": fp}, f)


def load_row(out_dir: str, slug: str, fp: str) -> ConfigRun | None:
    """The row an earlier run of the same inputs left in ``out_dir``; None if there is
    none, or it was played on other inputs (its fingerprint differs)."""
    try:
        with open(_turns_path(out_dir, slug)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if data.get("fingerprint") != fp:
        return None

    def turns(ts):
        return [TurnResult.from_json(t) for t in ts]

    return ConfigRun(data["name"], data["config"], data["server"], turns(data["chat"]),
                     turns(data["longgen"]), data["sparse"],
                     {n: turns(ts) for n, ts in data["chats"].items()}, data["serving"])


def _meta(configset: str, model: str, plan: RunPlan, quick: bool) -> dict:
    return provenance.run_meta(model, configset=configset, quick=quick,
                               dataset_preset=plan.dataset, concurrency=plan.concurrency,
                               plan=asdict(plan))


def _finish(meta: dict, watch: Stopwatch, dataset_config: DatasetConfig, work: Workloads,
            runs: Sequence[ConfigRun], reference: str | None, out_dir: str,
            configset: ConfigSet | None = None) -> dict:
    res = results.build(cli.finish_meta(meta, watch), dataset_config, work.convs, work.plan, runs, reference,
                        dict(configset.within_points) if configset else None,
                        dict(configset.followup_speedup) if configset else None)
    results.write(res, out_dir)
    return res


def side_by_side(configset: ConfigSet, model: str, dataset_config: DatasetConfig,
                 work: Workloads, out_dir: str, quick: bool, resume: bool = False) -> dict:
    """Every configuration of ``configset`` in file order, one server at a time.
    ``resume``: a row whose ``turns-<row>.json`` in ``out_dir`` was played on the same
    inputs is read back instead of played again (its server info says when and at
    which commit it was played; the tables mark speed ratios across runs), and a row
    that was interrupted plays only the QA conversations its journal lacks."""
    plan = work.plan
    if plan.concurrency > 1:
        logger.warning("concurrency %d batches requests: timings and greedy outputs then "
                       "depend on scheduling, so agreement may drop", plan.concurrency)
    watch = Stopwatch()
    meta = _meta(configset.name, model, plan, quick)
    meta["configset_description"] = configset.description
    progress = Progress(work.turns * len(configset.configs))
    runs: list[ConfigRun] = []
    try:
        for cfg in configset.configs:
            fp = fingerprint(cfg, model, work, out_dir, quick)
            run = load_row(out_dir, cfg.slug, fp) if resume else None
            if run is not None:
                logger.info("%s: reusing the row played at %s (--resume)", cfg.name,
                            results.played({"server": run.server}))
                progress.bar.update(work.turns)
            else:
                journal = Journal(out_dir, cfg.slug, fp, resume)
                run = run_config(cfg, model, work, out_dir, progress,
                                 runs[0] if runs else None, journal=journal)
                run.server["played"] = {"started": meta["started"], "git": meta["git"]}
                _dump_turns(out_dir, cfg.slug, run, fp)  # kept if a later one fails
                journal.remove()
            runs.append(run)
    finally:
        progress.close()
    return _finish(meta, watch, dataset_config, work, runs, configset.reference.name,
                   out_dir, configset)


def served_model(url: str) -> str:
    """The first model id a server lists at /v1/models."""
    r = requests.get(url.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def against_url(url: str, name: str, dataset_config: DatasetConfig, work: Workloads,
                out_dir: str, quick: bool) -> dict:
    """Play everything on an already running server (no memory figure, no agreement)."""
    url = url.rstrip("/").removesuffix("/v1")
    watch = Stopwatch()
    model = served_model(url)
    meta = _meta(f"url {url}", model, work.plan, quick)
    progress = Progress(work.turns)
    try:
        played = _play_workloads(url, model, work, progress, name, out_dir, "url", None)
    finally:
        progress.close()
    run = ConfigRun(name, None, {"url": url}, **played)
    _dump_turns(out_dir, "url", run)
    return _finish(meta, watch, dataset_config, work, [run], None, out_dir)
