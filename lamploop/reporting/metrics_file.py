"""``MetricsFileReporter``: one row per epoch in a CSV or JSON-lines file.

Each finished epoch adds a row: ``epoch``, ``training_loss``, ``validation_loss`` (raw),
``validation_loss_smoothed``, ``learning_rate_factor``, ``seconds``, ``steps``,
``examples``, the step breakdown's :data:`STEP_COLUMNS` when the run measured one (seconds
summed over the epoch's steps: ``step_seconds``, ``data_wait_seconds``...), then
``train_<metric>`` and ``validation_<metric>`` (raw) for each metric; JSON lines also carry
``time``.  An existing file is appended to, so a resumed run goes
on in the same file.  Values a row does not have are empty in CSV and ``null`` in JSON.

>>> import csv, os, tempfile
>>> from lamploop.reporting import EpochFinished, MetricsFileReporter
>>> from lamploop.state import LearningCurveEntry, LoopState
>>> path = os.path.join(tempfile.mkdtemp(), "curve.csv")
>>> rows = MetricsFileReporter(path)
>>> state = LoopState(epoch=1, learning_curve=[LearningCurveEntry(0, 0.5, validation_loss=(0.6, 0.7))])
>>> rows.report(EpochFinished(state, seconds=2.0, steps=10, examples=640))
>>> rows.close()
>>> with open(path, newline="") as f:
...     row = next(csv.DictReader(f))
>>> row["epoch"], row["training_loss"], row["validation_loss"], row["learning_rate_factor"]
('0', '0.5', '0.7', '')
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any, Literal, TextIO

from lamploop.checks import check_parents, check_path
from lamploop.errors import ConfigurationError
from lamploop.reporting.events import EpochFinished, Event

__all__ = ["BASE_COLUMNS", "STEP_COLUMNS", "MetricsFileReporter", "epoch_row"]

logger = logging.getLogger("lamploop")

_SUFFIXES: dict[str, Literal["csv", "jsonl"]] = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}

BASE_COLUMNS = (
    "epoch",
    "training_loss",
    "validation_loss",
    "validation_loss_smoothed",
    "learning_rate_factor",
    "seconds",
    "steps",
    "examples",
)

STEP_COLUMNS = (
    "step_seconds",
    "data_wait_seconds",
    "forward_backward_seconds",
    "communication_wait_seconds",
    "optimizer_seconds",
    "checkpoint_seconds",
)
"""The step breakdown's columns (:class:`~lamploop.loop.step_timing.StepBreakdown`): the wall time
of the epoch's steps, then its five parts, each summed over the steps."""


def epoch_row(event: EpochFinished) -> dict[str, Any]:
    """The row of one epoch: :data:`BASE_COLUMNS`, :data:`STEP_COLUMNS` (with a step breakdown),
    then ``train_<m>`` and ``validation_<m>``.

    Each training metric also has a ``validation_<m>`` column (empty in epochs that did not
    validate), so the columns of a run do not depend on whether its first epoch validated.
    """
    entry = event.state.learning_curve[-1]
    smoothed, raw = entry.validation_loss if entry.validation_loss is not None else (None, None)
    row: dict[str, Any] = {
        "epoch": entry.epoch,
        "training_loss": entry.training_loss,
        "validation_loss": raw,
        "validation_loss_smoothed": smoothed,
        "learning_rate_factor": entry.learning_rate_factor,
        "seconds": event.seconds,
        "steps": event.steps,
        "examples": event.examples,
    }
    breakdown = event.step_breakdown
    if breakdown is not None:
        row["step_seconds"] = breakdown.seconds
        for name, value in breakdown.parts().items():
            row[f"{name}_seconds"] = value
    for name, value in entry.training_metrics.items():
        row[f"train_{name}"] = value
    for name in entry.training_metrics:
        row[f"validation_{name}"] = None
    for name, (_, raw_value) in entry.validation_metrics.items():
        row[f"validation_{name}"] = raw_value
    return row


