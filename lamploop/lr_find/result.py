"""What the learning-rate range test measured (:class:`LrFindResult`), and its plot.

.. versionadded:: 0.3
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs

from lamploop.errors import MissingDependencyError
from lamploop.strict_json import write_atomically

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["LrFindResult"]

_INSTALL: Final = 'pip install "lamploop[plot]"'


@attrs.frozen
class LrFindResult:
    """What :func:`~lamploop.lr_find.lr_find` measured, one entry per optimizer step taken.

    Attributes:
        lrs: the learning rate of each step.
        losses: the smoothed training loss after each step (what the suggestion and the
            divergence test look at).
        raw_losses: each step's mean training loss per example.
        suggestion: the suggested learning rate (:func:`~lamploop.lr_find.min_loss_suggestion` of ``losses``:
            the rate at the lowest smoothed loss / 10), ``None`` when too few steps were taken.
        diverged: whether the test stopped early because the loss diverged (else it took
            every step up to ``max_lr``).
    """

    lrs: tuple[float, ...]
    losses: tuple[float, ...]
    raw_losses: tuple[float, ...]
    suggestion: float | None
    diverged: bool

    def plot(
        self,
        path: str | os.PathLike[str],
        *,
        title: str = "learning-rate range test",
        figsize: tuple[float, float] = (8.0, 5.0),
        dpi: float = 120,
    ) -> Path:
        """Draw the losses against the learning rate (log scale) and the suggestion into a PNG; its path.

        The file is written atomically (a temporary sibling renamed over it).

        Raises:
            lamploop.errors.MissingDependencyError: matplotlib is not installed (the message
                says ``pip install "lamploop[plot]"``).
        """
        figure = _new_figure(figsize, dpi)
        axes = figure.add_subplot()
        axes.set_title(title)
        axes.set_xscale("log")
        axes.set_xlabel("learning rate")
        axes.set_ylabel("training loss")
        axes.grid(True, alpha=0.3)
        axes.plot(self.lrs, self.raw_losses, color="#bbbbbb", linewidth=1, label="loss")
        axes.plot(self.lrs, self.losses, color="#1f77b4", linewidth=2, label="smoothed loss")
        if self.suggestion is not None:
            lowest = min(range(len(self.losses)), key=lambda i: self.losses[i])
            axes.plot(
                [self.lrs[lowest]],
                [self.losses[lowest]],
                marker="o",
                color="#7f7f7f",
                linestyle="none",
                label=f"lowest smoothed loss, at {self.lrs[lowest]:.3g}",
            )
            axes.axvline(
                self.suggestion,
                color="#d62728",
                linestyle="--",
                linewidth=1.5,
                label=f"suggestion {self.suggestion:.3g} (that / 10)",
            )
        finite = [v for v in (*self.losses, *self.raw_losses) if math.isfinite(v)]
        if finite:  # down to the lowest loss, up to the smoothed curve's top (a raw spike is cut off)
            low, high = min(finite), max(v for v in self.losses if math.isfinite(v))
            margin = 0.05 * (high - low) or 0.05 * abs(high) or 0.05
            axes.set_ylim(low - margin, high + 2 * margin)
        axes.legend(loc="best")
        figure.tight_layout()
        png = io.BytesIO()
        figure.savefig(png, format="png", dpi=dpi)
        target = Path(path)
        write_atomically(target, png.getvalue())
        return target


def _new_figure(figsize: tuple[float, float], dpi: float) -> Figure:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        msg = f"plotting needs matplotlib, which is not installed ({e}); install it with: {_INSTALL}"
        raise MissingDependencyError(msg) from e
    figure = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(figure)
    return figure
