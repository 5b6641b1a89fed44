"""Micro-benchmark: what sgl_spec's radix cache costs on the cache's own path.

Plays the same multi-turn chat trace (the scheduler's calls per request: match
the prompt, insert prompt + answer) through stock sglang's UnifiedRadixCache with
its default tree core (compiled, Rust) and with its Python tree core, sgl_spec's
cache with default flags (sglang's compiled core, recording token ids for the
on-demand summary) and with ``--spec-cache-eviction turn`` (the turn-tagged Python
core, which cuts and tags turns at insert), interleaved in one run. Token ids follow
the default model's ChatML format (openers, end marker); contents are random ids.

    python -m sgl_spec.bench.cache_overhead --out results/cache-overhead

writes ``results.json`` and ``results.md``: median microseconds per request and
the ratios against both stock cores.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from sgl_spec.cache.turn_format import TurnFormat
from sgl_spec.config import CacheConfig, SpecConfig

# The default model's ChatML ids (sgl_spec.cache.turn_format.derive on
# SmolLM2-135M-Instruct): <|im_start|>=1, <|im_end|>=2, "\n"=198.
CHATML = TurnFormat(
    openers=(("system", (1, 9690)), ("user", (1, 4093)),
             ("assistant", (1, 520, 9531)), ("tool", (1, 19324))),
    end=(2,),
)
# (name, kind, stock tree core, sgl_spec config)
CONFIGS = (
    ("stock (rust core)", "stock", None, None),
    ("stock (python core)", "stock", "python", None),
    ("sgl_spec", "spec", None, SpecConfig()),
    ("sgl_spec --spec-cache-eviction turn", "spec", None,
     SpecConfig(cache=CacheConfig(eviction="turn"))),
)


def trace(conversations: int, turns: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) per request, conversations interleaved round-robin."""
    rng = random.Random(seed)
    systems = [[1, 9690, 198] + [rng.randrange(100, 49000) for _ in range(120)] + [2, 198]
               for _ in range(3)]
    histories = [list(rng.choice(systems)) for _ in range(conversations)]
    out = []
    for _ in range(turns):
        for h in histories:
            user = [1, 4093, 198] + [rng.randrange(100, 49000)
                                     for _ in range(rng.randrange(40, 400))] + [2, 198]
            prompt = h + user + [1, 520, 9531, 198]
            answer = [rng.randrange(100, 49000) for _ in range(rng.randrange(20, 200))] + [2]
            out.append((prompt, answer))
            h.extend(user + [1, 520, 9531, 198] + answer + [198])
    return out


def play(cache, alloc, requests) -> float:
    """Seconds spent in the cache for the whole trace."""
    import torch

    from sgl_spec.integration.standalone import InsertParams, MatchPrefixParams, radix_key

    spent = 0.0
    for prompt, answer in requests:
        full = prompt + answer
        match_params = MatchPrefixParams(key=radix_key(prompt))
        t0 = time.perf_counter()
        m = cache.match_prefix(match_params)
        spent += time.perf_counter() - t0
        prefix = cache.path_device_indices(m.last_device_node)[: m.device_prefix_len]
        value = torch.cat([prefix.to(torch.int64), alloc.alloc(len(full) - len(prefix))])
        # As sglang's checkpoint_into_tree: the matched prefix is protected.
        insert_params = InsertParams(key=radix_key(full), value=value,
                                     prev_prefix_len=len(prefix))
        t0 = time.perf_counter()
        cache.insert(insert_params)
        spent += time.perf_counter() - t0
    return spent


def run(conversations: int, turns: int, repeats: int, seed: int) -> dict:
    requests = trace(conversations, turns, seed)
    tokens = sum(len(p) + len(a) for p, a in requests)
    from sgl_spec.integration.standalone import build_cache

    caches = {name: build_cache(kind, tokens + 1024, fmt=CHATML, cfg=cfg, tree_core=core)
              for name, kind, core, cfg in CONFIGS}
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in tqdm(range(repeats), desc="cache micro-benchmark", unit="round"):
        for name, (cache, alloc) in caches.items():  # interleaved: same conditions
            cache.reset()
            alloc.clear()
            times[name].append(play(cache, alloc, requests))
    us = {name: statistics.median(t) / len(requests) * 1e6 for name, t in times.items()}
    return {
        "requests": len(requests),
        "tokens": tokens,
        "repeats": repeats,
        "median_us_per_request": us,
        "ratio_vs_stock_rust": {n: us[n] / us["stock (rust core)"] for n in us},
        "ratio_vs_stock_python": {n: us[n] / us["stock (python core)"] for n in us},
    }


def table(res: dict) -> str:
    base = res["median_us_per_request"]["stock (rust core)"]
    lines = [
        f"Radix cache alone: {res['requests']} requests (match + insert), "
        f"{res['tokens']} tokens, median of {res['repeats']} interleaved rounds.",
        "",
        "| cache | µs / request | vs stock (rust core) | vs stock (python core) |",
        "|---|---|---|---|",
    ]
    py = res["median_us_per_request"]["stock (python core)"]
    for name, us in res["median_us_per_request"].items():
        lines.append(f"| {name} | {us:.1f} | {us / base:.3f}x | {us / py:.3f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sgl_spec.bench.cache_overhead",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/cache-overhead", help="Output directory.")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for flag in ("conversations", "turns", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1")
    res = run(args.conversations, args.turns, args.repeats, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2))
    (out / "results.md").write_text(table(res))
    print(table(res))


if __name__ == "__main__":
    main()
