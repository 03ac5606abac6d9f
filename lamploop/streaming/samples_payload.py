"""A ``"samples"`` frame's payload: its samples' safetensors bytes to tensors, in runs.

The payload of a batch (:mod:`lamploop.streaming.wire`) is each sample's tensors as
safetensors bytes, one after the other, each 8-aligned.  The samples of a batch that share one
safetensors header are decoded together (a few torch calls per tensor name, not per sample:
:func:`~lamploop.streaming.tensor_bytes.decode_rows`).  Decoded tensors are views of the
received bytes, without a copy, except in a batch of more than 8 samples and 64 KiB of one
kind, whose runs of that many are copied once each, and for samples much smaller than a frame
of samples of several kinds (copied out): one sample kept long in a buffer holds its run's
memory, not a whole frame's.  A receiver's decoder copies runs of 256 KiB or more straight
from the bytes it received (:func:`take_samples`), without gathering the frame first.

.. versionadded:: 0.3
   split from :mod:`lamploop.streaming.wire`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import torch

from lamploop.errors import FrameError
from lamploop.streaming.sample_rows import single_row
from lamploop.streaming.tensor_bytes import Signature, address_of, decode_rows, decode_tensors_signed

__all__ = [
    "MAX_SAMPLES_PER_FRAME",
    "RUN_TAKEN_BYTES",
    "decode_samples",
    "payload_offsets",
    "run_lengths",
    "take_samples",
]

MAX_SAMPLES_PER_FRAME: Final = 4096
"""The most samples one ``"samples"`` frame carries (its header lists their sizes)."""

_ALIGN = 8
_COPY_BELOW_SHARE = 8
"""A sample under 1/8 of its frame's body is copied out of the frame, not viewed in it (frames
whose samples differ in size or kind: they are decoded one by one)."""
_GROUP_SAMPLES = 8
_GROUP_BYTES = 64 * 1024
"""A frame of samples of one kind is decoded as a whole: its samples' tensors are views of the
frame when it holds at most 8 samples or 64 KiB, else views of copies of runs of that many
(8 samples or 64 KiB, whichever is more), so that a sample kept long holds no more than its run."""
RUN_TAKEN_BYTES: Final = 256 * 1024
"""Runs of at least this many bytes are copied straight from the received chunks (one copy, not
two); smaller ones cost less gathered with the frame first (a run's fixed cost, about that of
a few tensors, then outweighs a copy of its bytes)."""


def payload_offsets(start: int, payload: int, sizes: list[Any]) -> list[int]:
    """Where each sample's bytes begin in a body whose payload of ``payload`` bytes is at ``start``."""
    if not 1 <= len(sizes) <= MAX_SAMPLES_PER_FRAME:
        msg = f"sizes lists 1 to {MAX_SAMPLES_PER_FRAME} samples, got {len(sizes)}"
        raise FrameError(f"malformed 'samples' message: {msg}")
    if start % _ALIGN:
        msg = f"malformed 'samples' message: its payload starts at byte {start} of the body, not 8-aligned"
        raise FrameError(msg)
    size = sizes[0]
    if type(size) is int and size > 0 and sizes.count(size) == len(sizes) and set(map(type, sizes)) == {int}:
        # The usual frame, samples of one size: no step of Python per sample.
        stride = size + (-size % _ALIGN)
        if stride * len(sizes) == payload:
            return list(range(start, start + payload, stride))
    offsets = []
    offset = start
    for size in sizes:
        if type(size) is not int or size < 0:
            msg = f"malformed 'samples' message: a size is not an int >= 0: {size!r:.40}"
            raise FrameError(msg)
        offsets.append(offset)
        offset += size + (-size % _ALIGN)
    if offset != start + payload:
        msg = (
            f"malformed 'samples' message: sizes {sizes!s:.80} make {offset - start} bytes, "
            f"the payload has {payload}"
        )
        raise FrameError(msg)
    return offsets


def decode_samples(
    body: bytes | bytearray, start: int, sizes: list[Any]
) -> tuple[list[Mapping[str, torch.Tensor]], list[Signature]]:
    """Each sample's tensors in ``body[start:]`` (payloads of these ``sizes``), and their signatures."""
    offsets = payload_offsets(start, len(body) - start, sizes)
    if not isinstance(body, bytearray):
        body = bytearray(body)  # the tensors need memory of their own
    if sizes.count(sizes[0]) == len(sizes):  # the usual frame: samples of one kind
        stride = sizes[0] + (-sizes[0] % _ALIGN)
        group = max(_GROUP_SAMPLES, _GROUP_BYTES // max(stride, 1))
        rows = decode_rows(body, start, len(sizes), stride, sizes[0], group=group)
        if rows is not None:
            decoded, signature = rows
            return decoded, [signature] * len(decoded)
    samples: list[Mapping[str, torch.Tensor]] = []
    signatures = []
    address = address_of(body)
    for begin, size in zip(offsets, sizes, strict=True):
        if size * _COPY_BELOW_SHARE < len(body):  # small: copied, so as not to pin the whole frame
            tensors, signature = decode_tensors_signed(bytearray(body[begin : begin + size]))
        else:
            tensors, signature = decode_tensors_signed(body, begin, begin + size, address=address)
        samples.append(single_row(tensors))
        signatures.append(signature)
    return samples, signatures


def run_lengths(sizes: list[Any]) -> list[int] | None:
    """The bytes of each run that :func:`take_samples` takes apart from a payload of samples of
    these ``sizes`` (checked by :func:`payload_offsets` first), or ``None`` when it takes the
    payload whole (samples of several sizes, or runs under :data:`RUN_TAKEN_BYTES`)."""
    count, size = len(sizes), sizes[0]
    stride = size + (-size % _ALIGN)
    group = max(_GROUP_SAMPLES, _GROUP_BYTES // max(stride, 1))
    if count <= group or group * stride < RUN_TAKEN_BYTES or sizes.count(size) != count:
        return None
    return [min(group, count - first) * stride for first in range(0, count, group)]


def take_samples(
    take: Callable[[int], bytearray], start: int, payload: int, sizes: list[Any]
) -> tuple[list[Mapping[str, torch.Tensor]], list[Signature]]:
    """:func:`_decode_samples` of a payload still in the decoder's received chunks (``take``).

    A batch of more than one run of samples of one size, runs of 256 KiB or more
    (:func:`run_lengths`), gathers each run straight into memory of its own, instead of the
    whole payload first and then each run again: one copy of the received bytes, not two (none,
    when the decoder read the runs from the socket straight into their memory).  Each run is
    decoded together when its samples share one header, else one by one (views of the run: a
    sample holds its run, as in :func:`decode_body`).
    """
    payload_offsets(start, payload, sizes)
    runs = run_lengths(sizes)
    if runs is None:
        # Runs of small samples: gathering the payload whole, then copying each run, costs less
        # than decoding each run apart (a run's fixed cost is a few tensors' worth).
        return decode_samples(take(payload), 0, sizes)
    size = sizes[0]
    stride = size + (-size % _ALIGN)
    samples: list[Mapping[str, torch.Tensor]] = []
    signatures: list[Signature] = []
    for run_bytes in runs:
        n = run_bytes // stride
        run = take(run_bytes)
        rows = decode_rows(run, 0, n, stride, size, group=n)
        if rows is not None:
            samples.extend(rows[0])
            signatures.extend([rows[1]] * n)
            continue
        address = address_of(run)
        for begin in range(0, n * stride, stride):
            tensors, signature = decode_tensors_signed(run, begin, begin + size, address=address)
            samples.append(single_row(tensors))
            signatures.append(signature)
    return samples, signatures