class MetricsFileReporter:
    """Writes one row per ``EpochFinished`` to ``path``, as CSV or JSON lines; other events are ignored.

    Args:
        path: the file; made (with its directory) when missing, appended to otherwise.
        format: ``"csv"`` or ``"jsonl"``; by default from the suffix (``.csv``, ``.jsonl``
            or ``.ndjson``).

    CSV: the first row fixes the columns (see :func:`epoch_row`) and writes the header,
    unless the file has one already: the same columns, or more columns that include every
    one of the row's, are carried on (also one without :data:`STEP_COLUMNS`, written before
    step breakdowns were: they are left out); other headers are refused.  A later row with a
    column the header lacks is written without it, and the lost column logged (once).
    JSON lines: one object per row, with ``time`` (the event's) added.  Each row is
    flushed as it is written.

    Raises:
        ConfigurationError: an unknown ``format`` or suffix, or a CSV file whose header
            does not fit the rows (raised by the first :meth:`report`, which
            :func:`~lamploop.reporting.report_all` logs; the reporter then writes nothing).
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | Path, *, format: Literal["csv", "jsonl"] | None = None) -> None:
        self.path = check_path("MetricsFileReporter: path", path)
        if self.path.is_dir():
            msg = f"MetricsFileReporter: path {str(path)!r} is a directory; give a file in it (metrics.csv)"
            raise ConfigurationError(msg)
        if format is None:
            found = _SUFFIXES.get(self.path.suffix.lower())
            if found is None:
                msg = (
                    f"MetricsFileReporter: cannot tell the format of {str(self.path)!r} from its suffix "
                    f"(known: {', '.join(_SUFFIXES)}); pass format='csv' or format='jsonl'"
                )
                raise ConfigurationError(msg)
            format = found
        elif format not in ("csv", "jsonl"):
            msg = f"MetricsFileReporter: format must be 'csv' or 'jsonl', got {format!r}"
            raise ConfigurationError(msg)
        self.format: Literal["csv", "jsonl"] = format
        check_parents("MetricsFileReporter: path", self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._existing_header: list[str] | None = None
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open("rb") as f:
                f.seek(-1, 2)
                needs_newline = f.read(1) != b"\n"  # a row cut short: ours start on a line of their own
            if format == "csv":
                with self.path.open(newline="", encoding="utf-8") as f:
                    self._existing_header = next(csv.reader(f), [])
        self._file: TextIO | None = self.path.open(
            "a", newline="" if format == "csv" else None, encoding="utf-8"
        )
        if needs_newline:
            self._file.write("\n")
        self._columns: list[str] | None = None
        self._writer: csv.DictWriter[str] | None = None
        self._refused = False
        self._lost_logged = False

    def _start_csv(self, file: TextIO, row: dict[str, Any]) -> csv.DictWriter[str]:
        header = self._existing_header
        if header is None:
            columns = list(row)
        elif header == list(row) or (
            # A file from before step breakdowns were written is carried on without them.
            header[: len(BASE_COLUMNS)] == list(BASE_COLUMNS) and set(row) - set(STEP_COLUMNS) <= set(header)
        ):
            columns = header
        else:
            self._refused = True
            msg = (
                f"MetricsFileReporter: {str(self.path)!r} has the header {','.join(header)!r}, "
                f"this run's rows have {','.join(row)!r}: write to another file"
            )
            raise ConfigurationError(msg)
        writer = csv.DictWriter(file, columns, extrasaction="ignore", lineterminator="\n")
        if header is None:
            writer.writeheader()
        self._columns = columns
        return writer

    def report(self, event: Event) -> None:
        """Write the row of an ``EpochFinished``; nothing for other events, or after :meth:`close`."""
        if not isinstance(event, EpochFinished) or self._file is None or self._refused:
            return
        row = epoch_row(event)
        if self.format == "jsonl":
            row["time"] = event.time
            self._file.write(json.dumps(row) + "\n")
        else:
            if self._writer is None:
                self._writer = self._start_csv(self._file, row)
            elif not self._lost_logged and self._columns is not None:
                lost = [name for name in row if name not in self._columns]
                if lost:
                    self._lost_logged = True
                    logger.error(
                        "MetricsFileReporter: %s has no column for %s (the columns are fixed by the "
                        "first row); those values are left out",
                        self.path,
                        ", ".join(lost),
                    )
            self._writer.writerow({k: "" if v is None else v for k, v in row.items()})
        self._file.flush()

    def close(self) -> None:
        """Close the file (calling it again does nothing)."""
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def __repr__(self) -> str:
        return f"MetricsFileReporter({str(self.path)!r}, format={self.format!r})"
