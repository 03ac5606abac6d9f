"""``lamploop inspect``: a checkpoint's report as text.

:func:`~lamploop.checkpoint.verify_checkpoint` finds every problem of a checkpoint, or of
every checkpoint of a run directory (``inspect_checkpoint`` is the same function);
:func:`format_report` turns its result into text: a header, the model's tensors per top-level
module (:func:`model_tensor_summary`), the learning curve as a table (the best epoch marked
``*``), and the files.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from lamploop.checkpoint.format import DESCRIPTOR_NAME, LATEST_NAME
from lamploop.checkpoint.load import read_descriptor
from lamploop.checkpoint.verify import (
    CheckpointReport,
    CheckpointSummary,
    FileCheck,
    read_loop_state,
    verify_checkpoint,
)
from lamploop.errors import CheckpointError
from lamploop.state import LoopState
from lamploop.summary import TensorSummary, summarize_tensors

__all__ = [
    "CheckpointReport",
    "CheckpointSummary",
    "FileCheck",
    "format_report",
    "inspect_checkpoint",
    "model_tensor_summary",
    "read_loop_state",
]

inspect_checkpoint = verify_checkpoint
"""What ``lamploop inspect`` checks: :func:`~lamploop.checkpoint.verify_checkpoint`."""


def model_tensor_summary(checkpoint: Path) -> TensorSummary | None:
    """The model's tensors in the checkpoint directory ``checkpoint``, per top-level module.

    Read from the descriptor's record of ``model.safetensors`` (names, shapes and dtypes: no
    tensor file is read); parameters and buffers alike, as the checkpoint does not tell them
    apart.  ``None`` when the descriptor is unreadable.
    """
    try:
        descriptor = read_descriptor(checkpoint / DESCRIPTOR_NAME)
    except CheckpointError:
        return None
    return summarize_tensors(descriptor.model_spec.tensors)


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


def format_report(report: CheckpointReport) -> str:
    """The report as text: a header, the model's tensors, the learning curve (best epoch ``*``), the files."""
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
