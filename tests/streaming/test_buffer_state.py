"""A buffer's checkpoint state (:mod:`lamploop.streaming.buffer_state`): the on-disk shape, the
strict reading, and the errors that name the field at fault.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import safetensors.torch
import torch

from lamploop.errors import CheckpointError
from lamploop.streaming.buffer_state import FORMAT, BufferState, RngState, SampleRecord
from lamploop.streaming.buffers import FifoBuffer, FiroBuffer, ReservoirBuffer, StreamBuffer
from lamploop.streaming.sample import Sample

# States written by the buffers before they were split into StreamBuffer and its policies
# (lamploop e54f9fb): the samples' tensors are ``{"x": tensor([float(seq)])}``; after
# ``close()``, the buffer drains in the order listed.
WRITTEN_BEFORE: dict[str, tuple[dict[str, Any], list[list[Any]]]] = {
    "fifo": (
        {
            "format": "lamploop.stream-buffer/1",
            "policy": "fifo",
            "capacity": 4,
            "watermark": 2,
            "max_reads": 2,
            "received": 4,
            "read_total": 3,
            "evicted": 0,
            "closed": False,
            "last_seq": {"a": 1, "b": 1},
            "samples": [
                {"producer": "a", "seq": 0, "seen": 1, "tensors": ["x"]},
                {"producer": "b", "seq": 1, "seen": 0, "tensors": ["x"]},
                {"producer": "b", "seq": 0, "seen": 1, "tensors": ["x"]},
                {"producer": "a", "seq": 1, "seen": 1, "tensors": ["x"]},
            ],
            "rng": {
                "bit_generator": "PCG64",
                "state": "35399562948360463058890781895381311971",
                "inc": "87136372517582989555478159403783844777",
                "has_uint32": 0,
                "uinteger": 0,
            },
        },
        [["a", 0], ["b", 1], ["b", 0], ["a", 1], ["b", 1]],
    ),
    "firo": (
        {
            "format": "lamploop.stream-buffer/1",
            "policy": "firo",
            "capacity": 4,
            "watermark": 2,
            "max_reads": 2,
            "received": 5,
            "read_total": 3,
            "evicted": 0,
            "closed": False,
            "last_seq": {"a": 2, "b": 1},
            "samples": [
                {"producer": "a", "seq": 0, "seen": 0, "tensors": ["x"]},
                {"producer": "b", "seq": 0, "seen": 0, "tensors": ["x"]},
                {"producer": "b", "seq": 1, "seen": 1, "tensors": ["x"]},
                {"producer": "a", "seq": 2, "seen": 0, "tensors": ["x"]},
            ],
            "rng": {
                "bit_generator": "PCG64",
                "state": "27918536718431171529490245195331880398",
                "inc": "261136684632268670825940853076396136793",
                "has_uint32": 1,
                "uinteger": 3853503932,
            },
        },
        [["a", 2], ["b", 1], ["a", 2], ["b", 0], ["a", 0], ["a", 0], ["b", 0]],
    ),
    "reservoir": (
        {
            "format": "lamploop.stream-buffer/1",
            "policy": "reservoir",
            "capacity": 3,
            "watermark": 2,
            "max_reads": None,
            "received": 9,
            "read_total": 3,
            "evicted": 6,
            "closed": False,
            "last_seq": {"a": 4, "b": 3},
            "samples": [
                {"producer": "a", "seq": 4, "seen": 1, "tensors": ["x"]},
                {"producer": "b", "seq": 1, "seen": 1, "tensors": ["x"]},
                {"producer": "b", "seq": 3, "seen": 0, "tensors": ["x"]},
            ],
            "rng": {
                "bit_generator": "PCG64",
                "state": "69277902251545625047243999639177715869",
                "inc": "261136684632268670825940853076396136793",
                "has_uint32": 1,
                "uinteger": 1289204377,
            },
        },
        [["a", 4], ["b", 3], ["b", 1]],
    ),
}


def _buffer(policy: str) -> StreamBuffer:
    if policy == "fifo":
        return FifoBuffer(capacity=4, watermark=2, max_reads=2)
    if policy == "firo":
        return FiroBuffer(capacity=4, watermark=2, seed=7, max_reads=2)
    return ReservoirBuffer(capacity=3, watermark=2, seed=7)


def _tensors(meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"s{i}.x": torch.tensor([float(r["seq"])]) for i, r in enumerate(meta["samples"])}


def _drain(buffer: StreamBuffer) -> list[list[Any]]:
    buffer.close()
    order = []
    while not buffer.ended:
        order.append(list(buffer.try_get().key))  # type: ignore[union-attr]
    return order


@pytest.mark.parametrize("policy", sorted(WRITTEN_BEFORE))
def test_a_state_written_before_the_split_loads_and_continues_its_draws(policy: str) -> None:
    meta, drained = WRITTEN_BEFORE[policy]
    buffer = _buffer(policy)
    buffer.load_state_dict(_tensors(meta), meta)
    assert buffer.state_dict()[1] == meta  # written back in the same shape
    assert _drain(buffer) == drained


@pytest.mark.parametrize("policy", sorted(WRITTEN_BEFORE))
def test_the_state_round_trips_through_json_and_safetensors(policy: str) -> None:
    meta, _ = WRITTEN_BEFORE[policy]
    state = BufferState.from_meta(json.loads(json.dumps(meta)), owner="test")
    assert isinstance(state.rng, RngState)
    assert all(isinstance(s, SampleRecord) for s in state.samples)
    assert state.format == FORMAT
    assert BufferState.from_meta(json.loads(json.dumps(state.to_meta())), owner="test") == state
    buffer = _buffer(policy)
    buffer.load_state_dict(_tensors(state.to_meta()), state.to_meta())
    tensors, meta = buffer.state_dict()
    on_disk = safetensors.torch.load(safetensors.torch.save({k: t.contiguous() for k, t in tensors.items()}))
    restored = _buffer(policy)
    restored.load_state_dict(on_disk, json.loads(json.dumps(meta)))
    assert restored.stats() == buffer.stats()
    assert _drain(restored) == _drain(buffer)


def _meta(**changes: Any) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads(json.dumps(WRITTEN_BEFORE["firo"][0]))
    for path, value in changes.items():
        target = meta
        *parents, last = path.split("__")
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[last] = value
    return meta


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ([1], "malformed buffer state: expected a JSON object, got list"),
        ({k: v for k, v in _meta().items() if k != "rng"}, "malformed buffer state: rng: missing"),
        (_meta(received="3"), r"malformed buffer state: received: expected an integer, got '3' \(str\)"),
        (_meta(closed=1), "malformed buffer state: closed: expected true or false, got 1"),
        (_meta(colour="red"), "malformed buffer state: unknown field colour"),
        (_meta(max_reads="2"), "malformed buffer state: max_reads: expected an integer"),
        (_meta(samples={}), "malformed buffer state: samples: expected a list"),
        (_meta(samples__0__seq="0"), r"malformed buffer state: samples\[0\].seq: expected an integer"),
        (
            _meta(samples__1__producer=None),
            r"malformed buffer state: samples\[1\].producer: expected a string",
        ),
        (_meta(last_seq={"a": 1.5}), r"malformed buffer state: last_seq\['a'\]: expected an integer"),
        (_meta(rng__uinteger="1"), "malformed buffer state: rng.uinteger: expected an integer"),
        (
            _meta(samples__0__seen=-1),
            r"cannot restore buffer state: samples\[0\].seen is -1",
        ),
        (_meta(last_seq={"a": -2}), r"cannot restore buffer state: last_seq\['a'\] is -2, not an int >= 0"),
        (_meta(rng__state="12x"), "cannot restore buffer state: rng.state is '12x', not a decimal integer"),
        (
            _meta(rng__bit_generator="MT19937"),
            "cannot restore buffer state: generator 'MT19937', expected 'PCG64'",
        ),
        (_meta(rng__inc=str(2**130)), "cannot restore buffer state: rng: numpy refused the generator state"),
        (
            _meta(format="lamploop.stream-buffer/2"),
            "cannot restore buffer state: format 'lamploop.stream-buffer/2', expected",
        ),
        (
            _meta(watermark=3),
            "cannot restore buffer state: it is of a buffer with watermark=3, this one has watermark=2",
        ),
    ],
)
def test_a_malformed_state_is_refused_naming_the_field(meta: Any, message: str) -> None:
    buffer = FiroBuffer(capacity=4, watermark=2, seed=7, max_reads=2)
    buffer.try_put(Sample("z", 0, {"x": torch.zeros(1)}))
    before = buffer.state_dict()[1]
    with pytest.raises(CheckpointError, match=f"^FiroBuffer: {message}"):
        buffer.load_state_dict(_tensors(_meta()), meta)
    assert buffer.state_dict()[1] == before  # a refused state changes nothing


def test_more_residents_than_capacity_are_refused() -> None:
    meta = _meta()
    meta["samples"].append({"producer": "c", "seq": 0, "seen": 0, "tensors": ["x"]})
    with pytest.raises(CheckpointError, match="it holds 5 samples, capacity=4"):
        FiroBuffer(capacity=4, watermark=2, seed=7, max_reads=2).load_state_dict(_tensors(meta), meta)
