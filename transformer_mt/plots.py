"""Figures as PNG files: attention heatmaps (`tmt attention`), training curves (`tmt plot`), the report's chart.

matplotlib is optional (``pip install matplotlib``, or the ``plot`` extra):
it is imported only here, when a figure is drawn, and its absence is a
`PlotError` that says how to install it. Figures are built on
``matplotlib.figure.Figure`` directly, never through pyplot's global figure
state, and written whole or not at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from transformer_mt.errors import UserError
from transformer_mt.files import atomic_open
from transformer_mt.runs import Run

INSTALL = "pip install matplotlib (or: pip install -e '.[plot]')"


class PlotError(UserError):
    """A figure cannot be drawn: matplotlib is missing, or there is nothing to draw; the message says what to do."""


def require_matplotlib() -> None:
    """PlotError naming the install command when matplotlib is missing: checked before any slow work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError(f"drawing figures needs matplotlib, which is not installed: {INSTALL}") from None


def new_figure(width: float, height: float) -> Any:
    """A matplotlib Figure of that size in inches, not registered with pyplot; PlotError when matplotlib is missing."""
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def save_figure(fig: Any, out: Path) -> None:
    """Write ``fig`` as PNG to ``out`` (its directory created), whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(out, "wb") as f:
        fig.savefig(f, format="png", dpi=120)


# ---------------------------------------------------------------- attention heatmaps


@dataclass
class AttentionPanel:
    """One layer's attention of one sentence: (heads, queries, keys) probabilities and the tokens on each axis."""

    title: str
    weights: np.ndarray  # (H, Q, K), rows sum to 1
    queries: list[str]  # the token of each query row
    keys: list[str]  # the token of each key column


