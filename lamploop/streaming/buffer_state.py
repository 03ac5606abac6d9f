"""A stream buffer's checkpoint state: named, immutable records read through the strict JSON converter.

:meth:`~lamploop.streaming.buffers.StreamBuffer.state_dict` is ``(tensors, meta)``: the
resident samples' tensors, resident ``i``'s tensor ``name`` as ``f"s{i}.{name}"`` (the samples'
own tensors, detached, not copies), and ``meta``, a JSON object, :class:`BufferState`
unstructured::

    {"format": "lamploop.stream-buffer/1", "policy": "firo", "capacity": 4, "watermark": 2,
     "max_reads": 2, "received": 5, "read_total": 3, "evicted": 0, "closed": false,
     "last_seq": {"a": 2, "b": 1},
     "samples": [{"producer": "a", "seq": 0, "seen": 0, "tensors": ["x"]}, ...],
     "rng": {"bit_generator": "PCG64", "state": "2791...", "inc": "2611...",
             "has_uint32": 1, "uinteger": 3853503932}}

The generator's 128-bit integers are decimal strings (a JSON number may not hold them).
This is the shape every lamploop release wrote under this format name; reading it is strict
(no unknown or missing keys, no ``"3"`` for 3) and a malformed state is refused with a
:class:`~lamploop.errors.CheckpointError` that names the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import numpy as np
import torch

from lamploop.errors import CheckpointError, ConfigurationError
from lamploop.streaming.buffer_policy import Slot
from lamploop.streaming.buffer_settings import BufferSettings, BufferStats
from lamploop.streaming.sample import Sample
from lamploop.strict_json import field_errors, strict_converter

__all__ = ["FORMAT", "BufferState", "RngState", "SampleRecord", "capture", "restore"]

FORMAT: Final = "lamploop.stream-buffer/1"

_CONVERTER: Final = strict_converter()


@attrs.frozen
class RngState:
    """A ``numpy.random.PCG64``'s state, its 128-bit integers as decimal strings."""

    bit_generator: str
    state: str
    inc: str
    has_uint32: int
    uinteger: int

    @classmethod
    def of(cls, rng: np.random.Generator) -> RngState:
        """``rng``'s bit generator's state now."""
        state = rng.bit_generator.state
        return cls(
            bit_generator=state["bit_generator"],
            state=str(state["state"]["state"]),
            inc=str(state["state"]["inc"]),
            has_uint32=int(state["has_uint32"]),
            uinteger=int(state["uinteger"]),
        )


@attrs.frozen
class SampleRecord:
    """A resident sample without its tensors: who sent it, its number, its reads, its tensor names."""

    producer: str
    seq: int
    seen: int
    tensors: tuple[str, ...]


@attrs.frozen
class BufferState:
    """A buffer's whole state but the tensors: its settings, counters, residents and generator."""

    format: str
    policy: str
    capacity: int
    watermark: int
    max_reads: int | None
    received: int
    read_total: int
    evicted: int
    closed: bool
    last_seq: dict[str, int]
    samples: tuple[SampleRecord, ...]
    rng: RngState

    def to_meta(self) -> dict[str, Any]:
        """The JSON object a checkpoint holds."""
        meta: dict[str, Any] = _CONVERTER.unstructure(self)
        return meta

    @classmethod
    def from_meta(cls, meta: object, *, owner: str) -> BufferState:
        """Read :meth:`to_meta`'s object back, strictly.

        Raises:
            CheckpointError: ``meta`` is of another format, or a field is missing, unknown or
                of the wrong type (the message names each).
        """
        if not isinstance(meta, Mapping):
            msg = f"{owner}: malformed buffer state: expected a JSON object, got {type(meta).__name__}"
            raise CheckpointError(msg)
        if meta.get("format") != FORMAT:
            msg = f"{owner}: cannot restore buffer state: format {meta.get('format')!r}, expected {FORMAT!r}"
            raise CheckpointError(msg)
        try:
            state: BufferState = _CONVERTER.structure(dict(meta), cls)
        except Exception as e:  # cattrs raises ClassValidationError (an ExceptionGroup) and friends
            msg = f"{owner}: malformed buffer state: {'; '.join(field_errors(e))}"
            raise CheckpointError(msg) from e
        return state


