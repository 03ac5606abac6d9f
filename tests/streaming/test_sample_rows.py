"""Received samples are rows of their run's columns, and ``stack_samples`` slices those columns.

The reference for every tensor is safetensors' own decoder (``safetensors.torch.load``) of the
bytes each sample was sent as, and ``torch.stack`` of those tensors for every batch: whatever
order the buffer reads the rows in (consecutive, across runs and frames, drawn at random,
mixed with samples that were never on the wire), the batch must equal it bitwise, and must be
a copy, as ``torch.stack``'s result is.
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load

from lamploop.errors import ConfigurationError, SampleMismatchError
from lamploop.streaming import Sample, stack_samples
from lamploop.streaming.sample_rows import SampleRow, stack_rows
from lamploop.streaming.tensor_bytes import DTYPES, encode_tensors
from lamploop.streaming.wire import SamplesFrame, decode_body, encode_frame


def _sent(first: int, count: int, floats: int = 6) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(first)
    return [
        {"x": torch.randn(floats, 2, generator=generator, dtype=torch.float64), "y": torch.tensor(first + i)}
        for i in range(count)
    ]


def _received(producer: str, first: int, sent: list[dict[str, torch.Tensor]]) -> list[Sample]:
    """The samples as a receiver puts them in its buffer: decoded from the frame's bytes."""
    message = decode_body(bytearray(encode_frame(SamplesFrame(producer, first, sent))[4:]))
    assert isinstance(message, SamplesFrame)
    return [Sample(producer, first + i, tensors) for i, tensors in enumerate(message.samples)]


