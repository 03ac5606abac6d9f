"""A sample's tensors as safetensors bytes, encoded in one copy and decoded without any.

The bytes are the safetensors format (``safetensors.torch.load`` reads what
:func:`encode_tensors` writes, and :func:`decode_tensors` reads what
``safetensors.torch.save`` writes): an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the tensors' bytes.  Nothing is ever
unpickled.

Why not ``safetensors.torch.save``/``load``: they cost about 20 µs of Python per sample and
copy every tensor twice; here the encoder makes one copy (the caller may change its tensors
after sending), and the decoder makes none: the tensors are :func:`torch.frombuffer` views of
the received bytes (a ``bytearray`` the views keep alive).  The decoder is as strict as the
reference parser: a known dtype, byte ranges that match the shapes and tile the data exactly
(so a name given twice leaves a hole, unless both describe the same bytes), at least one
tensor; anything else is a :class:`~lamploop.errors.FrameError`.

.. versionadded:: 0.2
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
from collections.abc import Iterable, Mapping
from itertools import repeat
from typing import Any, Final, TypeAlias

import attrs
import numpy as np
import torch

from lamploop.errors import FrameError
from lamploop.streaming.sample_rows import SampleRow

__all__ = [
    "DTYPES",
    "Signature",
    "address_of",
    "decode_tensors",
    "decode_rows",
    "decode_tensors_signed",
    "describe_mismatch",
    "encode_rows",
    "encode_tensors",
    "signature_of",
]

DTYPES: Final[dict[str, torch.dtype]] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "C64": torch.complex64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
"""The safetensors dtype names this codec reads and writes, and their torch dtypes."""

_NAMES: Final = {dtype: name for name, dtype in DTYPES.items()}
_LENGTH = struct.Struct("<Q")
_MAX_HEADER_BYTES: Final = 100_000_000  # the reference parser's limit
_TENSOR_KEYS: Final = frozenset({"dtype", "shape", "data_offsets"})
_ALIGN: Final = 8  # the largest dtype size: an 8-aligned start aligns every self-aligned tensor
_MAX_LAYOUTS: Final = 256
"""Headers kept, made or checked (a producer's samples usually share one, so each is made or
parsed once); the cache is emptied when full."""


def encode_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The safetensors bytes of a sample's named tensors (moved to the CPU, copied once).

    The layout is the reference encoder's: tensors ordered by dtype size (largest first), then
    name, so each one is aligned to its dtype size; the header padded with spaces to 8 bytes.

    Raises:
        TypeError: ``tensors`` is not a mapping of str to tensors, or a dtype safetensors lacks.
        ValueError: it is empty.
    """
    if type(tensors) is not dict and not isinstance(tensors, Mapping):
        msg = f"a sample's tensors are a mapping of names to tensors, got {type(tensors).__name__}"
        raise TypeError(msg)
    # The usual case costs a few attribute reads per tensor: a simulation's samples share one
    # kind (names, dtypes, shapes), whose header and order are made once (_encoding).
    key: list[tuple[str, torch.dtype, torch.Size]] = []
    ready: list[torch.Tensor] = []
    for name, tensor in tensors.items():
        if type(name) is not str or not isinstance(tensor, torch.Tensor):
            what = f"{name!r:.100} ({type(name).__name__}): {type(tensor).__name__}"
            msg = f"a sample's tensors map str to torch.Tensor, got {what}"
            raise TypeError(msg)
        try:  # free unless it raises (Python 3.11)
            if tensor.requires_grad:
                tensor = tensor.detach()
            if not tensor.is_cpu:
                tensor = tensor.cpu()
            if tensor.is_conj() or tensor.is_neg():  # a lazy view: its memory does not hold its values yet
                tensor = tensor.resolve_conj().resolve_neg()
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
        except (RuntimeError, NotImplementedError) as exc:  # sparse, meta...: no memory to send
            raise TypeError(_unsendable(name, tensor, exc)) from exc
        key.append((name, tensor.dtype, tensor.shape))
        ready.append(tensor)
    signature = tuple(key)
    encoding = _ENCODINGS.get(signature)
    if encoding is None:  # a new kind of sample
        encoding = _encoding(signature)
    prefix, order = encoding
    parts: list[Any] = [prefix]
    for index, raw in order:
        # The tensor's own bytes, without a numpy view (2 µs each): ``ready`` keeps the tensors
        # alive until the join below has copied them.
        parts.append(raw.from_address(ready[index].data_ptr()))
    return b"".join(parts)


