"""PNG plots of an evaluation run (matplotlib, Agg backend), from ``results.json``'s dict.

* ``accuracy.png``: exact match per configuration, one bar per query position;
* ``speed_vs_history.png``: median TTFT and TPOT against history length, one line
  per configuration.

``pyplot`` and ``save`` are what every benchmark's plot uses (the sweeps draw their
own figures with them).
"""

from __future__ import annotations

import os

from sgl_spec.bench.dataset import POSITIONS
from sgl_spec.bench.summary import bucket_order

ACCURACY_PNG = "accuracy.png"
SPEED_PNG = "speed_vs_history.png"


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_axes(*axes, ylim_zero: bool = True) -> None:
    """Grid, legend and a y axis from 0 on each of ``axes``."""
    for ax in axes:
        if ylim_zero:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")


def save(fig, path: str) -> str:
    """Lay out, write ``path`` (110 dpi) and close ``fig``; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def plot_accuracy(configs: list[dict], path: str) -> str:
    plt = pyplot()
    names = [c["name"] for c in configs]
    width = 0.8 / len(POSITIONS)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(names) + 2), 4))
    for i, pos in enumerate(POSITIONS):
        ys = [(c["accuracy"]["by_position"].get(pos) or {}).get("exact_match") or 0.0
              for c in configs]
        xs = [j + (i - (len(POSITIONS) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, ys, width, label=f"question at {pos}")
    ax.set_xticks(range(len(names)), names, rotation=15 if len(names) > 3 else 0)
    ax.set_ylim(0, 1.2)  # room for the legend above the bars
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    ax.set_ylabel("exact match")
    ax.set_title("Accuracy by query position")
    ax.legend(fontsize="small", loc="upper center", ncol=len(POSITIONS))
    return save(fig, path)


def plot_speed(configs: list[dict], path: str) -> str:
    plt = pyplot()
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(10, 4))
    order = bucket_order()
    for c in configs:
        rows = [c["speed_by_history"][b] for b in order if b in c["speed_by_history"]]
        xs = [r["prompt_tokens_median"] for r in rows]
        ax_ttft.plot(xs, [r["ttft_median_s"] * 1e3 for r in rows], marker="o", label=c["name"])
        tp = [(x, r["tpot_median_s"] * 1e3) for x, r in zip(xs, rows)
              if r["tpot_median_s"] is not None]
        ax_tpot.plot([x for x, _ in tp], [y for _, y in tp], marker="o", label=c["name"])
    for ax, title in ((ax_ttft, "TTFT (ms, median)"), (ax_tpot, "TPOT (ms, median)")):
        ax.set_xlabel("history length (prompt tokens, bucket median)")
        ax.set_title(title)
    finish_axes(ax_ttft, ax_tpot)
    return save(fig, path)


def write_plots(results: dict, out_dir: str) -> list[str]:
    """Both plots into ``out_dir``; returns their paths."""
    configs = results["configs"]
    return [plot_accuracy(configs, os.path.join(out_dir, ACCURACY_PNG)),
            plot_speed(configs, os.path.join(out_dir, SPEED_PNG))]
