"""``python -m sgl_spec.bench``: multi-turn accuracy by query position, and speed.

Side by side (default): start each configuration's server of ``--configs`` in turn
(default: stock sglang and sgl_spec exact), play the multi-turn QA dataset and the
long-generation prompts on it, stop it; then write results.json, results.md and
PNG plots. Or ``--url``: play the same on a running OpenAI-compatible server.

What is played is the set's ``[plan]`` if it has one, else the default plan;
``--quick`` plays the quick plan whatever the set says.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from sgl_spec.bench import configset, dataset, plan as run_plan, runner
from sgl_spec.bench.server import ServerStartError

logger = logging.getLogger("sgl_spec.bench")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sgl_spec.bench",
        description="Evaluation harness: multi-turn QA accuracy by query position and "
        "question source, greedy agreement with exact attention, and speed (TTFT, TPOT, "
        "tok/s, cached tokens, peak memory), for every server configuration of a "
        "configuration file, side by side in one run. On 2 CPU cores a configuration "
        "takes ~7 min with the default plan, ~2 min with --quick; a configuration "
        "set's [plan] table can choose its own.",
    )
    p.add_argument("--configs", metavar="FILE", default=configset.DEFAULT_PATH,
                   help="TOML configuration set (default: the built-in baseline, "
                   "%(default)s)")
    p.add_argument("--url", metavar="URL",
                   help="play on this running OpenAI-compatible server instead of starting "
                   "servers (e.g. http://127.0.0.1:30000)")
    p.add_argument("--name", default="server",
                   help="the row's name in --url mode (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="small dataset and a 256-token long generation (< 5 min); "
                   "overrides the configuration set's [plan]")
    p.add_argument("--concurrency", type=int, default=1, metavar="N",
                   help="conversations in flight at once; turns of one conversation stay "
                   "sequential (default: %(default)s; >1 makes timings and greedy "
                   "agreement depend on batching)")
    p.add_argument("--dataset", metavar="JSONL",
                   help="play this saved dataset (dataset.to_jsonl) instead of generating one")
    p.add_argument("--model-path", default=None,
                   help="HF model dir for the servers and the tokenizer (default: "
                   "sgl_spec's prepared default model)")
    p.add_argument("--out", metavar="DIR",
                   help="output directory (default: results/<YYYYMMDD-HHMMSS>-<set name>)")
    return p


def _out_dir(out: str | None, set_name: str) -> str:
    if out:
        return os.path.abspath(out)
    slug = "".join(c if c.isalnum() or c in "._-" else "-" for c in set_name)
    return os.path.abspath(os.path.join("results", f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}"))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "openai"):  # one line per request would break the bar
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        sets = None if args.url else configset.load(args.configs)
        plan = run_plan.choose(sets.plan if sets else None, args.quick, args.concurrency)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))

    model = args.model_path
    if model is None:
        from sgl_spec.prepare_model import prepare

        model = prepare()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset_config = dataset.DatasetConfig.preset(plan.dataset)
    if args.dataset:
        convs = dataset.from_jsonl(args.dataset)
    else:
        convs = dataset.generate(dataset_config, tokenizer)
    longgen_items = plan.longgen_items(tokenizer)  # rendered once, offline
    out_dir = _out_dir(args.out, "url" if args.url else sets.name)
    os.makedirs(out_dir, exist_ok=True)
    if args.dataset:  # the preset still sets the answer budget
        logger.info("playing %s; answers up to %d tokens", args.dataset,
                    dataset_config.max_tokens)
    dataset.to_jsonl(convs, os.path.join(out_dir, "dataset.jsonl"))
    with open(os.path.join(out_dir, "longgen.json"), "w") as f:
        json.dump([{"name": it.conversation.name, "user_turns": it.conversation.user_turns,
                    "max_tokens": it.max_tokens, "ignore_eos": it.ignore_eos}
                   for it in longgen_items], f, indent=1)
    logger.info("dataset: %s", dataset.stats(convs))
    logger.info("writing to %s", out_dir)

    try:
        if args.url:
            results = runner.against_url(args.url, args.name, plan, dataset_config, convs,
                                         longgen_items, out_dir, args.quick)
        else:
            results = runner.side_by_side(sets, model, plan, dataset_config, convs,
                                          longgen_items, out_dir, args.quick)
    except (ServerStartError, runner.ConfigRunError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    from sgl_spec.bench import tables

    print(tables.markdown(results))
    print(f"results: {out_dir} ({results['meta']['duration_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
