"""A PNG of one benchmark run: CDFs of TTFT, TPOT and ITL, and output throughput over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stoker.tools.bench.metrics import bin_widths


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _cdf(ax: Any, values_ms: Sequence[float], title: str) -> None:
    xs = np.sort(np.asarray(values_ms, dtype=np.float64))
    if xs.size:
        ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post")
        for p, style in ((50, ":"), (99, "--")):
            ax.axvline(np.percentile(xs, p), color="gray", linestyle=style, label=f"p{p}")
        ax.legend(loc="lower right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(f"{title} CDF")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def plot_result(result: dict[str, Any], path: str | Path) -> None:
    """Write the figure for a result dict as written to --result-json (per-request arrays)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas on save

    fig = Figure(figsize=(11, 8))
    axes = fig.subplots(2, 2)
    ttfts = [t * 1000 for t, ok in zip(result["ttfts"], result["successes"]) if ok]
    tpots = [t * 1000 for t in result["tpots"] if t is not None]
    itls = [x * 1000 for gaps in result["itls"] for x in gaps]
    _cdf(axes[0][0], ttfts, "TTFT")
    _cdf(axes[0][1], tpots, "TPOT")
    _cdf(axes[1][0], itls, "ITL")
    ax = axes[1][1]
    timeline = result["output_throughput_timeline"]
    widths = bin_widths(result["duration"])
    ax.bar(np.arange(len(timeline)), timeline, width=widths, align="edge", alpha=0.7)
    ax.axhline(result["output_throughput"], color="red", linestyle="--", label="mean")
    ax.set_title("Output throughput (1 s bins)")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("tokens/s")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    rate = result["request_rate"]
    fig.suptitle(
        f"{result['model_id']} {result['endpoint']}: {result['completed']} ok, "
        f"{result['failed']} failed, rate {rate}, max concurrency {result['max_concurrency']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