def check_samples(samples: object) -> None:
    """TypeError unless ``samples`` is an iterable of samples (``send_many``'s argument): one
    sample (a mapping) or a number is named, not iterated."""
    if isinstance(samples, Mapping) or not isinstance(samples, Iterable) or isinstance(samples, str | bytes):
        hint = " (one sample: send(sample), or send_many([sample]))" if isinstance(samples, Mapping) else ""
        msg = (
            f"send_many: samples must be an iterable of samples (mappings of names to tensors){hint}, "
            f"got {type(samples).__name__}"
        )
        raise TypeError(msg)


def _unsendable(name: str, tensor: torch.Tensor, exc: BaseException) -> str:
    kind = "a meta tensor" if tensor.is_meta else f"a tensor of layout {tensor.layout}"
    return (
        f"a sample's tensor {name!r} is {kind}, which has no dense memory to send ({exc}); "
        "send a dense (strided) tensor with its values, e.g. tensor.to_dense()"
    )


def encode_rows(columns: Mapping[str, torch.Tensor]) -> list[bytes]:
    """The safetensors bytes of each row of ``columns``: row ``i`` is the sample
    ``{name: column[i] for name, column in columns.items()}``, encoded as :func:`encode_tensors`
    encodes it (the same bytes), with the checks made once for all rows.

    Each row is copied once, as :func:`encode_tensors` copies a sample; what a row costs beyond
    that copy is a join of its tensors' bytes (about a microsecond), not a sample's checks.

    Raises:
        TypeError: ``columns`` is not a mapping of str to tensors, or a dtype safetensors lacks.
        ValueError: it is empty, a column has no first dimension, or the columns' first
            dimensions (their numbers of rows) differ.
    """
    if type(columns) is not dict and not isinstance(columns, Mapping):
        msg = f"a batch of samples' columns are a mapping of names to tensors, got {type(columns).__name__}"
        raise TypeError(msg)
    key: list[tuple[str, torch.dtype, torch.Size]] = []
    ready: list[torch.Tensor] = []
    rows = -1
    for name, column in columns.items():
        if type(name) is not str or not isinstance(column, torch.Tensor):
            what = f"{name!r:.100} ({type(name).__name__}): {type(column).__name__}"
            msg = f"a batch of samples' columns map str to torch.Tensor, got {what}"
            raise TypeError(msg)
        if column.dim() == 0:
            msg = f"column {name!r} is a 0-d tensor: a column's first dimension is the sample"
            raise ValueError(msg)
        if rows < 0:
            rows, first = column.shape[0], name
        elif column.shape[0] != rows:
            msg = f"columns hold one row per sample: {first!r} has {rows} rows, {name!r} {column.shape[0]}"
            raise ValueError(msg)
        try:
            column = column.detach().cpu().resolve_conj().resolve_neg().contiguous()
        except (RuntimeError, NotImplementedError) as exc:  # sparse, meta...: no memory to send
            raise TypeError(_unsendable(name, column, exc)) from exc
        key.append((name, column.dtype, column.shape[1:]))
        ready.append(column)
    signature = tuple(key)
    encoding = _ENCODINGS.get(signature)
    if encoding is None:
        encoding = _encoding(signature)  # raises ValueError for no columns
    prefix, order = encoding
    # Row i of a contiguous column starts i row-sizes after its first.
    starts = [(raw, ready[index].data_ptr(), ctypes.sizeof(raw)) for index, raw in order]
    return [
        b"".join([prefix, *[raw.from_address(base + row * size) for raw, base, size in starts]])
        for row in range(rows)
    ]


_Key: TypeAlias = tuple[tuple[str, torch.dtype, torch.Size], ...]
_Raw: TypeAlias = type[ctypes.Array[ctypes.c_char]]
_ENCODINGS: dict[_Key, tuple[bytes, tuple[tuple[int, _Raw], ...]]] = {}
"""Per kind of sample: its prefix, and its tensors with bytes (index in the mapping, the ctypes
array type of their size, made once per kind), in the data's order."""


