"""The receiver's batch-at-once paths against references written here, one sample at a time.

A frame's samples are checked, kept and stacked by a few calls over the whole batch
(``StreamBuffer.try_put_many``'s check for one producer in order, ``payload_offsets`` for
samples of one size, ``row_runs``/``stack_runs`` for a batch of rows).  Each must give what
the one-at-a-time definition gives, for batches the fast path takes and for those it hands back
to the general path: the same samples kept, the same error, the same tensors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lamploop.errors import BufferClosedError, DuplicateSampleError, FrameError
from lamploop.streaming import FifoBuffer, Sample
from lamploop.streaming.sample_rows import SampleRow, row_runs, stack_rows, stack_runs
from lamploop.streaming.samples_payload import payload_offsets

# -- try_put_many: "exactly like try_put on each in turn ... all checks come first" --


class ReferenceFifo:
    """The documented semantics of a FIFO buffer's puts, one sample at a time."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.resident: list[tuple[str, int]] = []
        self.last: dict[str, int] = {}
        self.closed = False

    def try_put_many(self, keys: list[tuple[str, int]]) -> int:
        if keys and self.closed:
            raise BufferClosedError
        listed: dict[str, int] = {}
        for producer, seq in keys:  # every check first: nothing is taken when one fails
            previous = listed.get(producer, self.last.get(producer))
            if previous is not None and seq <= previous:
                raise DuplicateSampleError
            listed[producer] = seq
        taken = 0
        for producer, seq in keys:
            if len(self.resident) >= self.capacity:
                break
            self.resident.append((producer, seq))
            self.last[producer] = seq
            taken += 1
        return taken


def _sample(producer: str, seq: int) -> Sample:
    return Sample(producer, seq, {"x": torch.tensor([float(seq)])})


batches = st.lists(
    st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 30)), max_size=8),
    min_size=1,
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(batches=batches, capacity=st.integers(1, 10), reads=st.lists(st.integers(0, 4), max_size=12))
def test_try_put_many_keeps_and_refuses_what_puts_one_by_one_would(
    batches: list[list[tuple[str, int]]], capacity: int, reads: list[int]
) -> None:
    buffer, reference = FifoBuffer(capacity=capacity, watermark=1), ReferenceFifo(capacity)
    for i, keys in enumerate(batches):
        expected: int | type[Exception]
        try:
            expected = reference.try_put_many(keys)
        except (BufferClosedError, DuplicateSampleError) as error:
            expected = type(error)
        try:
            got: int | type[Exception] = buffer.try_put_many([_sample(p, s) for p, s in keys])
        except (BufferClosedError, DuplicateSampleError) as error:
            got = type(error)
        assert got == expected, (keys, reference.last)
        for _ in range(reads[i] if i < len(reads) else 0):  # make room, FIFO order
            sample = buffer.try_get()
            if sample is None:
                assert not reference.resident
                break
            assert sample.key == reference.resident.pop(0)
    assert [slot.sample.key for slot in buffer._resident] == reference.resident


def test_a_partly_taken_run_counts_only_what_was_taken() -> None:
    """A full buffer takes a prefix of one producer's run: the rest may come again, the taken may not."""
    buffer = FifoBuffer(capacity=3, watermark=1)
    assert buffer.try_put_many([_sample("p", seq) for seq in range(5)]) == 3
    assert buffer.try_get() is not None
    assert buffer.try_put_many([_sample("p", 3), _sample("p", 4)]) == 1  # room for one
    with pytest.raises(DuplicateSampleError, match=r"seq 3 is not after 3"):
        buffer.try_put_many([_sample("p", 3)])
    buffer.close()
    with pytest.raises(BufferClosedError, match=r"put after close"):
        buffer.try_put_many([_sample("p", 9), _sample("p", 10)])


# -- payload_offsets: each sample 8-aligned, one after the other --


def _reference_offsets(start: int, payload: int, sizes: list[object]) -> list[int] | None:
    """The offsets, or ``None`` where the frame is malformed."""
    if not 1 <= len(sizes) <= 4096 or start % 8:
        return None
    offsets, offset = [], start
    for size in sizes:
        if type(size) is not int or size < 0:
            return None
        offsets.append(offset)
        offset += -(-size // 8) * 8
    return offsets if offset == start + payload else None


sizes_lists = st.one_of(
    st.integers(0, 40).flatmap(lambda size: st.lists(st.just(size), min_size=1, max_size=20)),
    st.lists(st.one_of(st.integers(-2, 40), st.just(True), st.just(8.0)), min_size=0, max_size=20),
)


@settings(max_examples=500, deadline=None)
@given(sizes=sizes_lists, start=st.sampled_from([0, 8, 16, 4]), slack=st.sampled_from([0, 0, 0, 8, -8, 1]))
@example(sizes=[8, 8.0], start=0, slack=8)  # equal to 8, but not an int
@example(sizes=[1, True], start=0, slack=8)
@example(sizes=[3, 3, 3], start=8, slack=0)
def test_payload_offsets_are_the_aligned_running_sum_or_a_frame_error(
    sizes: list[object], start: int, slack: int
) -> None:
    payload = sum(-(-s // 8) * 8 for s in sizes if type(s) is int and s > 0) + slack
    expected = _reference_offsets(start, payload, sizes)
    if expected is None:
        with pytest.raises(FrameError, match="malformed 'samples' message"):
            payload_offsets(start, payload, sizes)
    else:
        assert payload_offsets(start, payload, sizes) == expected


# -- row_runs / stack_runs: torch.stack of the rows, one slice per run --


@settings(max_examples=200, deadline=None)
@given(picks=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), min_size=1, max_size=24))
def test_stacked_rows_equal_torch_stack_of_the_rows(picks: list[tuple[int, int]]) -> None:
    generator = torch.Generator().manual_seed(len(picks))
    runs = [
        {"x": torch.randn(6, 3, generator=generator), "y": torch.randint(0, 9, (6,), generator=generator)}
        for _ in range(3)
    ]
    rows = [SampleRow(runs[run], index) for run, index in picks]
    found = row_runs(rows)
    assert found is not None
    assert sum(end - first for _, first, end in found) == len(rows)
    for name in ("x", "y"):
        expected = torch.stack([runs[run][name][index] for run, index in picks])
        stacked = stack_runs(found, name)
        assert torch.equal(stacked, expected)
        assert stacked.is_contiguous()
        stacked.add_(1)  # a copy: the buffered samples do not change
        assert torch.equal(torch.stack([row[name] for row in rows]), expected)
        assert torch.equal(stack_rows(rows, name), expected)  # type: ignore[arg-type]


def test_rows_that_are_not_all_received_rows_are_stacked_one_by_one() -> None:
    columns = {"x": torch.zeros(2, 3)}
    assert row_runs([SampleRow(columns, 0), {"x": torch.zeros(3)}]) is None
    assert row_runs([]) is None
    assert stack_rows([{"x": torch.zeros(3)}], "x") is None
