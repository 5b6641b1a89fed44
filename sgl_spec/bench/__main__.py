"""``python -m sgl_spec.bench``: the evaluation harness (accuracy, agreement, speed).

Side by side (default): start each configuration's server of ``--configs`` in turn
(default: ``configs/baseline.toml``, stock sglang and sgl_spec exact), play the plan's
workloads on it (multi-turn QA dataset, long generations, speed chats, optionally
``sglang.bench_serving``; see ``runner``), stop it; then write results.json,
results.md and PNG plots. Or ``--url``: play the same on a running
OpenAI-compatible server.

What is played is the set's ``[plan]`` if it has one, else the default plan;
``--quick`` plays the quick plan (everything, small) whatever the set says::

    python -m sgl_spec.bench --out results/eval-baseline        # stock vs exact, full
    python -m sgl_spec.bench --quick --out /tmp/evalq            # ~4 min
    python -m sgl_spec.bench --configs sgl_spec/bench/configs/sparse-decode.toml --out DIR
    python -m sgl_spec.bench --url http://127.0.0.1:30000 --concurrency 2

A long set can be played over several sittings: ``--rows A`` now and ``--rows B
--resume`` later into the same ``--out`` reads back the rows already played on the
same inputs (the first row too) and writes one report over all of them. A row that
was interrupted resumes after its finished QA conversations (``journal``).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time
from dataclasses import replace

from sgl_spec.bench import cli, configset, dataset, plan as run_plan, runner
from sgl_spec.bench.server import ServerStartError

logger = logging.getLogger("sgl_spec.bench")


def build_parser():
    p = cli.parser("python -m sgl_spec.bench", None)
    p.description = (
        "Evaluation harness: multi-turn QA accuracy by query position and question "
        "source, greedy agreement with exact attention, and speed (TTFT, TPOT, tok/s, "
        "cached tokens, peak memory; follow-up turns over a cached document, growing "
        "context and sglang.bench_serving against the first row), for every server "
        "configuration of a configuration file, side by side in one run. On 2 CPU cores "
        "the quick plan takes ~2 min a configuration; a configuration set's [plan] "
        "table chooses what is played.")
    p.add_argument("--configs", metavar="FILE",
                   help="TOML configuration set (default: the built-in baseline, "
                   f"{configset.DEFAULT_PATH}); with --url only its [plan] is used")
    p.add_argument("--url", metavar="URL",
                   help="play on this running OpenAI-compatible server instead of starting "
                   "servers (e.g. http://127.0.0.1:30000)")
    p.add_argument("--name", default="server",
                   help="the row's name in --url mode (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=1, metavar="N",
                   help="conversations in flight at once; turns of one conversation stay "
                   "sequential (default: %(default)s; >1 makes timings and greedy "
                   "agreement depend on batching)")
    p.add_argument("--rows", nargs="+", metavar="NAME",
                   help="play only these rows of --configs, besides its first row (the "
                   "speed baseline) and its reference row")
    p.add_argument("--server-flags", default="", metavar="'FLAGS'",
                   help="sglang/sgl_spec flags appended to every row's, one string (e.g. "
                   "--server-flags='--dtype float32': a CPU without AVX512-BF16 runs bf16 "
                   "GEMMs ~4.5x slower than float32); part of each row's --resume fingerprint")
    p.add_argument("--resume", action="store_true",
                   help="reuse the rows an earlier run with the same --out, inputs and "
                   "flags left (turns-<row>.json) instead of playing them again; the "
                   "report says when each reused row was played. A row interrupted "
                   "mid-way plays only the QA conversations its journal-<row>.jsonl lacks")
    p.add_argument("--conversations", nargs="+", metavar="NAME",
                   help="play only these conversations of the dataset (by name, e.g. qa-0-0; "
                   "dataset.jsonl in --out lists them): a same-machine timing of a few rows "
                   "over part of a long preset")
    p.add_argument("--dataset", metavar="JSONL",
                   help="play this saved dataset (dataset.to_jsonl) instead of generating one")
    p.add_argument("--seed", type=int, metavar="N",
                   help="draw the plan's dataset preset with this seed (default: the "
                   "preset's, 0): other conversations of the same shapes, named qa-N-*. "
                   "A gap of a few points needs more questions than one preset holds: play "
                   "several seeds into their own --out and pool them with "
                   "python -m sgl_spec.bench.pool")
    cli.add_common(p, out_required=False,
                   out="output directory (default: results/<YYYYMMDD-HHMMSS>-<set name>)",
                   quick="the quick plan: small dataset, a 256-token long generation, small "
                   "speed chats and serving run (~2 min a configuration); overrides the "
                   "configuration set's [plan], except that a set whose dataset has a "
                   "quick form (long-context) plays that")
    return p


def _out_dir(out: str | None, set_name: str) -> str:
    if out:
        return os.path.abspath(out)
    slug = "".join(c if c.isalnum() or c in "._-" else "-" for c in set_name)
    return os.path.abspath(os.path.join("results", f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}"))


def _write_inputs(out_dir: str, convs, work: runner.Workloads) -> None:
    """What every row is asked, for reproduction: dataset.jsonl, longgen.json, chats.json."""
    dataset.to_jsonl(convs, os.path.join(out_dir, "dataset.jsonl"))
    with open(os.path.join(out_dir, "longgen.json"), "w") as f:
        json.dump([{"name": it.conversation.name, "user_turns": it.conversation.user_turns,
                    "max_tokens": it.max_tokens, "ignore_eos": it.ignore_eos}
                   for it in work.longgen], f, indent=1)
    with open(os.path.join(out_dir, "chats.json"), "w") as f:
        json.dump({name: [{"name": it.conversation.name,
                           "user_turns": it.conversation.user_turns,
                           "max_tokens": it.max_tokens} for it in items]
                   for name, items in work.chats.items()}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    cli.setup_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.resume and args.url:
        parser.error("--resume reads back rows of earlier side-by-side runs; with --url "
                     "there is one row, played now: drop one of them")
    try:
        sets = None if args.url else configset.load(args.configs or configset.DEFAULT_PATH)
        if sets is not None and args.rows:
            sets = sets.only(args.rows)
        if args.server_flags:
            if args.url:
                raise ValueError("--server-flags are given to the servers the harness "
                                 "starts; with --url the server is already running")
            sets = sets.with_flags(shlex.split(args.server_flags))
        set_plan = (sets.plan if sets else
                    configset.load(args.configs).plan if args.configs else None)
        plan = run_plan.choose(set_plan, args.quick, args.concurrency)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))

    model = cli.model_path(parser, args.model_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset_config = dataset.DatasetConfig.preset(plan.dataset)
    if args.seed is not None:
        if args.dataset:
            parser.error("--seed draws a preset's dataset; --dataset plays a saved one: "
                         "drop one of them")
        if args.seed < 0:
            parser.error(f"--seed must be >= 0, got {args.seed}")
        dataset_config = replace(dataset_config, seed=args.seed)
    if args.dataset:  # the preset still sets the answer budget
        convs = dataset.from_jsonl(args.dataset)
        logger.info("playing %s; answers up to %d tokens", args.dataset,
                    dataset_config.max_tokens)
    else:
        convs = dataset.generate(dataset_config, tokenizer)
    if args.conversations:
        names = [c.name for c in convs]
        unknown = [n for n in args.conversations if n not in names]
        if unknown:
            parser.error(f"--conversations: unknown {', '.join(unknown)}; valid: "
                         f"{names[0]} .. {names[-1]} ({len(names)} conversations)")
        convs = [c for c in convs if c.name in set(args.conversations)]
    # Rendered once, offline: every row is asked the same.
    work = runner.Workloads(plan, convs, dataset_config.max_tokens,
                            plan.longgen_items(tokenizer), plan.chat_items(tokenizer))
    out_dir = _out_dir(args.out, "url" if args.url else sets.name)
    os.makedirs(out_dir, exist_ok=True)
    _write_inputs(out_dir, convs, work)
    logger.info("dataset: %s", dataset.stats(convs))
    logger.info("writing to %s", out_dir)

    try:
        if args.url:
            results = runner.against_url(args.url, args.name, dataset_config, work, out_dir,
                                         args.quick)
        else:
            results = runner.side_by_side(sets, model, dataset_config, work, out_dir,
                                          args.quick, args.resume)
    except (ServerStartError, runner.ConfigRunError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    from sgl_spec.bench import tables

    print(tables.markdown(results))
    print(f"results: {out_dir} ({results['meta']['duration_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