def capture(
    settings: BufferSettings,
    stats: BufferStats,
    last_seq: Mapping[str, int],
    slots: Sequence[Slot],
    rng: np.random.Generator,
) -> tuple[dict[str, torch.Tensor], BufferState]:
    """The state of a buffer with these settings, counters, positions, residents and generator.

    The tensors are resident ``i``'s tensor ``name`` as ``f"s{i}.{name}"`` (the samples' own
    tensors, detached, not copies).
    """
    tensors: dict[str, torch.Tensor] = {}
    records: list[SampleRecord] = []
    for i, slot in enumerate(slots):
        names = tuple(slot.sample.tensors)
        for name in names:
            tensors[f"s{i}.{name}"] = slot.sample.tensors[name].detach()
        records.append(SampleRecord(slot.sample.producer, slot.sample.seq, slot.seen, names))
    state = BufferState(
        format=FORMAT,
        policy=settings.policy.name,
        capacity=settings.capacity,
        watermark=settings.watermark,
        max_reads=settings.max_reads,
        received=stats.received,
        read_total=stats.read_total,
        evicted=stats.evicted,
        closed=stats.closed,
        last_seq=dict(last_seq),
        samples=tuple(records),
        rng=RngState.of(rng),
    )
    return tensors, state


def restore(
    state: BufferState, tensors: Mapping[str, torch.Tensor], *, owner: str, settings: BufferSettings
) -> tuple[list[Slot], np.random.Generator]:
    """The residents and the generator of ``state``, checked against a buffer with these ``settings``.

    A state restores only into a buffer of the same policy, capacity, watermark and
    max_reads as the one that saved it (the seed may differ: the generator is restored).

    Raises:
        CheckpointError: the state is of another buffer, a count is negative, a sample was
            read ``max_reads`` times, there are more residents than ``capacity``, a tensor is
            missing or unexpected, or the generator's state is not a PCG64's.
    """

    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"{owner}: cannot restore buffer state: {what}")

    def counts(value: int, what: str) -> int:
        if value < 0:
            raise fail(f"{what} is {value!r}, not an int >= 0")
        return value

    mine = {
        "policy": settings.policy.name,
        "capacity": settings.capacity,
        "watermark": settings.watermark,
        "max_reads": settings.max_reads,
    }
    for key, value in mine.items():
        saved = getattr(state, key)
        if saved != value:
            raise fail(f"it is of a buffer with {key}={saved!r}, this one has {key}={value!r}")
    for name in ("received", "read_total", "evicted"):
        counts(getattr(state, name), name)
    for producer, seq in state.last_seq.items():
        counts(seq, f"last_seq[{producer!r}]")
    max_reads = state.max_reads
    slots: list[Slot] = []
    expected: set[str] = set()
    for i, record in enumerate(state.samples):
        seen = counts(record.seen, f"samples[{i}].seen")
        if max_reads is not None and seen >= max_reads:
            raise fail(f"samples[{i}] was read {seen} times, max_reads={max_reads}")
        keys = [f"s{i}.{name}" for name in record.tensors]
        missing = [key for key in keys if key not in tensors]
        if missing:
            raise fail(f"tensors {missing} are missing")
        expected.update(keys)
        for key in keys:
            if not isinstance(tensors[key], torch.Tensor):
                what = type(tensors[key]).__name__
                raise fail(f"tensor {key!r:.100} of samples[{i}] is a {what}, not a torch.Tensor")
        try:
            sample = Sample(
                producer=record.producer,
                seq=counts(record.seq, f"samples[{i}].seq"),
                tensors={name: tensors[key] for name, key in zip(record.tensors, keys, strict=True)},
            )
        except ConfigurationError as exc:
            raise fail(f"samples[{i}]: {exc}") from None
        slots.append(Slot(sample, seen))
    if len(slots) > state.capacity:
        raise fail(f"it holds {len(slots)} samples, capacity={state.capacity}")
    extra = sorted(set(tensors) - expected)
    if extra:
        raise fail(f"unexpected tensors {extra[:5]}")
    return slots, _generator(state.rng, fail)


def _generator(record: RngState, fail: Callable[[str], CheckpointError]) -> np.random.Generator:
    if record.bit_generator != "PCG64":
        raise fail(f"generator {record.bit_generator!r}, expected 'PCG64'")
    numbers = {}
    for name in ("state", "inc"):
        text = getattr(record, name)
        if not (text.isascii() and text.isdecimal()):
            raise fail(f"rng.{name} is {text!r}, not a decimal integer")
        numbers[name] = int(text)
    for name in ("has_uint32", "uinteger"):
        if getattr(record, name) < 0:
            raise fail(f"rng.{name} is {getattr(record, name)!r}, not an int >= 0")
    bit_generator = np.random.PCG64()
    try:
        bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": numbers["state"], "inc": numbers["inc"]},
            "has_uint32": record.has_uint32,
            "uinteger": record.uinteger,
        }
    except (TypeError, ValueError, OverflowError) as e:
        raise fail(f"rng: numpy refused the generator state ({e})") from e
    return np.random.Generator(bit_generator)
