"""What the server sweeps share (``decode_sweep``, ``prefill_sweep``): rows, starts, records.

A sweep times a grid of points on a few server configurations (``configset.ServerConfig``
rows), one server at a time:

* ``--rows`` picks rows by slug (``add_rows``, ``select_rows``), always keeping the
  rows the ratios are taken against;
* ``--rounds R`` starts every row's server R times, interleaved (``run_rows``, over
  ``timing.interleaved``): a server process can run a few percent faster or slower
  than the next one of the same code, so one start per row cannot resolve a 5 %
  difference. ``pool`` merges a row's starts; ``start_ratios`` gives, per point, the
  spread of the per-start ratios against a baseline row's same start;
* ``row_server`` starts one row's server with the sweeps' flags and a per-start log,
  and fills the row's record (name, flags, start time, peak memory);
* ``run`` is a sweep's main after its flags are parsed: prompts, servers, then
  results.json, results.md and the plot.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Protocol

from sgl_spec.bench import cli, summary, timing
from sgl_spec.bench.configset import ServerConfig
from sgl_spec.bench.server import ServerProcess, ServerStartError

logger = logging.getLogger(__name__)

# After configset.COMMON_FLAGS: an idle scheduler sleeps, so the server being timed
# has the cores to itself between requests.
SWEEP_FLAGS: tuple[str, ...] = ("--sleep-on-idle",)


def select_rows(configs: Sequence[ServerConfig], slugs: Sequence[str] | None,
                keep: Sequence[str]) -> tuple[ServerConfig, ...]:
    """``--rows``: the rows whose slug is listed (all if None), in their order, always
    with the rows named in ``keep`` (the ratios' baselines). ValueError lists the
    valid slugs."""
    if not slugs:
        return tuple(configs)
    valid = [c.slug for c in configs]
    unknown = [s for s in slugs if s not in valid]
    if unknown:
        raise ValueError(f"unknown --rows {unknown}; valid choices: {valid}")
    return tuple(c for c in configs if c.name in keep or c.slug in slugs)


def add_rows(ap: argparse.ArgumentParser, configs: Sequence[ServerConfig],
             keep: Sequence[str]) -> None:
    ap.add_argument("--rows", nargs="+", metavar="SLUG",
                    help=f"time only these rows (and {' and '.join(keep)}); valid: "
                         + ", ".join(c.slug for c in configs))


def run_interleaved(rows: Sequence[ServerConfig], rounds: int,
                    run_one: Callable[[ServerConfig, int], dict]) -> dict[str, list[dict]]:
    """``run_one(row, round)`` for every row, interleaved ``rounds`` times;
    ``{row name: [one result per round]}``. A server that fails to start names its row."""
    def run(cfg: ServerConfig, i: int) -> dict:
        try:
            return run_one(cfg, i)
        except ServerStartError as exc:
            raise ServerStartError(f"configuration {cfg.name!r}: {exc}") from exc

    runs = timing.interleaved(list(rows), rounds, run)
    return {cfg.name: r for cfg, r in runs.items()}


def run_rows(rows: Sequence[ServerConfig], rounds: int, points: int,
             run_one: Callable[[ServerConfig, int, object], dict]) -> dict[str, list[dict]] | None:
    """``run_interleaved`` under one progress bar of ``points`` per row and start
    (``run_one(row, round, bar)`` updates it); None, after logging why, when a server
    did not come up."""
    from tqdm import tqdm

    with tqdm(total=rounds * len(rows) * points, unit="point", dynamic_ncols=True) as bar:
        try:
            return run_interleaved(rows, rounds, lambda cfg, i: run_one(cfg, i, bar))
        except ServerStartError as exc:
            logger.error("%s", exc)
            return None


@contextmanager
def row_server(cfg: ServerConfig, model: str, out_dir: str, round_index: int = 0,
               rounds: int = 1) -> Iterator[tuple[ServerProcess, dict]]:
    """Start ``cfg``'s server with ``SWEEP_FLAGS``; yields it and the row's record
    (name, config, module, args, log, start_s), which gets ``peak_rss_bytes`` on exit.
    The caller adds its ``points``."""
    os.makedirs(out_dir, exist_ok=True)
    args = [*cfg.server_args(model), *SWEEP_FLAGS]
    suffix = f"-round{round_index + 1}" if rounds > 1 else ""
    log = os.path.join(out_dir, f"server-{cfg.slug}{suffix}.log")
    watch = timing.Stopwatch()
    with ServerProcess(cfg.module, args, log_path=log) as server:
        record = {"name": cfg.name, "config": asdict(cfg), "module": cfg.module, "args": args,
                  "log": log, "start_s": watch.elapsed()}
        yield server, record
    record["peak_rss_bytes"] = server.peak_rss_bytes


def pool(runs: Sequence[dict], pool_point: Callable[[list[dict]], dict]) -> dict:
    """One row's server starts (``row_server`` records, one per start) as one record:
    per point, ``pool_point`` of that point in every start."""
    points = {key: pool_point([r["points"][key] for r in runs]) for key in runs[0]["points"]}
    return {**runs[0], "logs": [r["log"] for r in runs], "points": points,
            "peak_rss_bytes": max(r.get("peak_rss_bytes") or 0 for r in runs)}


def point_ratios(points: dict[str, dict], base: dict[str, dict],
                 key: str) -> dict[str, float | None]:
    """Per point of ``points`` that ``base`` has too: ``points[k][key] / base[k][key]``
    (None where either is missing or the baseline is 0)."""
    return {k: summary.ratio(p.get(key), base[k].get(key))
            for k, p in points.items() if k in base}


def start_ratios(configs: Sequence[dict], baseline: str,
                 field: str) -> dict[str, dict[str, timing.Spread | None]]:
    """Per row other than ``baseline``, per point: the spread of ``row[field][i] /
    baseline[field][i]`` over the starts i (``field`` holds one value per start).
    Empty when the baseline row was not run."""
    by = {c["name"]: c["points"] for c in configs}
    if baseline not in by:
        return {}
    base = by[baseline]
    return {name: {k: timing.ratio_spread(p.get(field) or [], base[k].get(field) or [])
                   for k, p in pts.items() if k in base}
            for name, pts in by.items() if name != baseline}


class Sweep(Protocol):
    """What ``run`` needs of a sweep module (``decode_sweep``, ``prefill_sweep``)."""

    PNG: str

    def build_prompts(self, tokenizer, plan) -> dict: ...

    def run_config(self, cfg: ServerConfig, model: str, prompts: dict, plan, out_dir: str,
                   bar, round_index: int) -> dict: ...

    def results(self, meta: dict, plan, runs: dict[str, list[dict]]) -> dict: ...

    def markdown(self, res: dict) -> str: ...

    def plot(self, res: dict, path: str) -> str: ...


def run(bench: Sweep, ap: argparse.ArgumentParser, args: argparse.Namespace, plan,
        rows: Sequence[ServerConfig], rounds: int, points: int, tokens: int) -> int:
    """A sweep's main after its flags are parsed: the model (``tokens`` must fit its
    window), the prompts, every row's server ``rounds`` times, then results.json,
    results.md and the plot in ``args.out``; prints the table. The exit status."""
    from transformers import AutoTokenizer

    model = cli.model_path(ap, args.model_path, tokens)
    meta, watch = cli.start_meta(model, quick=args.quick, sweep_flags=list(SWEEP_FLAGS))
    prompts = bench.build_prompts(AutoTokenizer.from_pretrained(model), plan)
    runs = run_rows(rows, rounds, points, lambda cfg, i, bar: bench.run_config(
        cfg, model, prompts, plan, args.out, bar, i))
    if runs is None:
        return 1
    res = bench.results(cli.finish_meta(meta, watch), plan, runs)
    text = bench.markdown(res)
    cli.write_results(args.out, res, text)
    bench.plot(res, os.path.join(args.out, bench.PNG))
    print(text)
    return 0
