"""``SampleRow``: a received sample's tensors as one row of its run's columns, and the batch
made from such rows by slicing the columns instead of stacking the samples one by one.

A run of samples of one kind (one safetensors header) is decoded into one tensor per name, the
*columns*, whose first dimension is the sample (:func:`~lamploop.streaming.tensor_bytes.decode_rows`).
Each sample's tensors are then a :class:`SampleRow`: the columns and its index, an immutable
``Mapping[str, torch.Tensor]`` whose ``row["x"]`` is ``columns["x"][index]``; a sample decoded
alone (a frame of samples of several kinds) is the one row of columns of its own
(:func:`single_row`), so every received sample's tensors are a ``SampleRow``.  Making a row is
one small object, where a dict of tensor views was one torch view per tensor and sample; and a
batch of rows that follow each other in one run (a FIFO buffer's usual read) is one slice per
tensor name, copied once (:func:`stack_rows`), where ``torch.stack`` took one tensor per sample.

The batch is a copy, as ``torch.stack`` makes: changing it in place changes no sample that a
buffer still holds.

.. versionadded:: 0.3
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["SampleRow", "row_runs", "single_row", "stack_rows", "stack_runs"]


class SampleRow(Mapping[str, torch.Tensor]):
    """Row ``index`` of ``columns`` (one tensor per name, first dimension the sample), as a
    read-only mapping from name to that row's tensor (a view, as a decoded sample's were)."""

    __slots__ = ("columns", "index")

    def __init__(self, columns: Mapping[str, torch.Tensor], index: int) -> None:
        self.columns = columns
        self.index = index

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.columns[name][self.index]

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns)

    def __len__(self) -> int:
        return len(self.columns)

    def __contains__(self, name: object) -> bool:
        return name in self.columns

    def __repr__(self) -> str:
        shapes = {name: tuple(column.shape[1:]) for name, column in self.columns.items()}
        return f"SampleRow(index={self.index}, shapes={shapes})"


def single_row(tensors: Mapping[str, torch.Tensor]) -> SampleRow:
    """``tensors`` (a sample decoded alone) as the one row of columns of its own (views)."""
    return SampleRow({name: tensor.unsqueeze(0) for name, tensor in tensors.items()}, 0)


def row_runs(rows: Sequence[Any]) -> list[tuple[Mapping[str, torch.Tensor], int, int]] | None:
    """The stretches of ``rows`` that follow each other in one run, as ``(columns, first, end)``
    (rows ``first`` to ``end - 1`` of ``columns``), when every one of ``rows`` is a
    :class:`SampleRow`; ``None`` when one is not (or ``rows`` is empty).  Found once for all of
    a batch's tensor names."""
    runs: list[tuple[Mapping[str, torch.Tensor], int, int]] = []
    columns: Mapping[str, torch.Tensor] | None = None
    first = end = 0
    for row in rows:
        if type(row) is not SampleRow:
            return None
        if row.columns is columns and row.index == end:
            end += 1
            continue
        if columns is not None:
            runs.append((columns, first, end))
        columns, first, end = row.columns, row.index, row.index + 1
    if columns is None:
        return None
    runs.append((columns, first, end))
    return runs


def stack_runs(runs: Sequence[tuple[Mapping[str, torch.Tensor], int, int]], name: str) -> torch.Tensor:
    """The rows of ``runs`` (:func:`row_runs`) of tensor ``name``, stacked: one slice per run,
    copied once (a copy even of one slice: the batch never shares memory with a buffered sample).

    Raises:
        KeyError: a run has no tensor ``name``.
        RuntimeError: torch's, when runs have different shapes.
    """
    # torch.cat copies even one piece: the batch never shares memory with a buffered sample.
    return torch.cat([columns[name][first:end] for columns, first, end in runs])


def stack_rows(rows: Sequence[Any], name: str) -> torch.Tensor | None:
    """``torch.stack([row[name] for row in rows])`` when every one of ``rows`` is a
    :class:`SampleRow`, made from one slice of the columns per stretch of rows that follow each
    other in one run; ``None`` when one is not (stack them one by one).

    Raises:
        KeyError: a row has no tensor ``name``.
        RuntimeError: torch's, when rows of different runs have different shapes.
    """
    runs = row_runs(rows)
    return None if runs is None else stack_runs(runs, name)
