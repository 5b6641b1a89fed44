"""Calibrations for Krul (issue 17).

``python -m sgl_spec.calibrate strategy [--model-path DIR] [--out FILE] [--quick] [--force]``
measures the model's attention statistics on local text (``sgl_spec.krul.calibrate``),
prints each layer's initial/recent share and the layer pairs Algorithm 1 takes at the
given ``--spec-krul-gamma`` / ``--spec-krul-ratio``; the last line is the statistics
file, which ``--spec-krul`` servers read (and prepare themselves when missing).

``python -m sgl_spec.calibrate restore [--model-path DIR] [--device cuda] [--out FILE]``
measures what a restore costs on this hardware (``sgl_spec.krul.restore_cost``): a
prefill's seconds per token-layer, and each tier's seconds per loaded row; prints the
recompute share that balances them for a ``--tokens``-long conversation and the
restore time it predicts; the last line is the JSON profile.

``python -m sgl_spec.calibrate decode --spec-mode MODE [--spec-* decode flags]`` times
decode steps of sgl_spec's attention path, exact and the sparse mode, at a ladder of
history lengths on this host (``sgl_spec.attention.step_cost``), prints both and the
length from which the sparse step is faster, and writes a plot; the last line is the
JSON profile's path, which ``--spec-decode-profile`` servers read (shorter histories
decode exactly).

``python -m sgl_spec.calibrate watershed [--model-path DIR] [--quick] [--out FILE]``
measures the model's watershed layer L_w (Round Attention, Appendix B;
``sgl_spec.rounds.watershed``) on multi-round conversations from the bundled corpus:
per layer, the mean KL divergence of the last query token's round-level attention to
every later layer's; prints the curve and L_w, writes a plot; the last line is the JSON
profile (kept in the cache dir, where round mode reads it).
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
    sub = ap.add_subparsers(dest="what", required=True,
                            metavar="{strategy,restore,decode,watershed}")
    sp = sub.add_parser("strategy", help="Krul's attention statistics and layer pairs")
    sp.add_argument("--model-path", help="HF model dir (default: sgl_spec's default model)")
    sp.add_argument("--force", action="store_true", help="measure again over a saved file")
    sp.add_argument("--out", help="output file (default: the cache dir, reused)")
    sp.add_argument("--quick", action="store_true", help="two short sequences (tests)")
    sp.add_argument("--spec-krul-gamma", type=float, default=KrulConfig.gamma, metavar="FLOAT")
    sp.add_argument("--spec-krul-ratio", type=float, default=KrulConfig.ratio, metavar="FLOAT")
    rp = sub.add_parser("restore", help="Krul's restore costs: recompute vs load per tier")
    _restore_args(rp)
    dp = sub.add_parser("decode", help="where a sparse decode mode is faster than exact")
    _decode_args(dp)
    wp = sub.add_parser("watershed", help="Round Attention's watershed layer L_w")
    wp.add_argument("--model-path", help="HF model dir (default: sgl_spec's default model)")
    wp.add_argument("--quick", action="store_true", help="three short conversations (tests)")
    wp.add_argument("--force", action="store_true", help="measure again over a saved profile")
    wp.add_argument("--out", help="output JSON (default: the cache dir, reused)")
    args = ap.parse_args(argv)
    if args.what == "watershed":
        return _watershed(wp, args)
    if args.what == "restore":
        return _restore(ap, args)
    if args.what == "decode":
        return _decode(dp, args)
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


def _restore_args(rp: argparse.ArgumentParser) -> None:
    from sgl_spec.krul.codec import CODECS
    from sgl_spec.krul.restore_cost import TIERS

    rp.add_argument("--model-path", help="HF model dir (default: sgl_spec's default model)")
    rp.add_argument("--random-weights", action="store_true",
                    help="build the model from its config.json alone (the time is the same)")
    rp.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:1")
    rp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="the serving dtype (default bfloat16, sglang's for these models)")
    rp.add_argument("--tokens", type=int, default=4096, metavar="N",
                    help="conversation length to measure and split (default 4096)")
    rp.add_argument("--spec-krul-codec", default=KrulConfig.codec, choices=sorted(CODECS),
                    help=f"how the tier stores rows (default {KrulConfig.codec})")
    rp.add_argument("--tiers", nargs="+", default=list(TIERS), choices=TIERS, metavar="TIER",
                    help=f"tiers to measure; valid: {', '.join(TIERS)} (default all)")
    rp.add_argument("--repeats", type=int, default=3, metavar="R", help="timed runs (median)")
    rp.add_argument("--pipeline-share", type=float, metavar="S",
                    help="also time a host-tier restore that recomputes this share (0 < S "
                         "<= 1), serial against pipelined (--spec-krul-restore), with the "
                         "served pre-pass over transformers' layers (default: not timed)")
    rp.add_argument("--out", help="output JSON (default: restore-<model>-<device>.json here)")


def _restore(ap: argparse.ArgumentParser, args) -> int:
    import json
    import os

    import torch

    if args.tokens < 16 or args.repeats < 1:
        ap.error("--tokens must be >= 16 and --repeats >= 1")
    if args.pipeline_share is not None and not 0 < args.pipeline_share <= 1:
        ap.error(f"--pipeline-share {args.pipeline_share}: valid 0 < S <= 1")
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        ap.error(f"--device {args.device!r} is not available here; valid: cpu"
                 + (", cuda" if torch.cuda.is_available() else ""))
    if args.model_path and args.random_weights:
        if not os.path.isfile(os.path.join(args.model_path, "config.json")):
            ap.error(f"--model-path {args.model_path!r} has no config.json")
        model = args.model_path
    else:
        from sgl_spec.bench.cli import model_path

        model = model_path(ap, args.model_path)

    from sgl_spec.krul import restore_cost

    prof = restore_cost.profile(model, device=args.device, dtype=getattr(torch, args.dtype),
                                tokens=args.tokens, codec=args.spec_krul_codec,
                                tiers=tuple(args.tiers), repeats=args.repeats,
                                random_weights=args.random_weights,
                                pipeline_share=args.pipeline_share)
    n, L = prof["tokens"], prof["shape"]["num_layers"]
    print(f"{prof['hardware']} ({prof['device']}, {prof['dtype']}), {n} tokens x {L} layers, "
          f"codec {prof['codec']}")
    print(f"recompute: {prof['recompute_s'] * 1e6:.3f} us per token-layer "
          f"({prof['recompute_s'] * n * L:.3f} s for the whole history)"
          + (f"; the pre-pass's own (a full forward: {prof['forward_recompute_s'] * 1e6:.3f})"
             if "forward_recompute_s" in prof else ""))
    print("tier   load us/row   load-only s   best share   restore s (split)")
    for tier, t in prof["tiers"].items():
        print(f"{tier:5s}  {t['load_s'] * 1e6:11.4f}   {t['load_only_s']:11.3f}   "
              f"{t['share']:10.3f}   {t['split_s']:.3f}")
    p = prof.get("pipeline")
    if p:
        print(f"a host restore recomputing share {p['share']}: T_C {p['T_C_s'] * 1e3:.2f} ms, "
              f"T_L {p['T_L_s'] * 1e3:.2f} ms; serial {p['serial_s'] * 1e3:.2f} ms, pipelined "
              f"{p['pipelined_s'] * 1e3:.2f} ms = {p['pipelined_over_sum']:.2f}x (T_C + T_L) "
              f"(max(T_C, T_L) would be {p['max_over_sum']:.2f}x)")
        print(f"  the pipeline hid {prof['overlap']:.0%} of the shorter part; the shares "
              "above are for a pipelined restore at that overlap (a serial one recomputes "
              "only where a row's recompute is cheaper than its load)")
        if "pipelined_thread_s" in p:
            print(f"  the pre-pass launched from a worker thread: "
                  f"{p['pipelined_thread_s'] * 1e3:.2f} ms = "
                  f"{p['pipelined_thread_over_sum']:.2f}x (T_C + T_L)")
    out = args.out or f"restore-{os.path.basename(model.rstrip('/'))}-{prof['device']}.json"
    with open(out, "w") as f:
        json.dump(prof, f, indent=1)
    print(os.path.abspath(out))
    return 0


def _decode_args(dp: argparse.ArgumentParser) -> None:
    from sgl_spec.attention.step_cost import DTYPES, HISTORIES
    from sgl_spec.config import add_cli_args

    dp.add_argument("--model-path", help="HF model dir (default: sgl_spec's default model)")
    dp.add_argument("--histories", type=int, nargs="+", metavar="N",
                    help=f"history lengths in tokens (default: {' '.join(map(str, HISTORIES))}, "
                         "less those the budget, sink and window cover)")
    dp.add_argument("--batch", type=int, default=1, metavar="B",
                    help="requests decoding together (default 1)")
    dp.add_argument("--steps", type=int, default=32, metavar="N",
                    help="timed decode steps per point (default 32: two LoopServe "
                         "reselections at --spec-nd 16)")
    dp.add_argument("--repeats", type=int, default=3, metavar="R",
                    help="rounds, exact and sparse interleaved (median; default 3)")
    dp.add_argument("--threads", type=int, default=0, metavar="T",
                    help="torch threads (default: torch's, as the server's)")
    dp.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="the served model's --dtype, which the KV pool has (default: auto, "
                         "as sglang: the config's dtype if 16-bit, else float16); a profile "
                         "is read only by servers of the same KV dtype")
    dp.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu (default), or cuda: SpeContext's path as a GPU server runs it "
                         "(head, loads on a side stream, the Triton kernel; the other modes "
                         "decode through sglang's backend there)")
    dp.add_argument("--offload-layers", default="0", metavar="N",
                    help="also time SpeContext's step with the last N layers' KV on the host "
                         "(pinned on cuda), as --spec-offload places them, and the share of "
                         "their loads hidden behind compute; 'all': every layer but the "
                         "dense ones (default 0: no such row)")
    dp.add_argument("--trace", metavar="FILE",
                    help="also profile the sparse row's steps at the longest history "
                         "(torch.profiler) and write its table of ops by host time here")
    dp.add_argument("--quick", action="store_true",
                    help="histories 1536 and 3072, 4 steps, 1 round (tests)")
    dp.add_argument("--out", help="output JSON (default: decode-<model>-<mode>-B<budget>.json "
                                  "here)")
    add_cli_args(dp, sections=("decode",), skip=("--spec-min-context", "--spec-decode-profile"))


def _decode(dp: argparse.ArgumentParser, args) -> int:
    import json
    import os

    from sgl_spec.config import from_cli_args

    try:
        cfg = from_cli_args(args).decode
    except ValueError as exc:
        dp.error(str(exc))
    from sgl_spec.attention import step_cost

    if args.quick:
        args.histories, args.steps, args.repeats = [1536, 3072], 4, 1
    elif not args.histories:
        args.histories = list(step_cost.measurable(cfg)) or [max(step_cost.HISTORIES)]
    if min(args.histories) < 1 or args.batch < 1 or args.steps < 1 or args.repeats < 1 \
            or args.threads < 0:
        dp.error("--histories, --batch, --steps and --repeats must be >= 1, --threads >= 0")
    from sgl_spec.bench.cli import model_path

    try:  # the flags' own checks before a model or head is prepared
        step_cost.check(cfg, args.histories, args.device)
    except ValueError as exc:
        dp.error(str(exc))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        dp.error("--device cuda needs a CUDA GPU; valid here: cpu")
    offload = args.offload_layers
    if offload != "all":
        try:
            offload = int(offload)
        except ValueError:
            dp.error(f"--offload-layers {offload!r}: valid: an integer >= 0, or all")
        if offload < 0:
            dp.error(f"--offload-layers {offload}: valid: an integer >= 0, or all")
    if offload and not cfg.retrieval_head:
        dp.error(f"--offload-layers times SpeContext's offloaded step; --spec-mode {cfg.mode} "
                 "does not stage its rows; valid: specontext")
    model = model_path(dp, args.model_path)
    if offload == "all":
        with open(os.path.join(model, "config.json")) as f:
            offload = json.load(f)["num_hidden_layers"] - cfg.dense_layers
    if cfg.retrieval_head and not cfg.draft_path:
        import dataclasses

        from sgl_spec.train_head import prepare

        cfg = dataclasses.replace(cfg, draft_path=prepare(model))
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    dtype = step_cost.kv_dtype(args.dtype, None, config)
    try:
        prof = step_cost.profile(model, cfg, tuple(sorted(set(args.histories))),
                                 batch=args.batch, steps=args.steps, repeats=args.repeats,
                                 threads=args.threads or None, dtype=dtype, device=args.device,
                                 offload_layers=offload)
    except ValueError as exc:
        dp.error(str(exc))
    where = prof.get("gpu") or (f"{prof['hardware']} ({prof['cpus']} cpus, "
                                f"{prof['threads']} threads)")
    print(f"{where}, "
          f"{prof['shape']['num_layers']} layers, {dtype} KV, batch {prof['batch']}: "
          f"{cfg.mode} B={cfg.budget} against exact, ms per decode step (attention and plan)")
    print("history   exact ms   sparse ms   sparse/exact")
    for h, e, sp in zip(prof["histories"], prof["exact_s"], prof["sparse_s"]):
        print(f"{h:7d}   {e * 1e3:8.2f}   {sp * 1e3:9.2f}   {sp / e:12.2f}")
    if "offload_s" in prof:
        where = f"pinned, loads {prof['host_copy']}" if args.device == "cuda" else "host memory"
        print(f"with the last {len(prof['offload_layers'])} layers on the host ({where}):")
        print("history   offload ms   offload/sparse   offload/exact   host copies ms   hidden")
        for i, h in enumerate(prof["histories"]):
            o, sp, e = prof["offload_s"][i], prof["sparse_s"][i], prof["exact_s"][i]
            hid = prof["hidden_share"][i]
            print(f"{h:7d}   {o * 1e3:10.2f}   {o / sp:14.2f}   {o / e:13.2f}   "
                  f"{prof['host_copy_s'][i] * 1e3:14.2f}   "
                  f"{'-' if hid is None else f'{hid:.0%}':>6}")
    cross = prof["crossover"]
    print(f"{cfg.mode} is faster than exact from {cross} tokens" if cross is not None else
          f"{cfg.mode} was faster than exact at no measured history: a server given this "
          "profile decodes exactly")
    name = os.path.basename(model.rstrip("/"))
    out = args.out or f"decode-{name}-{cfg.mode}-B{cfg.budget}.json"
    with open(out, "w") as f:
        json.dump(prof, f, indent=1)
    print(f"plot: {_plot_decode(prof, os.path.splitext(out)[0] + '.png')}")
    if args.trace:
        table = step_cost.trace(model, cfg, max(prof["histories"]), batch=args.batch,
                                dtype=dtype, device=args.device)
        with open(args.trace, "w") as f:
            n = cfg.nd if cfg.mode == "loopserve" else 8
            f.write(f"{cfg.mode} B={cfg.budget}, {max(prof['histories'])} tokens x "
                    f"{args.batch}, {n} steps, {prof.get('gpu') or prof['hardware']}\n\n{table}")
        print(f"trace: {os.path.abspath(args.trace)}")
    print(os.path.abspath(out))
    return 0


def _plot_decode(prof: dict, path: str) -> str:
    """ms per step against history, exact and sparse (median, every round's range), and
    the crossover."""
    from sgl_spec.bench import plots

    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    h = prof["histories"]
    mode = f"{prof['decode']['mode']} B={prof['decode']['budget']}"
    rows = [("exact", prof["exact_s"], prof["exact_runs_s"]),
            (mode, prof["sparse_s"], prof["sparse_runs_s"])]
    if "offload_s" in prof:
        rows.append((f"{mode}, {len(prof['offload_layers'])} layers on the host",
                     prof["offload_s"], prof["offload_runs_s"]))
    for label, med, runs in rows:
        lo = [m * 1e3 - min(r) * 1e3 for m, r in zip(med, runs)]
        hi = [max(r) * 1e3 - m * 1e3 for m, r in zip(med, runs)]
        ax.errorbar(h, [m * 1e3 for m in med], yerr=[lo, hi], marker="o", capsize=3,
                    label=label)
    if prof["crossover"] is not None:
        ax.axvline(prof["crossover"], color="grey", ls="--", label="sparse from here")
    ax.set(xscale="log", xlabel="history (tokens)", ylabel="ms per decode step (attention + plan)",
           title=f"{prof.get('gpu') or prof['hardware']}, batch {prof['batch']}"
                 + ("" if prof.get("gpu") else f", {prof['threads']} threads"))
    plots.finish_axes(ax)
    return plots.save(fig, path)


def _watershed(wp: argparse.ArgumentParser, args) -> int:
    import os

    from sgl_spec.bench.cli import model_path
    from sgl_spec.rounds import watershed

    model = model_path(wp, args.model_path)
    wc = watershed.WatershedConfig.quick() if args.quick else watershed.WatershedConfig()
    try:
        path = watershed.prepare(model, wc, force=args.force, out=args.out)
        prof = watershed.load(path)
    except ValueError as exc:
        wp.error(str(exc))
    curve, lw, n = prof["curve"], prof["watershed"], prof["layers"]
    print(f"{os.path.basename(model.rstrip('/'))}: {len(prof['curves'])} conversations, "
          f"{min(prof['rounds'])}-{max(prof['rounds'])} earlier rounds, "
          f"{min(prof['tokens'])}-{max(prof['tokens'])} tokens")
    rec, kept = prof["recall"], prof["strategy_recall"]
    print("layer   mean KL to later   asked round in the top 10%   asked round kept by "
          "topk / fixed / adaptive: peak score (mass score)")
    for i in range(n):
        kl = f"{curve[i]:.4f}" if i < len(curve) else "-"
        by = "   ".join(f"{kept['peak'][s][i]:4.0%} ({kept['mass'][s][i]:4.0%})"
                       for s in ("topk", "fixed", "adaptive"))
        print(f"{i + 1:5d}   {kl:>16}   {rec[i]:>26.0%}   {by}"
              f"{'   <- L_w' if lw == i + 1 else ''}")
    print(f"L_w = {lw} of {n} layers (layers 1..L_w keep every round on the device)"
          if lw is not None else
          f"no significant local minimum in {n} layers: round mode serves this model exactly")
    print(f"plot: {_plot_watershed(prof, os.path.splitext(path)[0] + '.png')}")
    print(os.path.abspath(path))
    return 0


def _plot_watershed(prof: dict, path: str) -> str:
    """Mean KL to later layers against the layer (each conversation thin, the mean
    thick), L_w marked; the selection's recall per layer on a second axis."""
    import os

    from sgl_spec.bench import plots

    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    x = list(range(1, len(prof["curve"]) + 1))
    for c in prof["curves"]:
        ax.plot(x, c, color="0.8", lw=0.7)
    ax.plot(x, prof["curve"], marker="o", ms=3, label="mean")
    if prof["watershed"] is not None:
        ax.axvline(prof["watershed"], color="C3", ls="--", label=f"L_w = {prof['watershed']}")
    ax.set_xlabel("layer (1-based)")
    ax.set_ylabel("mean KL(P_layer || P_later)")
    ax.set_title(os.path.basename(prof["model"].rstrip("/")))
    r = ax.twinx()
    r.plot(range(1, len(prof["recall"]) + 1), prof["recall"], color="C2", marker="s", ms=3,
           lw=0.8, label="asked round in the top 10%")
    r.set_ylim(0, 1.05)
    r.set_ylabel("asked round in the top 10%", color="C2")
    lines = ax.get_legend_handles_labels()
    more = r.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8)
    plots.finish_axes(ax)
    return plots.save(fig, path)

if __name__ == "__main__":
    sys.exit(main())
