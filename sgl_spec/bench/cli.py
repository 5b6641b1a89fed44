"""The command-line prologue and epilogue every benchmark shares.

Prologue: logging, a parser described by the module docstring, and the common flags
with one spelling and one meaning everywhere (``--out``, ``--model-path``, ``--quick``,
``--repeats``, ``--rounds``, ``--threads``; a server sweep's ``--rows`` is
``sweep.add_rows``). Epilogue: ``results.json`` and a readable ``results.md`` in the
output directory, and the run's provenance (``provenance.run_meta`` /
``finish_meta``)::

    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.decode_sweep", __doc__)
    cli.add_common(ap, quick="N=24 tokens, 1 repeat", repeats=cli.REPEATS_HELP)
    args = ap.parse_args(argv)
    model = cli.model_path(ap, args.model_path, tokens=8192)
    ...
    cli.write_results(args.out, res, markdown(res))
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from sgl_spec.bench import provenance
from sgl_spec.bench.timing import Stopwatch

REPEATS_HELP = "override the repeats (>= 1)"
ROUNDS_HELP = ("start every row's server R times, interleaved, and pool what they measure "
               "(default 1)")
# Client libraries that log one line per request (it would break the progress bar).
NOISY_LOGGERS: tuple[str, ...] = ("httpx", "openai")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A parser whose description is the first paragraph of ``doc`` (a module docstring)."""
    return argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n\n")[0])


def add_common(ap: argparse.ArgumentParser, *, out: str | None = "output directory",
               out_required: bool = True, out_metavar: str = "DIR",
               out_default: str | None = None, quick: str | None = None,
               repeats: str | None = None, repeats_default: int | None = None,
               rounds: str | None = None, rounds_default: int | None = None,
               threads: str | None = None, threads_default: int = 0,
               model_path: bool = True) -> None:
    """The shared flags; a flag whose help is None is not added."""
    if out is not None:
        ap.add_argument("--out", required=out_required, default=out_default,
                        metavar=out_metavar, help=out)
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=quick)
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats_default, metavar="R",
                        help=repeats)
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds_default, metavar="R", help=rounds)
    if threads is not None:
        ap.add_argument("--threads", type=int, default=threads_default, help=threads)
    if model_path:
        ap.add_argument("--model-path", default=None,
                        help="HF model dir (default: sgl_spec's prepared default model)")


def set_threads(n: int) -> None:
    """``--threads``: torch's CPU threads; 0 leaves torch's default."""
    if n:
        import torch

        torch.set_num_threads(n)


def model_path(ap: argparse.ArgumentParser, path: str | None, tokens: int | None = None) -> str:
    """``--model-path`` or the prepared default model; an argparse error (exit 2) when it
    is not a directory or ``tokens`` (prompt + new) exceed the model's window."""
    from sgl_spec.prepare_model import prepare

    model = path or prepare()
    if not os.path.isdir(model):
        ap.error(f"--model-path {model!r} is not a directory")
    if tokens is not None:
        from transformers import AutoConfig

        window = AutoConfig.from_pretrained(model).max_position_embeddings
        if tokens > window:
            ap.error(f"{tokens} tokens (prompt + new) exceed the model's {window}-token window")
    return model


def start_meta(model: str, **extra) -> tuple[dict, Stopwatch]:
    """The run's provenance at its start, and the watch ``finish_meta`` reads."""
    return provenance.run_meta(model, **extra), Stopwatch()


def finish_meta(meta: dict, watch: Stopwatch) -> dict:
    """Adds the run time and the load average at the end."""
    meta.update(duration_s=watch.elapsed(), load_average_after=provenance.load_average())
    return meta


def write_results(out_dir: str, results: dict, markdown: str) -> list[str]:
    """``results.json`` and ``results.md`` in ``out_dir`` (made if missing); their paths."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "results.json")
    md_path = os.path.join(out_dir, "results.md")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    with open(md_path, "w") as f:
        f.write(markdown)
    return [json_path, md_path]
