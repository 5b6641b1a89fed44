"""``python -m sgl_spec.calibrate strategy [--model-path DIR] [--out FILE] [--quick] [--force]``

Measures the model's attention statistics on local text (``sgl_spec.krul.calibrate``),
prints each layer's initial/recent share and the layer pairs Algorithm 1 takes at the
given ``--spec-krul-gamma`` / ``--spec-krul-ratio``; the last line is the statistics
file, which ``--spec-krul`` servers read (and prepare themselves when missing).
"""

from __future__ import annotations

import argparse
import logging
import sys

from sgl_spec.config import KrulConfig


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog="python -m sgl_spec.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True, metavar="{strategy}")
    sp = sub.add_parser("strategy", help="Krul's attention statistics and layer pairs")
    sp.add_argument("--model-path", help="HF model dir (default: sgl_spec's default model)")
    sp.add_argument("--force", action="store_true", help="measure again over a saved file")
    sp.add_argument("--out", help="output file (default: the cache dir, reused)")
    sp.add_argument("--quick", action="store_true", help="two short sequences (tests)")
    sp.add_argument("--spec-krul-gamma", type=float, default=KrulConfig.gamma, metavar="FLOAT")
    sp.add_argument("--spec-krul-ratio", type=float, default=KrulConfig.ratio, metavar="FLOAT")
    args = ap.parse_args(argv)
    try:
        kc = KrulConfig(gamma=args.spec_krul_gamma, ratio=args.spec_krul_ratio)
    except ValueError as exc:
        ap.error(str(exc))
    from sgl_spec.bench.cli import model_path

    model = model_path(ap, args.model_path)

    from sgl_spec.krul import calibrate
    from sgl_spec.krul.select import select_pairs

    cc = calibrate.CalibrationConfig.quick() if args.quick else calibrate.CalibrationConfig()
    path = calibrate.prepare(model, cc, force=args.force, out=args.out)
    sim = calibrate.load(path)
    ir, dist = sim.ir_share(), sim.distances()
    strat = select_pairs(ir, dist, gamma=kc.gamma, ratio=kc.ratio)
    print("layer  initial+recent share")
    for layer, share in enumerate(ir.tolist()):
        mark = " (input-sensitive)" if layer in strat.input_sensitive else ""
        print(f"{layer:5d}  {share:.3f}{mark}")
    print(f"pairs at gamma {kc.gamma}, ratio {kc.ratio}: "
          + ", ".join(f"({i},{j}) d={float(dist[i, j]):.4f}" for i, j in strat.pairs))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
