"""The sweep figure: output tokens/s against p99 TTFT and against p99 TPOT, one point per
request rate (labelled), the knee (clients/bench/knee.py) marked. matplotlib, Agg backend:
no display needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clients.bench.runner import rate_value


def plot_sweep(
    runs: list[dict[str, Any]], knee: dict[str, Any], path: Path, title: str = ""
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(runs, key=rate_value)
    tput = [r["summary"]["output_throughput"] for r in ordered]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for ax, metric, name in ((axes[0], "ttft_ms", "p99 TTFT (ms)"),
                             (axes[1], "tpot_ms", "p99 TPOT (ms)")):
        xs = [r["summary"][metric]["p99"] for r in ordered]
        pts = [(x, y, r) for x, y, r in zip(xs, tput, ordered, strict=True) if x is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color="tab:blue")
        for x, y, r in pts:
            ax.annotate(f"{r['request_rate']} req/s", (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
            if r["request_rate"] == knee.get("request_rate"):
                what = "knee" if knee.get("reached") else "highest rate, knee not reached"
                ax.plot([x], [y], "*", color="tab:red", markersize=16,
                        label=f"{what} ({knee['factor']:g}x low-load p99 TTFT)")
        ax.set_xlabel(name)
        ax.set_ylabel("output tokens/s")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
