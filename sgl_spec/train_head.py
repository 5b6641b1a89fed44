"""``python -m sgl_spec.train_head``: train SpeContext's retrieval head for a model.

Fits a head to the target's own attention on this machine's CPU (objective and steps:
:mod:`sgl_spec.head.train`), from local text only, and saves it in the EAGLE-3 draft
layout, so ``--spec-draft-path`` takes it like a real draft. Its last output line is
the head's directory. Without ``--out`` the head goes to the cache dir, keyed by the
model and the training settings, and a second call reuses it: this is what
``python -m sgl_spec.launch_server --spec-mode specontext`` does when no
``--spec-draft-path`` is given.

    python -m sgl_spec.train_head                       # the default model, ~10 min
    python -m sgl_spec.train_head --model-path DIR --sequences 24 --max-tokens 12288
    python -m sgl_spec.train_head --quick --out /tmp/head    # ~1 min (tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from sgl_spec import envs
from sgl_spec.head.train import TrainConfig

_MARKER = "sgl_spec_head.json"
_FORMAT = 1  # bump when training changes what a prepared head is


def head_dir(model_path: str, tc: TrainConfig, cache_dir: str | None = None) -> str:
    """Where the head of ``model_path`` trained with ``tc`` is kept."""
    key = [_FORMAT, os.path.abspath(model_path), dataclasses.asdict(tc)]
    return envs.keyed_path("heads", model_path, key, root=cache_dir)


def is_prepared(path: str) -> bool:
    return os.path.exists(os.path.join(path, _MARKER))


def default_config(model_path: str) -> TrainConfig:
    """``TrainConfig.for_window`` of the model's context window."""
    with open(os.path.join(model_path, "config.json")) as f:
        return TrainConfig.for_window(json.load(f).get("max_position_embeddings", 2048))


def prepare(model_path: str, tc: TrainConfig | None = None, out: str | None = None,
            force: bool = False) -> str:
    """Train (once) and return the head's directory."""
    from sgl_spec.head.train import train
    from sgl_spec.prepare_model import build_dir

    tc = tc or default_config(model_path)
    out = out or head_dir(model_path, tc)
    if is_prepared(out) and not force:
        return out

    def build(tmp: str) -> None:
        report = train(model_path, tmp, tc)
        with open(os.path.join(tmp, _MARKER), "w") as f:
            json.dump({"format": _FORMAT, **report}, f, indent=2)

    return build_dir(out, build)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog="python -m sgl_spec.train_head", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="HF model dir (default: sgl_spec's default model)")
    ap.add_argument("--out", help="output directory (default: the cache dir, reused)")
    ap.add_argument("--quick", action="store_true", help="a short run: " + str(
        dataclasses.asdict(TrainConfig.quick())))
    ap.add_argument("--force", action="store_true", help="train again over a prepared head")
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                        metavar="N", help=f"default: {getattr(defaults, f.name)} (a 16k+ "
                        f"model: {getattr(TrainConfig.for_window(16384), f.name)})")
    args = ap.parse_args(argv)
    model = args.model_path
    if model is None:
        from sgl_spec.prepare_model import prepare as prepare_model

        model = prepare_model()
    if not os.path.isdir(model):
        ap.error(f"--model-path {model!r} is not a directory")
    base = TrainConfig.quick() if args.quick else default_config(model)
    try:
        tc = dataclasses.replace(base, **{f.name: getattr(args, f.name)
                                          for f in dataclasses.fields(TrainConfig)
                                          if getattr(args, f.name) is not None})
    except ValueError as exc:
        ap.error(str(exc))
    print(prepare(model, tc, args.out, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
