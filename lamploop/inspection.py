"""``lamploop inspect``: a checkpoint's report as text.

:func:`~lamploop.checkpoint.verify_checkpoint` finds every problem of a checkpoint, or of
every checkpoint of a run directory (``inspect_checkpoint`` is the same function);
:func:`format_report` turns its result into text: a header, the model's tensors per top-level
module (:func:`model_tensor_summary`), the learning curve as a table (the best epoch marked
``*``), where the training steps' time went when a metrics file beside the checkpoints holds
a step breakdown (:func:`step_breakdown_lines`), and the files.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
from pathlib import Path
from typing import Any

from lamploop.checkpoint.format import DESCRIPTOR_NAME, LATEST_NAME
from lamploop.checkpoint.load import read_descriptor
from lamploop.checkpoint.sharded import is_sharded_checkpoint, sharded_model_spec
from lamploop.checkpoint.verify import (
    CheckpointReport,
    CheckpointSummary,
    FileCheck,
    read_loop_state,
    verify_checkpoint,
)
from lamploop.errors import CheckpointError
from lamploop.reporting.metrics_file import STEP_COLUMNS
from lamploop.state import LoopState
from lamploop.summary import TensorSummary, summarize_tensors

__all__ = [
    "CheckpointReport",
    "CheckpointSummary",
    "FileCheck",
    "format_report",
    "inspect_checkpoint",
    "metrics_file_with_steps",
    "model_tensor_summary",
    "read_loop_state",
    "step_breakdown_lines",
]

inspect_checkpoint = verify_checkpoint
"""What ``lamploop inspect`` checks: :func:`~lamploop.checkpoint.verify_checkpoint`."""


def model_tensor_summary(checkpoint: Path) -> TensorSummary | None:
    """The model's tensors in the checkpoint directory ``checkpoint``, per top-level module.

    Read from the descriptor's record of ``model.safetensors``, or a sharded checkpoint's index
    (names, full shapes and dtypes: no tensor file is read); parameters and buffers alike, as
    the checkpoint does not tell them apart.  ``None`` when the record is unreadable.
    """
    try:
        if is_sharded_checkpoint(checkpoint):  # the descriptor's record holds one rank's rows
            return summarize_tensors(sharded_model_spec(checkpoint).tensors)
        descriptor = read_descriptor(checkpoint / DESCRIPTOR_NAME)
    except CheckpointError:
        return None
    return summarize_tensors(descriptor.model_spec.tensors)


# --------------------------------------------------------------------------------------------
# The step breakdown, from a metrics file

_METRICS_SUFFIXES = (".csv", ".jsonl", ".ndjson")
_PART_HEADINGS = ("data wait", "fwd+bwd", "comm wait", "optimizer", "checkpoint", "other")


def _metrics_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a :class:`~lamploop.reporting.MetricsFileReporter` file (empty if unreadable)."""
    try:
        with path.open(newline="", encoding="utf-8") as f:
            if path.suffix.lower() == ".csv":
                return [dict(row) for row in csv.DictReader(f)]
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, UnicodeDecodeError, ValueError, csv.Error):
        return []
    return [row for row in rows if isinstance(row, dict)]


def _seconds(value: object) -> float | None:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number >= 0 else None


def metrics_file_with_steps(directory: Path) -> Path | None:
    """The first metrics file (``*.csv``, ``*.jsonl``, ``*.ndjson``, by name) directly in
    ``directory`` whose rows hold a step breakdown; ``None`` when there is none."""
    if not directory.is_dir():
        return None
    for path in sorted(
        p for p in directory.iterdir() if p.suffix.lower() in _METRICS_SUFFIXES and p.is_file()
    ):
        if any(_seconds(row.get("step_seconds")) is not None for row in _metrics_rows(path)):
            return path
    return None


def step_breakdown_lines(path: Path) -> list[str]:
    """A table of the step breakdown per epoch in the metrics file ``path``: the mean time per
    step, then each part's share of the steps' time (rows without a breakdown are left out)."""
    header = ["epoch", "steps", "ms/step", *_PART_HEADINGS]
    rows = []
    for row in _metrics_rows(path):
        values = [_seconds(row.get(column)) for column in STEP_COLUMNS]
        steps = _seconds(row.get("steps"))
        whole = values[0]
        if whole is None or steps is None or any(v is None for v in values):
            continue
        parts = [v or 0.0 for v in values[1:]]
        parts.append(max(0.0, whole - sum(parts)))
        share = [f"{100 * p / whole:.1f}%" if whole > 0 else "-" for p in parts]
        per_step = f"{1000 * whole / steps:.3f}" if steps > 0 else "-"
        rows.append([str(row.get("epoch", "?")), f"{steps:.0f}", per_step, *share])
    if not rows:
        return []
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  " + "  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]


# --------------------------------------------------------------------------------------------
# Text


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _is_smoothed(state: LoopState) -> bool:
    """Whether smoothing changed any validation loss (never with the default factor 1.0)."""
    return any(v is not None and v[0] != v[1] for v in (e.validation_loss for e in state.learning_curve))