def _encoding(signature: _Key) -> tuple[bytes, tuple[tuple[int, _Raw], ...]]:
    """The length and JSON header of a sample of this kind, and the order of its tensors in the data
    (each with the ctypes array type of its size in bytes), checked and cached."""
    if not signature:
        msg = "a sample has at least one tensor"
        raise ValueError(msg)
    for name, dtype, _ in signature:
        if name == "__metadata__":  # safetensors' own entry: the receiver could not decode it
            msg = "a tensor may not be named '__metadata__' (safetensors' reserved name)"
            raise ValueError(msg)
        if dtype not in _NAMES:
            msg = f"tensor {name!r}: dtype {dtype} has no safetensors encoding here"
            raise TypeError(msg)
    order = sorted(range(len(signature)), key=lambda i: (-signature[i][1].itemsize, signature[i][0]))
    prefix = _prefix([(signature[i][0], signature[i][1], signature[i][2]) for i in order])
    tensors = tuple(
        (i, ctypes.c_char * (math.prod(signature[i][2]) * signature[i][1].itemsize))
        for i in order
        if math.prod(signature[i][2])
    )
    encoding = (prefix, tensors)
    if len(_ENCODINGS) >= _MAX_LAYOUTS:
        _ENCODINGS.clear()
    _ENCODINGS[signature] = encoding
    return encoding


def _prefix(ready: list[tuple[str, torch.dtype, torch.Size]]) -> bytes:
    """The length and JSON header of tensors of these names, dtypes and shapes, in this order."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in ready:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as the reference writes it
    return _LENGTH.pack(len(text)) + text


def _bad(why: str) -> FrameError:
    return FrameError(f"the sample's tensors do not decode: {why}")


def _entry(name: object, entry: object) -> tuple[torch.dtype, list[int], int, int]:
    """A header entry's dtype, shape and byte range, checked."""
    if not isinstance(entry, dict) or set(entry) != _TENSOR_KEYS:
        raise _bad(f"tensor {name!r:.60} is not an object of {sorted(_TENSOR_KEYS)}")
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise _bad(f"tensor {name!r:.60} has an unknown dtype {entry['dtype']!r:.40}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise _bad(f"tensor {name!r:.60} has a malformed shape {shape!r:.60}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)):
        raise _bad(f"tensor {name!r:.60} has malformed data_offsets {offsets!r:.60}")
    begin, end = offsets
    if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
        raise _bad(f"tensor {name!r:.60}: data_offsets {offsets} do not match shape {shape} of {dtype}")
    return dtype, shape, begin, end


Signature: TypeAlias = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
"""A sample's tensors' names, dtypes and shapes, by name: what samples stacked into one batch share."""


def signature_of(tensors: Mapping[str, torch.Tensor]) -> Signature:
    """The :data:`Signature` of a sample's named tensors."""
    return tuple(sorted(((name, t.dtype, tuple(t.shape)) for name, t in tensors.items()), key=lambda e: e[0]))


def describe_mismatch(signature: Signature, expected: Signature) -> tuple[str, str] | None:
    """How ``signature`` differs from ``expected``: ``(the first tensor's name that differs, what
    differs)``, or ``None`` when they are the same."""
    if signature == expected:
        return None
    names, expected_names = [e[0] for e in signature], [e[0] for e in expected]
    if names != expected_names:
        field = sorted(set(names) ^ set(expected_names))[0]
        return field, f"its tensors are {names!s:.200}, not {expected_names!s:.200}"
    for (name, dtype, shape), (_, other_dtype, other_shape) in zip(signature, expected, strict=True):
        if (dtype, shape) != (other_dtype, other_shape):
            what = (
                f"tensor {name!r:.100} has shape {list(shape)!s:.100} ({_dtype_name(dtype)}), "
                f"not {list(other_shape)!s:.100} ({_dtype_name(other_dtype)})"
            )
            return name, what
    return None  # pragma: no cover (the same names, dtypes and shapes: the same signature)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@attrs.frozen