def _reference(sent: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each sample through safetensors' own decoder, from the bytes it was sent as."""
    return [load(encode_tensors(tensors)) for tensors in sent]


def _stacked(reference: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([r["x"] for r in reference]), torch.stack([r["y"] for r in reference])


def test_a_received_sample_is_a_read_only_row_equal_to_safetensors_decoding() -> None:
    sent = _sent(0, 5)
    samples = _received("sim", 0, sent)
    for sample, expected in zip(samples, _reference(sent), strict=True):
        row = sample.tensors
        assert type(row) is SampleRow  # kept as the receiver made it, not copied into a dict
        assert sorted(row) == ["x", "y"]
        assert len(row) == 2
        assert "x" in row
        assert "z" not in row
        for name in ("x", "y"):
            assert torch.equal(row[name], expected[name])
            assert row[name].dtype == expected[name].dtype
        assert dict(row).keys() == expected.keys()
        with pytest.raises(TypeError):
            row["x"] = torch.zeros(1)  # type: ignore[index]
    assert "index=3" in repr(samples[3].tensors)
    assert "(6, 2)" in repr(samples[3].tensors)


def test_a_sample_made_from_a_dict_still_copies_the_dict() -> None:
    tensors = {"x": torch.zeros(2), "y": torch.tensor(0)}
    sample = Sample("sim", 0, tensors)
    tensors["x"] = torch.ones(2)
    assert type(sample.tensors) is dict
    assert torch.equal(sample.tensors["x"], torch.zeros(2))


def _orders(count: int) -> dict[str, list[int]]:
    shuffled = list(range(count))
    random.Random(7).shuffle(shuffled)
    return {
        "consecutive": list(range(count)),
        "from the middle": list(range(3, 13)),
        "backwards": list(range(count - 1, -1, -1)),
        "drawn at random": shuffled[:11],
        "one": [4],
        "repeated": [2, 2, 3, 3, 2],
    }


@pytest.mark.parametrize("order", list(_orders(20)))
def test_stack_samples_of_rows_in_any_order_equals_torch_stack_of_safetensors_decoding(order: str) -> None:
    sent = _sent(0, 20)
    samples = _received("sim", 0, sent)
    picked = _orders(20)[order]
    x, y = stack_samples()([samples[i] for i in picked])
    expected_x, expected_y = _stacked([_reference(sent)[i] for i in picked])
    assert torch.equal(x, expected_x)
    assert x.dtype == torch.float64
    assert torch.equal(y, expected_y)
    assert y.dtype == torch.int64
    assert x.is_contiguous()
    assert y.is_contiguous()


def test_a_batch_across_frames_producers_and_samples_not_received_equals_torch_stack() -> None:
    sent_a, sent_b, sent_c = _sent(0, 7), _sent(100, 9), _sent(200, 3)
    a, b = _received("sim-a", 0, sent_a), _received("sim-b", 0, sent_b)
    local = [Sample("local", i, tensors) for i, tensors in enumerate(sent_c)]
    ref_a, ref_b, ref_c = _reference(sent_a), _reference(sent_b), _reference(sent_c)
    for batch, reference in (
        (a[4:] + b[:5] + a[:2], ref_a[4:] + ref_b[:5] + ref_a[:2]),  # rows of two frames
        (b[6:] + local + a[:1], ref_b[6:] + ref_c + ref_a[:1]),  # and samples that were never sent
    ):
        x, y = stack_samples()(batch)
        expected_x, expected_y = _stacked(reference)
        assert torch.equal(x, expected_x)
        assert torch.equal(y, expected_y)
    assert stack_rows([s.tensors for s in b[6:] + local], "x") is None  # not all rows: one by one


def test_a_batch_of_rows_is_a_copy_that_changes_no_buffered_sample() -> None:
    sent = _sent(0, 8)
    samples = _received("sim", 0, sent)
    x, y = stack_samples()(samples[2:6])
    x.zero_()
    y.fill_(-1)
    for sample, expected in zip(samples, _reference(sent), strict=True):
        assert torch.equal(sample.tensors["x"], expected["x"])
        assert torch.equal(sample.tensors["y"], expected["y"])


def test_a_missing_tensor_or_rows_of_another_shape_are_named_as_for_dict_samples() -> None:
    samples = _received("sim", 0, _sent(0, 4))
    with pytest.raises(ConfigurationError, match=r"no tensor 'z'.*\['x', 'y'\]"):
        stack_samples(features="z")(samples)
    other = _received("sim", 4, _sent(4, 2, floats=5))  # another frame, rows of another shape
    with pytest.raises(SampleMismatchError, match="seq 4 of producer 'sim'") as caught:
        stack_samples()(samples + other)
    assert (caught.value.shape, caught.value.expected_shape) == ((5, 2), (6, 2))


def test_a_sample_alone_in_its_frame_or_among_samples_of_other_kinds_is_a_row_too() -> None:
    """Decoded one by one (a frame of one sample; a frame whose samples differ in kind), each
    sample's tensors are still a read-only SampleRow equal to safetensors' decoding, and
    stack_samples stacks them."""
    alone = _sent(0, 1)
    mixed = [*_sent(10, 2), *_sent(20, 2, floats=3)]
    for sent in (alone, mixed):
        samples = _received("sim", 0, sent)
        for sample, expected in zip(samples, _reference(sent), strict=True):
            assert type(sample.tensors) is SampleRow
            with pytest.raises(TypeError):
                sample.tensors["x"] = torch.zeros(1)  # type: ignore[index]
            for name in ("x", "y"):
                assert torch.equal(sample.tensors[name], expected[name])
    x, y = stack_samples()(_received("sim", 0, mixed)[2:])
    expected_x, expected_y = _stacked(_reference(mixed)[2:])
    assert torch.equal(x, expected_x)
    assert torch.equal(y, expected_y)


def _every_dtype(seed: int) -> dict[str, torch.Tensor]:
    """A sample with a tensor of every dtype the codec knows, of several ranks (a scalar, 1-D,
    3-D), so that the columns' strides and offsets are checked for each item size."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (64,), generator=generator, dtype=torch.uint8)
    tensors: dict[str, torch.Tensor] = {}
    shapes: list[tuple[int, ...]] = [(), (3,), (2, 1, 3)]
    for i, (name, dtype) in enumerate(sorted(DTYPES.items())):
        shape = shapes[i % len(shapes)]
        count = max(1, torch.Size(shape).numel())
        raw = bits[: count * dtype.itemsize].clone()
        if dtype == torch.bool:
            raw = raw % 2
        tensors[name.lower()] = raw.view(dtype).reshape(shape)
    return tensors


@pytest.mark.parametrize("count", [1, 3, 15, 16, 40])
def test_rows_of_every_dtype_and_rank_equal_safetensors_decoding_bitwise(count: int) -> None:
    # 15 and 16 samples: the two ways a run's headers are compared; 40 samples of about 200
    # bytes: a frame decoded in several copied runs.
    sent = [_every_dtype(seed) for seed in range(count)]
    received = _received("sim", 0, sent)
    if count > 1:  # decoded together: rows of one run's columns, not samples decoded one by one
        assert received[0].tensors.columns is received[1].tensors.columns  # type: ignore[attr-defined]
    for sample, expected in zip(received, _reference(sent), strict=True):
        row = sample.tensors
        assert type(row) is SampleRow
        assert row.keys() == expected.keys()
        for name, tensor in expected.items():
            ours = row[name]
            assert (ours.dtype, ours.shape) == (tensor.dtype, tensor.shape), name
            assert torch.equal(ours.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("count", [3, 20])
def test_samples_of_one_size_but_different_headers_are_not_decoded_as_one_run(count: int) -> None:
    # float32 and int32 tensors of one shape: the same sizes, headers that differ in one byte.
    sent = [{"x": torch.arange(4, dtype=torch.float32 if i % 2 else torch.int32) + i} for i in range(count)]
    assert len({len(encode_tensors(tensors)) for tensors in sent}) == 1
    received = _received("sim", 0, sent)
    for sample, expected in zip(received, _reference(sent), strict=True):
        assert sample.tensors["x"].dtype == expected["x"].dtype
        assert torch.equal(sample.tensors["x"], expected["x"])