def _curve_table(state: LoopState) -> list[str]:
    curve = state.learning_curve
    training_metrics = sorted({name for e in curve for name in e.training_metrics})
    validation_metrics = sorted({name for e in curve for name in e.validation_metrics})
    smoothed_metrics = [
        name
        for name in validation_metrics
        if any(
            name in e.validation_metrics and e.validation_metrics[name][0] != e.validation_metrics[name][1]
            for e in curve
        )
    ]
    loss_smoothed = _is_smoothed(state)
    header = ["epoch", "train loss", "valid raw", "valid smoothed", "lr factor"]
    if not loss_smoothed:  # the default factor 1.0: one validation column
        header[2:4] = ["valid loss"]
    header += [f"train {n}" for n in training_metrics]
    for n in validation_metrics:
        header.append(f"valid {n}")
        if n in smoothed_metrics:
            header.append(f"valid {n} smoothed")
    rows = []
    for e in curve:
        mark = "*" if e.epoch == state.min_validation_epoch else ""
        valid = e.validation_loss
        row = [
            f"{e.epoch}{mark}",
            _number(e.training_loss),
            _number(None if valid is None else valid[1]),
            _number(None if valid is None else valid[0]),
            _number(e.learning_rate_factor),
        ]
        if not loss_smoothed:
            del row[3]
        row += [_number(e.training_metrics.get(n)) for n in training_metrics]
        for n in validation_metrics:
            pair = e.validation_metrics.get(n)
            row.append(_number(None if pair is None else pair[1]))
            if n in smoothed_metrics:
                row.append(_number(None if pair is None else pair[0]))
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]
    ]
    return ["  " + line for line in lines]


def _when(unix_ns: int | None) -> str:
    if unix_ns is None:
        return "unknown"
    moment = datetime.datetime.fromtimestamp(unix_ns / 1e9, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _file_line(f: FileCheck, name_width: int) -> str:
    size = "missing" if f.size is None else f"{f.size:,} bytes"
    if f.problem is not None:
        status = f"BAD: {f.problem}"
    elif f.note is not None:
        status = f.note
    elif f.sha256_ok:
        status = "ok (sha256)"
    else:
        status = "ok"
    return f"  {f.name.ljust(name_width)}  {size:>15}  {status}"


def format_report(report: CheckpointReport, *, metrics_file: Path | None = None) -> str:
    """The report as text: a header, the model's tensors, the learning curve (best epoch ``*``),
    the step breakdown, the files.

    The step breakdown is read from ``metrics_file`` or, by default, from the first metrics
    file in the run directory (the checkpoint's parent) that holds one
    (:func:`metrics_file_with_steps`): write a :class:`~lamploop.reporting.MetricsFileReporter`
    file into ``checkpoint_dir`` to have it shown.
    """
    lines = [f"checkpoint   {report.path}"]
    if report.run_directory is not None:
        count = len(report.checkpoints)
        latest = next((c for c in report.checkpoints if c.is_latest), None)
        if latest is not None and latest.path != report.path:
            # Reported in its place, as load_checkpoint would fall back to it.
            lines[0] += f" (the latest valid one: '{LATEST_NAME}' names {latest.path.name}, which is bad)"
        lines.append(f"run          {report.run_directory} ({count} checkpoint{'s' if count != 1 else ''})")
    if report.format_version is None:
        lines.append(f"written by   unknown: {DESCRIPTOR_NAME} is unreadable")
    else:
        lines.append(
            f"written by   lamploop {report.lamploop_version} (format {report.format_version}), "
            f"{_when(report.saved_at_unix_ns)}"
        )
    state = report.loop_state
    if state is not None:
        if report.position is None:
            lines.append(f"resumes at   the start of epoch {state.epoch}")
        else:
            lines.append(
                f"resumes at   epoch {report.position.epoch} after step {report.position.steps_done} "
                "(a step-boundary checkpoint)"
            )
        lines.append(f"epochs done  {len(state.learning_curve)}")
        smoothed = _is_smoothed(state)
        lines.append(f"last valid   {_number(state.last_validation_loss)}{' (smoothed)' if smoothed else ''}")
        if state.min_validation_epoch is None:
            lines.append("best epoch   none yet (no validation)")
        else:
            kind = "smoothed validation loss" if smoothed else "validation loss"
            lines.append(
                f"best epoch   {state.min_validation_epoch} ({kind} {_number(state.min_validation_loss)})"
            )
        lines.append("")
        model = model_tensor_summary(report.path)
        if model is not None:
            lines.append(
                f"model        {model.elements:,} values in {model.tensors:,} tensors "
                f"(parameters and buffers), {model.size_mb:.3f} MB"
            )
            lines += model.lines()
            lines.append("")
        if state.learning_curve:
            lines.append("learning curve (* marks the best epoch):")
            lines += _curve_table(state)
        else:
            lines.append("learning curve: empty (no epoch finished)")
        run_directory = report.run_directory if report.run_directory is not None else report.path.parent
        found = metrics_file if metrics_file is not None else metrics_file_with_steps(run_directory)
        breakdown = step_breakdown_lines(found) if found is not None else []
        if found is not None and breakdown:
            lines.append("")
            lines.append(f"where the training steps' time went (from {found}; host-side times on a GPU):")
            lines += breakdown
    lines.append("")
    lines.append(f"files of {report.path.name}:")
    width = max((len(f.name) for f in report.files), default=0)
    lines += [_file_line(f, width) for f in report.files]
    if report.run_directory is not None:
        lines.append("")
        lines.append(f"checkpoints in {report.run_directory}:")
        width = max(len(c.path.name) for c in report.checkpoints)
        for c in report.checkpoints:
            tags = [t for t, on in (("latest", c.is_latest), ("reported", c.path == report.path)) if on]
            tag = f" ({', '.join(tags)})" if tags else ""
            status = "ok" if c.ok else f"BAD: {len(c.problems)} problem{'s' if len(c.problems) != 1 else ''}"
            lines.append(f"  {c.path.name.ljust(width)}  {status}{tag}")
    lines.append("")
    if report.notes:
        lines.append("notes:")
        lines += [f"  {note}" for note in report.notes]
        lines.append("")
    if report.ok:
        lines.append("ok: every file is intact")
    else:
        count = len(report.problems)
        lines.append(f"{count} problem{'s' if count != 1 else ''}:")
        lines += [f"  {problem}" for problem in report.problems]
    return "\n".join(lines) + "\n"