class _Layout:
    """A checked safetensors header: each tensor's name, dtype, shape and byte range."""

    tensors: tuple[tuple[str, torch.dtype, list[int], int, int], ...]
    data_bytes: int  # what the tensors cover, exactly
    self_aligned: bool  # every tensor's offset is a multiple of its dtype's size
    signature: Signature  # made once per layout: samples of one header share the same object
    strides: tuple[tuple[int, ...], ...]  # each tensor's contiguous strides (elements), for decode_rows


def _contiguous_strides(shape: list[int]) -> tuple[int, ...]:
    strides: list[int] = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


_LAYOUTS: dict[bytes, _Layout] = {}


def _layout(text: bytes) -> _Layout:
    """The checked layout of a safetensors JSON header (cached by its bytes)."""
    layout = _LAYOUTS.get(text)
    if layout is not None:
        return layout
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _bad(f"the header is not UTF-8 JSON: {exc!s:.100}") from exc
    if not isinstance(header, dict):
        raise _bad(f"the header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise _bad("__metadata__ is not an object of strings")
    if not header:
        msg = "a sample frame holds no tensor"
        raise FrameError(msg)
    entries = [(name, *_entry(name, entry)) for name, entry in header.items()]
    covered = 0
    for *_, begin, end in sorted(entries, key=lambda e: (e[3], e[4])):
        if begin != covered:
            raise _bad(f"the tensors' bytes do not tile the data: a hole or an overlap at byte {begin}")
        covered = end
    aligned = all(begin % dtype.itemsize == 0 for _, dtype, _, begin, _ in entries)
    signature = tuple(
        sorted(((name, dtype, tuple(shape)) for name, dtype, shape, _, _ in entries), key=lambda e: e[0])
    )
    strides = tuple(_contiguous_strides(shape) for _, _, shape, _, _ in entries)
    layout = _Layout(tuple(entries), covered, aligned, signature, strides)
    if len(_LAYOUTS) >= _MAX_LAYOUTS:
        _LAYOUTS.clear()
    _LAYOUTS[text] = layout
    return layout


def address_of(data: bytearray) -> int:
    """The address of ``data``'s first byte (0 when empty): for :func:`decode_tensors`' ``address``."""
    return ctypes.addressof(ctypes.c_char.from_buffer(data)) if data else 0


def decode_tensors(
    data: bytes | bytearray | memoryview,
    start: int = 0,
    stop: int | None = None,
    *,
    address: int | None = None,
) -> dict[str, torch.Tensor]:
    """The named tensors in ``data[start:stop]`` (safetensors bytes).

    When ``data`` is a ``bytearray`` and every tensor's bytes are aligned to its dtype, the
    tensors are views of ``data`` (no copy; they keep it alive); otherwise that range is
    copied once first.  ``address`` (:func:`address_of` ``data``) saves finding it again when
    one buffer holds many samples.

    Raises:
        FrameError: the range is not safetensors bytes, or holds no tensor.
    """
    return decode_tensors_signed(data, start, stop, address=address)[0]


def decode_tensors_signed(
    data: bytes | bytearray | memoryview,
    start: int = 0,
    stop: int | None = None,
    *,
    address: int | None = None,
) -> tuple[dict[str, torch.Tensor], Signature]:
    """:func:`decode_tensors` and the tensors' :data:`Signature`, at no extra cost: samples with
    the same header share one signature object (until the cache of headers is emptied).

    Raises:
        FrameError: as :func:`decode_tensors`.
    """
    stop = len(data) if stop is None else stop
    if stop - start < _LENGTH.size:
        raise _bad(f"{stop - start} bytes are too few for a safetensors header")
    (length,) = _LENGTH.unpack_from(data, start)
    data_start = start + _LENGTH.size + length
    if length > _MAX_HEADER_BYTES or data_start > stop:
        raise _bad(f"the header announces {length} bytes, but {stop - start - _LENGTH.size} follow")
    layout = _layout(bytes(data[start + _LENGTH.size : data_start]))
    if layout.data_bytes != stop - data_start:
        msg = (
            f"the tensors cover {layout.data_bytes} bytes of data, but {stop - data_start} follow the header"
        )
        raise _bad(msg)
    buffer = data
    if not isinstance(data, bytearray) or not layout.self_aligned:
        buffer, data_start = bytearray(data[data_start:stop]), 0  # one copy, aligned by the allocator
    elif ((address_of(data) if address is None else address) + data_start) % _ALIGN:
        buffer, data_start = bytearray(data[data_start:stop]), 0
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, begin, end in layout.tensors:
        if end == begin:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            count = (end - begin) // dtype.itemsize
            flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=data_start + begin)
            tensors[name] = flat if len(shape) == 1 else flat.view(shape)  # a view costs 1.5 µs
    return tensors, layout.signature


