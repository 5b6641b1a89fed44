"""bfloat16 or float32 on this CPU: prefill and decode speed of stock sglang and sgl_spec
exact in both dtypes, in one run (the measurement behind the CPU default dtype).

    python -m sgl_spec.bench.dtype --out results/dtype [--rounds 2]

Rows: stock and sgl_spec exact, each with ``--dtype bfloat16`` and ``--dtype float32``
(nothing else differs), started ``--rounds`` times, interleaved. Per start: the TTFT of
fresh prompts of each ``--lengths`` (``prefill_sweep.measure``: the cache flushed before
every prompt) as prefill tokens per second, and the decode tokens per second of a batch-1
request over each ``--histories`` (``decode_sweep.measure``: the prompt cached first).
The table gives each row's medians and, per launcher, float32 against bfloat16 with the
spread over starts; ``sgl_spec.dtypes.cpu_default`` is the rule the launcher applies.
Writes results.json, results.md. Run it alone on the machine.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

from sgl_spec.bench import cli, decode_sweep, plots, prefill_sweep, sweep, timing
from sgl_spec.bench.configset import ServerConfig
from sgl_spec.bench.render import num, spread_cell, table

DTYPES = ("bfloat16", "float32")
LAUNCHERS = (("stock", "stock", ()), ("sgl_spec exact", "sgl_spec", ("--spec-mode", "exact")))
CONFIGS: tuple[ServerConfig, ...] = tuple(
    ServerConfig(f"{name} {dt}", launcher, (*flags, "--dtype", dt))
    for dt in DTYPES for name, launcher, flags in LAUNCHERS)
PNG = "dtype.png"


@dataclass(frozen=True)
class Plan:
    lengths: tuple[int, ...] = (1024, 4096)  # fresh prompt tokens (prefill)
    histories: tuple[int, ...] = (512, 4096)  # cached tokens under a decode
    new_tokens: int = 64
    repeats: int = 2
    rounds: int = 1

    def __post_init__(self) -> None:
        if min(self.lengths) < 16 or min(self.histories) < 16:
            raise ValueError(f"--lengths and --histories must be >= 16 tokens, got "
                             f"{self.lengths} and {self.histories}")
        if self.repeats < 1 or self.rounds < 1:
            raise ValueError(f"--repeats and --rounds must be >= 1, got {self.repeats}, "
                             f"{self.rounds}")

    def prefill(self) -> prefill_sweep.SweepPlan:
        return prefill_sweep.SweepPlan(lengths=self.lengths, repeats=self.repeats,
                                       rounds=self.rounds)

    def decode(self) -> decode_sweep.SweepPlan:
        return decode_sweep.SweepPlan(histories=self.histories, batches=(1,),
                                      new_tokens=self.new_tokens, repeats=self.repeats,
                                      starts=self.rounds)


def build_prompts(tokenizer, plan: Plan) -> dict:
    return {"prefill": prefill_sweep.build_prompts(tokenizer, plan.prefill()),
            "decode": decode_sweep.build_prompts(tokenizer, plan.decode())}


def run_config(cfg: ServerConfig, model: str, prompts: dict, plan: Plan, out_dir: str,
               bar, round_index: int) -> dict:
    with sweep.row_server(cfg, model, out_dir, round_index, plan.rounds) as (server, record):
        points = {}
        for n in plan.lengths:
            bar.set_description(f"{cfg.name}: prefill {n}")
            p = prefill_sweep.measure(server.url, prompts["prefill"][n])
            points[f"prefill {n}"] = {"tok_s": n / p["ttft_median_s"], **p}
            bar.update(1)
        for h in plan.histories:
            bar.set_description(f"{cfg.name}: decode over {h}")
            d = decode_sweep.measure(server.url, prompts["decode"][h], plan.decode())
            points[f"decode {h}"] = {"tok_s": d["tok_s_median"], **d}
            bar.update(1)
        record["points"] = points
    return record


def pool_starts(runs: list[dict]) -> dict:
    return sweep.pool(runs, lambda per: {"tok_s": timing.median(p["tok_s"] for p in per),
                                         "start_tok_s": [p["tok_s"] for p in per]})


def results(meta: dict, plan: Plan, runs: dict[str, list[dict]]) -> dict:
    rows = [pool_starts(r) for r in runs.values()]
    fp32_vs_bf16 = {}
    for name, _, _ in LAUNCHERS:
        by = {r["name"]: r["points"] for r in rows}
        bf, fp = by.get(f"{name} bfloat16"), by.get(f"{name} float32")
        if bf and fp:
            fp32_vs_bf16[name] = {
                k: timing.ratio_spread(fp[k]["start_tok_s"], bf[k]["start_tok_s"]) for k in bf}
    return {"meta": meta, "plan": asdict(plan), "configs": rows,
            "float32_vs_bfloat16": fp32_vs_bf16}


def markdown(res: dict) -> str:
    rows = res["configs"]
    keys = list(rows[0]["points"])
    lines = ["# Prefill and decode tokens per second, bfloat16 and float32", "",
             "Medians over every start's repeats; prefill: fresh prompts of N tokens "
             "(N / TTFT); decode: a batch-1 request over H cached tokens.", "",
             *table(["row", *keys], [[r["name"], *(num(r["points"][k]["tok_s"]) for k in keys)]
                                     for r in rows]), ""]
    ratios = res["float32_vs_bfloat16"]
    if ratios:
        lines += ["## float32 / bfloat16 tokens per second, per start (min / median / max)",
                  "", *table(["launcher", *keys],
                             [[name, *(spread_cell(_spread(r[k])) for k in keys)]
                              for name, r in ratios.items()]), ""]
    return "\n".join(lines) + "\n"


def _spread(v) -> timing.Spread | None:
    return None if v is None else timing.Spread(*v)  # a JSON list after a round trip


def plot(res: dict, path: str) -> str:
    """Tokens per second per point, a bar per row."""
    plt = plots.pyplot()
    rows = res["configs"]
    keys = list(rows[0]["points"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        ax.bar([k + i * width for k in range(len(keys))],
               [r["points"][k]["tok_s"] or 0 for k in keys], width, label=r["name"])
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], keys)
    ax.set(ylabel="tokens / s", title="bfloat16 and float32 on this CPU")
    plots.finish_axes(ax)
    return plots.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    cli.setup_logging()
    ap = cli.parser("python -m sgl_spec.bench.dtype", __doc__)
    cli.add_common(ap, repeats=cli.REPEATS_HELP, repeats_default=2, rounds=cli.ROUNDS_HELP,
                   rounds_default=1)
    ap.add_argument("--lengths", type=int, nargs="+", metavar="N", default=[1024, 4096],
                    help="fresh prompt lengths timed for prefill (default 1024 4096)")
    ap.add_argument("--histories", type=int, nargs="+", metavar="H", default=[512, 4096],
                    help="cached tokens under the timed decode (default 512 4096)")
    ap.add_argument("--new-tokens", type=int, default=64, metavar="N",
                    help="tokens per timed decode (default 64)")
    args = ap.parse_args(argv)
    try:
        plan = Plan(tuple(args.lengths), tuple(args.histories), args.new_tokens, args.repeats,
                    args.rounds)
    except ValueError as exc:
        ap.error(str(exc))
    args.quick = False
    tokens = max(max(plan.lengths), max(plan.histories) + plan.new_tokens) + 1
    return sweep.run(sys.modules[__name__], ap, args, plan, CONFIGS, plan.rounds,
                     len(plan.lengths) + len(plan.histories), tokens)


if __name__ == "__main__":
    raise SystemExit(main())
