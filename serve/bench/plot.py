"""The `draftsmith bench` chart: speedup over no speculation against concurrency, one line per method.

matplotlib is optional (the `dev` extra), so it is imported only when a chart is drawn, and drawn through
the Agg canvas directly: no pyplot, no GUI backend, no global state touched in the caller's process.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.errors import DraftsmithError


def require_matplotlib():
    """The Figure class and Agg canvas, or a DraftsmithError naming what to install."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise DraftsmithError('the bench chart needs matplotlib: pip install matplotlib (or pip install -e ".[dev]"), '
                              "or pass --no-plot") from None
    return Figure, FigureCanvasAgg


def plot_speedups(rows: list[dict], levels: list[int], path: str | Path, exclude: tuple[str, ...] = ()) -> Path:
    """Writes a PNG with one subplot per model from `draftsmith bench` rows; `exclude` names the baseline
    rows (no speculation is the dashed line at 1.0 itself)."""
    figure_class, agg_canvas = require_matplotlib()
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig = figure_class(figsize=(5.5 * len(models), 4.2), layout="constrained")
    agg_canvas(fig)
    for ax, model in zip(fig.subplots(1, len(models), squeeze=False)[0], models):
        lines: dict[str, list[dict]] = {}
        for row in rows:
            if row["model"] == model and row["method"] not in exclude:
                lines.setdefault(f"{row['method']} (k={row['k']})", []).append(row)
        for label, points in lines.items():
            points.sort(key=lambda r: r["concurrency"])
            ax.plot([r["concurrency"] for r in points], [r["speedup_vs_no_spec"] for r in points],
                    marker="o", label=label)
        ax.axhline(1.0, linestyle="--", color="gray", linewidth=1, label="no speculation")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()  # log-scale minor ticks would label levels that were not run
        ax.set_title(model)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("speedup vs no speculation (tokens/s ratio)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