def decode_rows(
    data: bytearray, start: int, count: int, stride: int, size: int, *, group: int
) -> tuple[list[Mapping[str, torch.Tensor]], Signature] | None:
    """The named tensors of ``count`` samples of ``size`` bytes each, at ``start``, ``start +
    stride``, ... of ``data``, decoded together when they share one header (``None`` when they
    do not, or their bytes are not aligned: decode them one by one, which also says what is wrong).

    Two torch calls per tensor name make one strided view per name, the run's columns; each
    sample's tensors are a :class:`~lamploop.streaming.sample_rows.SampleRow` of them (no torch
    call per sample).  With at most ``group`` samples, the tensors are views of
    ``data``; with more, each run of ``group`` samples is copied once first, so that a sample kept
    long (in a buffer) keeps the bytes of its group alive, not those of all ``count``.

    Raises:
        FrameError: the header the samples share does not decode.
    """
    if count < 1 or size < _LENGTH.size or stride % _ALIGN or start % _ALIGN:
        return None
    (length,) = _LENGTH.unpack_from(data, start)
    data_start = _LENGTH.size + length
    if length > _MAX_HEADER_BYTES or data_start > size or data_start % _ALIGN:
        return None
    if count * stride > len(data) - start or address_of(data) % _ALIGN:
        return None
    if not _same_headers(data, start, count, stride, data_start):
        return None  # samples of several kinds: one by one
    layout = _layout(bytes(data[start + _LENGTH.size : start + data_start]))
    if layout.data_bytes != size - data_start or not layout.self_aligned:
        return None
    if any(end == begin for _, _, _, begin, end in layout.tensors):
        return None  # an empty tensor: one by one (rare)
    samples: list[Mapping[str, torch.Tensor]] = []
    view = memoryview(data)
    for first in range(0, count, group):
        n = min(group, count - first)
        if count <= group:
            block, offset = data, start
        else:  # copied by Python (torch's copy of a large block would wake its thread pool)
            begin = start + first * stride
            block, offset = bytearray(view[begin : begin + n * stride]), 0
        columns = {}
        for (name, dtype, shape, begin, _end), strides in zip(layout.tensors, layout.strides, strict=True):
            itemsize = dtype.itemsize
            # The run's bytes as this dtype (so that its storage is the run, as a sample holds),
            # then each sample's bytes of this tensor, ``stride`` apart: (sample, *shape).
            flat = torch.frombuffer(block, dtype=dtype, count=n * stride // itemsize, offset=offset)
            columns[name] = flat.as_strided(
                (n, *shape), (stride // itemsize, *strides), (data_start + begin) // itemsize
            )
        samples.extend(map(SampleRow, repeat(columns, n), range(n)))
    return samples, layout.signature


_HEADERS_BY_NUMPY: Final = 16
"""From this many samples on, their headers are compared by one numpy call, not one by one."""


def _same_headers(data: bytearray, start: int, count: int, stride: int, header: int) -> bool:
    """Whether the ``count`` samples at ``start``, ``start + stride``, ... begin with the same
    ``header`` bytes (length and JSON)."""
    if count == 1:
        return True
    if count < _HEADERS_BY_NUMPY:
        first = data[start : start + header]
        return all(
            data[at : at + header] == first for at in range(start + stride, start + count * stride, stride)
        )
    rows = np.frombuffer(data, dtype=np.uint8, count=count * stride, offset=start).reshape(count, stride)
    return bool((rows[1:, :header] == rows[0, :header]).all())