def attention_figure(panel: AttentionPanel, out: Path) -> Any:
    """One heatmap per head, as the paper's Figures 3-5: darker is more attention; rows are queries.

    Writes the PNG and returns the Figure (its axes hold the images drawn).
    """
    heads = panel.weights.shape[0]
    cols = min(heads, 4)
    rows = -(-heads // cols)
    size = 0.22 * max(len(panel.keys), len(panel.queries)) + 1.2
    fig = new_figure(cols * size, rows * size + 0.4)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for h, ax in enumerate(axes):
        if h >= heads:
            ax.set_axis_off()
            continue
        ax.imshow(panel.weights[h], cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        ax.set_title(f"head {h + 1}", fontsize=9)
        ax.set_xticks(range(len(panel.keys)), panel.keys, rotation=90, fontsize=7)
        ax.set_yticks(range(len(panel.queries)), panel.queries if h % cols == 0 else [], fontsize=7)
    fig.suptitle(panel.title, fontsize=10)
    save_figure(fig, out)
    return fig


# ---------------------------------------------------------------- training curves


def _series(records: list[dict[str, Any]], key: str, x: str) -> tuple[list[float], list[float]]:
    points = [(r[x], r[key]) for r in records if key in r and x in r and r[key] is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _directions(records: list[dict[str, Any]]) -> list[str]:
    """The directions a multilingual run's validation records hold figures of, in their order ([] for one pair)."""
    names: dict[str, None] = {}
    for r in records:
        if isinstance(r.get("directions"), dict):
            names |= dict.fromkeys(r["directions"])
    return list(names)


def _direction_series(records: list[dict[str, Any]], name: str, key: str, x: str) -> tuple[list[float], list[float]]:
    """One direction's ``key`` (nll, bleu) from the validation records that hold it, against ``x``."""
    each = [(r, r["directions"].get(name)) for r in records if isinstance(r.get("directions"), dict)]
    points = [(r[x], d[key]) for r, d in each if isinstance(d, dict) and d.get(key) is not None and x in r]
    return [p[0] for p in points], [p[1] for p in points]


def curves_figure(runs: Run | Sequence[Run], out: Path) -> Any:
    """Loss, learning rate and validation BLEU against updates (top row) and wall-clock minutes (bottom row).

    One run: its training loss, validation loss and NLL. Several runs (a
    comparison of recipes or seeds): one color per run, labelled with its
    directory, each run's training loss and validation NLL; NLL rather than
    the label-smoothed loss, which is not comparable between runs of
    different smoothing. Writes the PNG and returns the Figure: axes [loss,
    lr, BLEU] x [updates, minutes].
    """
    runs = [runs] if isinstance(runs, Run) else list(runs)
    for run in runs:
        if not run.kind("train") and not run.kind("valid"):
            raise PlotError(
                f"{run.path / 'metrics.jsonl'}: no train or valid records to plot; a run logs them every "
                "train.log_every updates and every train.validate_every updates"
            )
    fig = new_figure(13, 7)
    axes = fig.subplots(2, 3)
    for row, (x, label) in enumerate((("update", "updates"), ("minutes", "wall-clock minutes"))):
        loss, lr, bleu = axes[row]
        if len(runs) == 1:
            _one_run(runs[0], loss, lr, x)
        else:
            _runs_side_by_side(runs, loss, lr, x)
        loss.set(ylabel="loss per target token (nats)", xlabel=label)
        loss.legend(fontsize=8)
        lr.set(ylabel="learning rate", xlabel=label)
        _bleu_panel(bleu, runs, x, label)
    fig.suptitle(", ".join(f"{run.path}: {run.updates:,} updates" for run in runs), fontsize=10)
    save_figure(fig, out)
    return fig


def _one_run(run: Run, loss: Any, lr: Any, x: str) -> None:
    train, valid = run.kind("train"), run.kind("valid")
    loss.plot(*_series(train, "loss", x), label="train (label-smoothed)", lw=1)
    loss.plot(*_series(valid, "loss", x), "o-", label="valid (label-smoothed)", ms=3)
    loss.plot(*_series(valid, "nll", x), "s--", label="valid NLL" + (" (mean)" if _directions(valid) else ""), ms=3)
    for name in _directions(valid):  # a model of several directions: each one's validation NLL
        loss.plot(*_direction_series(valid, name, "nll", x), ":", lw=1, label=f"valid NLL {name}")
    lr.plot(*_series(train, "lr", x), lw=1)


def _runs_side_by_side(runs: Sequence[Run], loss: Any, lr: Any, x: str) -> None:
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        loss.plot(*_series(run.kind("train"), "loss", x), lw=1, alpha=0.5, color=color, label=f"{run.path} train")
        loss.plot(*_series(run.kind("valid"), "nll", x), "o-", ms=3, color=color, label=f"{run.path} valid NLL")
        lr.plot(*_series(run.kind("train"), "lr", x), lw=1, color=color, label=str(run.path))
    lr.legend(fontsize=8)


def _bleu_panel(ax: Any, runs: Sequence[Run], x: str, label: str) -> None:
    drawn = 0
    for i, run in enumerate(runs):
        xs, ys = _series(run.kind("valid"), "bleu", x)
        if xs:
            ax.plot(xs, ys, "o-", ms=3, color=f"C{i % 10}", label=str(run.path))
            drawn += 1
    each = _directions(runs[0].kind("valid")) if len(runs) == 1 else []
    for name in each:  # one run of several directions: a curve per direction beside their mean
        xs, ys = _direction_series(runs[0].kind("valid"), name, "bleu", x)
        if xs:
            ax.plot(xs, ys, ":", lw=1, label=name)
    if not drawn:  # placed on the panel, not in data coordinates (which an empty curve would move off it)
        note = "no validation BLEU logged\n(train.valid_bleu_sentences)"
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes)
    elif len(runs) > 1 or each:
        ax.legend(fontsize=8)
    ax.set(ylabel="validation sacreBLEU", xlabel=label)


# ---------------------------------------------------------------- the report's chart


def report_figure(points: Sequence[dict[str, Any]], out: Path) -> Any:
    """Table 3 as bars: the paper's dev BLEU and PPL per row, the matching run's beside it where there is one;
    runs of no paper row first, with their own bars only."""
    fig = new_figure(13, 6)
    axes = fig.subplots(2, 1, sharex=True)
    x = np.arange(len(points))
    for ax, key, label in ((axes[0], "bleu", "BLEU (dev, paper BLEU)"), (axes[1], "ppl", "PPL (dev)")):
        paper = [p[f"paper_{key}"] if p[f"paper_{key}"] is not None else np.nan for p in points]
        ax.bar(x - 0.2, paper, 0.4, label="paper")
        mine = [p[key] if p[key] is not None else np.nan for p in points]
        ax.bar(x + 0.2, mine, 0.4, label="tmt")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[1].set_xticks(x, [p["label"] for p in points], rotation=45, ha="right")
    fig.suptitle(
        "Your runs of no paper row (left), then Table 3 (newstest2013): the paper and your runs; a missing tmt bar "
        "is a row not run",
        fontsize=10,
    )
    save_figure(fig, out)
    return fig
