"""``lamploop plot``: a run's learning curve as a PNG (matplotlib, the ``plot`` extra).

The figure shows the training loss, the raw validation loss (a marker on each epoch that
validated) and the smoothed one, the best epoch (a dashed vertical line and a star, both
in :data:`BEST_EPOCH_COLOR`, which nothing else uses), and the learning-rate factor on a
second y-axis when the curve records it.  matplotlib is imported only when a plot is
drawn, with the Agg backend's canvas (no display and no pyplot state are touched).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from lamploop.errors import MissingDependencyError
from lamploop.state import LoopState
from lamploop.strict_json import write_atomically

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["BEST_EPOCH_COLOR", "plot_learning_curve"]

BEST_EPOCH_COLOR: Final = "#ff00ff"
"""The colour of the best epoch's line and star, and of nothing else in the figure."""

TRAINING_COLOR: Final = "#1f77b4"
VALIDATION_COLOR: Final = "#ff7f0e"
SMOOTHED_COLOR: Final = "#d62728"
LEARNING_RATE_COLOR: Final = "#7f7f7f"

_INSTALL: Final = 'pip install "lamploop[plot]"'


def _missing_matplotlib(error: ImportError) -> MissingDependencyError:
    msg = f"plotting needs matplotlib, which is not installed ({error}); install it with: {_INSTALL}"
    return MissingDependencyError(msg)


def _new_figure(figsize: tuple[float, float], dpi: float) -> Figure:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise _missing_matplotlib(e) from e
    figure = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(figure)
    return figure


def _loop_state(state_or_path: LoopState | str | os.PathLike[str]) -> LoopState:
    if isinstance(state_or_path, LoopState):
        return state_or_path
    from lamploop.inspection import read_loop_state

    return read_loop_state(state_or_path)


def plot_learning_curve(
    state_or_path: LoopState | str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    title: str | None = None,
    figsize: tuple[float, float] = (8.0, 5.0),
    dpi: float = 120,
) -> Path:
    """Draw the learning curve of a :class:`LoopState` or a checkpoint into a PNG; its path.

    Args:
        state_or_path: the loop state, or a checkpoint directory or run directory (its
            latest checkpoint's descriptor is read; no tensor is loaded).
        output: the PNG file; written atomically (a temporary sibling renamed over it).
        title: the figure's title (default: "learning curve", with the checkpoint's path
            when one is given).
        figsize, dpi: the size in inches and the resolution: the PNG is ``figsize[0] * dpi``
            by ``figsize[1] * dpi`` pixels (960 x 600 by default).

    Raises:
        lamploop.errors.MissingDependencyError: matplotlib is not installed (the message
            says ``pip install "lamploop[plot]"``); a :class:`ConfigurationError`.
        lamploop.errors.CheckpointError: the checkpoint cannot be read.
    """
    state = _loop_state(state_or_path)
    if title is None:
        title = "learning curve"
        if not isinstance(state_or_path, LoopState):
            title += f": {os.fspath(state_or_path)}"
    figure = _new_figure(figsize, dpi)
    _draw(figure, state, title)
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=dpi)
    target = Path(output)
    write_atomically(target, png.getvalue())
    return target


def _draw(figure: Figure, state: LoopState, title: str) -> None:
    """The learning curve of ``state`` on ``figure``: training and validation losses per epoch
    (raw and, where smoothing changed them, smoothed), the best epoch marked, ``title`` above."""
    from matplotlib.ticker import MaxNLocator

    axes = figure.add_subplot()
    curve = state.learning_curve
    axes.set_title(title)
    axes.set_xlabel("epoch")
    axes.set_ylabel("loss")
    axes.grid(True, alpha=0.3)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    top = axes
    handles: list[Any] = []
    if curve:
        (line,) = axes.plot(
            [e.epoch for e in curve],
            [e.training_loss for e in curve],
            color=TRAINING_COLOR,
            label="training loss",
        )
        handles.append(line)
    validated = [e for e in curve if e.validation_loss is not None]
    if validated:
        epochs = [e.epoch for e in validated]
        raw = [e.validation_loss[1] for e in validated if e.validation_loss is not None]
        smoothed = [e.validation_loss[0] for e in validated if e.validation_loss is not None]
        # The raw loss on top of the smoothed one, which it hides when nothing is smoothed.
        is_smoothed = smoothed != raw  # not with the default factor 1.0: one line then
        (raw_line,) = axes.plot(
            epochs,
            raw,
            color=VALIDATION_COLOR,
            marker="o",
            markersize=4,
            linewidth=1,
            zorder=3,
            label="validation loss (raw)" if is_smoothed else "validation loss",
        )
        handles.append(raw_line)
        if is_smoothed:
            (smoothed_line,) = axes.plot(
                epochs, smoothed, color=SMOOTHED_COLOR, linewidth=2.5, label="validation loss (smoothed)"
            )
            handles.append(smoothed_line)
    best = state.min_validation_epoch
    if best is not None:
        at_best = next((e.validation_loss for e in validated if e.epoch == best), None)
        value = at_best[0] if at_best is not None else state.min_validation_loss
        axes.axvline(best, color=BEST_EPOCH_COLOR, linestyle="--", linewidth=1.2)
        if value is not None:
            kind = "smoothed validation loss" if validated and is_smoothed else "validation loss"
            label = f"best epoch {best} ({kind} {value:.4g})"
            (star,) = axes.plot(
                [best],
                [value],
                linestyle="none",
                marker="*",
                markersize=16,
                color=BEST_EPOCH_COLOR,
                markeredgecolor="black",
                markeredgewidth=0.6,
                zorder=5,
                label=label,
            )
            handles.append(star)
    factors = [(e.epoch, e.learning_rate_factor) for e in curve if e.learning_rate_factor is not None]
    if factors:
        right = axes.twinx()
        (line,) = right.plot(
            [epoch for epoch, _ in factors],
            [factor for _, factor in factors],
            color=LEARNING_RATE_COLOR,
            linestyle=":",
            drawstyle="steps-post",
            label="learning-rate factor",
        )
        right.set_ylabel("learning-rate factor")
        top = right  # drawn over the left axes: the legend goes there, above every line
        low = min(0.0, *(factor for _, factor in factors))
        high = max(factor for _, factor in factors)
        right.set_ylim(low, high * 1.1 if high > 0 else 1.0)
        handles.append(line)
    if not curve:
        axes.text(0.5, 0.5, "no epoch finished yet", ha="center", va="center", transform=axes.transAxes)
    if handles:
        top.legend(handles=handles, loc="upper right", fontsize="small", framealpha=0.9)
    figure.tight_layout()
