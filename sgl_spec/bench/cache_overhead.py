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
the ratios against both stock cores, with the spread of the per-round ratios (each
round plays every cache once, interleaved, so a slow stretch of the machine hits all).
"""

from __future__ import annotations

import random

from tqdm import tqdm

from sgl_spec.bench import cli, render, timing
from sgl_spec.cache.turn_format import TurnFormat
from sgl_spec.config import CacheConfig, SpecConfig

# The default model's ChatML ids (sgl_spec.cache.turn_format.derive on
# SmolLM2-135M-Instruct): <|im_start|>=1, <|im_end|>=2, "\n"=198.
CHATML = TurnFormat(
    openers=(("system", (1, 9690)), ("user", (1, 4093)),
             ("assistant", (1, 520, 9531)), ("tool", (1, 19324))),
    end=(2,),
)
RUST, PYTHON = "stock (rust core)", "stock (python core)"
# (name, kind, stock tree core, sgl_spec config)
CONFIGS = (
    (RUST, "stock", None, None),
    (PYTHON, "stock", "python", None),
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
        m, dt = timing.timed(lambda: cache.match_prefix(MatchPrefixParams(key=radix_key(prompt))))
        spent += dt
        prefix = cache.path_device_indices(m.last_device_node)[: m.device_prefix_len]
        value = torch.cat([prefix.to(torch.int64), alloc.alloc(len(full) - len(prefix))])
        # As sglang's checkpoint_into_tree: the matched prefix is protected.
        insert = InsertParams(key=radix_key(full), value=value, prev_prefix_len=len(prefix))
        spent += timing.timed(lambda: cache.insert(insert))[1]
    return spent


def run(conversations: int, turns: int, repeats: int, seed: int) -> dict:
    from sgl_spec.integration.standalone import build_cache

    requests = trace(conversations, turns, seed)
    tokens = sum(len(p) + len(a) for p, a in requests)
    caches = {name: build_cache(kind, tokens + 1024, fmt=CHATML, cfg=cfg, tree_core=core)
              for name, kind, core, cfg in CONFIGS}
    bar = tqdm(total=repeats * len(caches), desc="cache micro-benchmark", unit="trace")

    def one(name: str, _round: int) -> float:
        cache, alloc = caches[name]
        cache.reset()
        alloc.clear()
        bar.update()
        return play(cache, alloc, requests) / len(requests) * 1e6

    us = timing.interleaved(list(caches), repeats, one)  # name -> µs/request per round
    bar.close()
    base = {b: us[b] for b in (RUST, PYTHON)}
    return {
        "requests": len(requests),
        "tokens": tokens,
        "repeats": repeats,
        "us_per_request": us,
        "median_us_per_request": {n: timing.median(v) for n, v in us.items()},
        "ratio_vs_stock_rust": {n: timing.ratio_spread(v, base[RUST]) for n, v in us.items()},
        "ratio_vs_stock_python": {n: timing.ratio_spread(v, base[PYTHON])
                                  for n, v in us.items()},
    }


def table(res: dict) -> str:
    rows = []
    for name, us in res["median_us_per_request"].items():
        rust, py = res["ratio_vs_stock_rust"][name], res["ratio_vs_stock_python"][name]
        rows.append([name, render.num(us, digits=1), render.spread_cell(rust, 3),
                     render.spread_cell(py, 3)])
    head = (f"Radix cache alone: {res['requests']} requests (match + insert), "
            f"{res['tokens']} tokens, {res['repeats']} interleaved rounds. Ratios: min / "
            "median / max of the per-round ratios.")
    return "\n".join([head, "", *render.table(
        ["cache", "µs / request (median)", "vs stock (rust core)", "vs stock (python core)"],
        rows)]) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = cli.parser("python -m sgl_spec.bench.cache_overhead", __doc__)
    cli.add_common(ap, out_required=False, out_default="results/cache-overhead",
                   repeats="interleaved rounds (default 9)", repeats_default=9,
                   model_path=False)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for flag in ("conversations", "turns", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1")
    res = run(args.conversations, args.turns, args.repeats, args.seed)
    md = table(res)
    cli.write_results(args.out, res, md)
    print(md)


if __name__ == "__main__":
    main()
