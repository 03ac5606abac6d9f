"""``send_rows``: a batch of samples handed over as columns, one sample per row.

The encoding is checked against safetensors' own decoder and against the one-sample encoder
(itself checked against safetensors' encoder in tests/streaming/test_tensor_bytes.py); the
producers against a real receiver over a real socket: the buffer holds each row as a sample,
in order, between the samples sent one by one around it.
"""

from __future__ import annotations

import secrets

import anyio
import pytest
import torch
from safetensors.torch import load

from lamploop.errors import FrameError
from lamploop.streaming import FifoBuffer
from lamploop.streaming.producer import AsyncProducer, BlockingProducer
from lamploop.streaming.receiver import SampleReceiver
from lamploop.streaming.tensor_bytes import DTYPES, encode_rows, encode_tensors

pytestmark = pytest.mark.anyio


def _column(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 100, shape, generator=generator, dtype=torch.int64)
    if dtype == torch.bool:
        return values % 2 == 1
    return values.to(dtype)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_each_row_is_the_sample_of_that_row_for_every_dtype(dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    columns = {
        "state": _column(dtype, (5, 2, 3), 0),
        "scalar": _column(dtype, (5,), 1),
        "nothing": _column(dtype, (5, 0), 2),
        "time": torch.arange(5, dtype=torch.float64),
    }
    rows = encode_rows(columns)
    assert len(rows) == 5
    for i, row in enumerate(rows):
        sample = {name: column[i] for name, column in columns.items()}
        assert row == encode_tensors(sample)
        decoded = load(row)  # safetensors' own decoder
        assert set(decoded) == set(sample)
        for name, tensor in sample.items():
            assert decoded[name].dtype == tensor.dtype
            assert decoded[name].shape == tensor.shape
            as_bytes = decoded[name].reshape(-1).view(torch.uint8)
            assert torch.equal(as_bytes, tensor.contiguous().reshape(-1).view(torch.uint8))


def test_columns_that_are_views_are_encoded_by_their_values() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    complex_base = torch.randn(3, 4, dtype=torch.complex64)
    cases = [
        {"x": base.t()},  # not contiguous: rows of 4 from a 6 x 4 view
        {"x": base[:, ::2]},  # strided
        {"x": base[1:3]},  # offset
        {"x": torch.zeros(3, 1).expand(3, 5)},  # expanded
        {"z": complex_base.conj()},  # a lazy conjugate
        {"w": torch.randn(3, 2, requires_grad=True)},
        {"i": complex_base.conj().imag},  # real, with the negative bit set
    ]
    for columns in cases:
        rows = encode_rows(columns)
        name, column = next(iter(columns.items()))
        expected = column.detach().resolve_conj().resolve_neg()
        assert len(rows) == column.shape[0]
        for i, row in enumerate(rows):
            assert torch.equal(load(row)[name], expected[i])


def test_no_rows_is_no_samples() -> None:
    assert encode_rows({"x": torch.zeros(0, 3)}) == []


@pytest.mark.parametrize(
    ("columns", "error", "words"),
    [
        ({"x": torch.zeros(3), "y": torch.zeros(4, 2)}, ValueError, ["'x' has 3 rows", "'y' 4"]),
        ({"x": torch.tensor(1.0)}, ValueError, ["'x'", "0-d"]),
        ({}, ValueError, ["at least one tensor"]),
        ({"x": [1.0, 2.0]}, TypeError, ["str to torch.Tensor", "list"]),
        ({1: torch.zeros(2)}, TypeError, ["str to torch.Tensor", "int"]),
        ([torch.zeros(2)], TypeError, ["mapping", "list"]),
        ({"x": torch.zeros(2, 2, dtype=torch.complex128)}, TypeError, ["'x'", "complex128"]),
    ],
    ids=["rows-differ", "zero-d", "empty", "not-a-tensor", "name-not-str", "not-a-mapping", "dtype"],
)
def test_bad_columns_are_refused_naming_what_is_wrong(columns: object, error: type, words: list[str]) -> None:
    with pytest.raises(error) as raised:
        encode_rows(columns)  # type: ignore[arg-type]
    for word in words:
        assert word in str(raised.value)


async def _received(buffer: FifoBuffer) -> list[dict[str, torch.Tensor]]:
    buffer.close()
    return [dict(sample.tensors) async for sample in buffer]


def _expected(columns: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    count = next(iter(columns.values())).shape[0]
    return [{name: column[i] for name, column in columns.items()} for i in range(count)]


def _assert_same(got: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(expected)
    for sample, reference in zip(got, expected, strict=True):
        assert set(sample) == set(reference)
        for name, tensor in reference.items():
            assert torch.equal(torch.as_tensor(sample[name]), tensor)


def _batches() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    small = {"x": torch.randn(150, 256), "id": torch.arange(150)}  # 1 KiB rows, over two hand-over chunks
    large = {"x": torch.randn(20, 16384), "id": torch.arange(150, 170)}  # 64 KiB rows, over 1 MiB
    alone = {"x": torch.randn(256), "id": torch.tensor(170)}
    return small, large, alone


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["async", "blocking"])
async def test_a_producer_sends_each_row_as_a_sample_in_order(kind: str) -> None:
    token = secrets.token_hex(16)
    small, large, alone = _batches()
    buffer = FifoBuffer(capacity=1000, watermark=1)
    seqs: list[int] = []

    def simulate(address: tuple[str, int]) -> None:
        with BlockingProducer(address, name="sim", token=token) as producer:
            seqs.extend(producer.send_rows(small))
            seqs.append(producer.send(alone))
            seqs.extend(producer.send_rows(large))
            assert producer.send_rows({"x": torch.zeros(0, 2)}) == []

    with anyio.fail_after(25):
        async with SampleReceiver(
            buffer, token=token, expected_producers=["sim"], uniform_samples=False
        ) as receiver:
            if kind == "blocking":
                await anyio.to_thread.run_sync(simulate, receiver.address)
            else:
                async with AsyncProducer(receiver.address, name="sim", token=token) as producer:
                    seqs.extend(await producer.send_rows(small))
                    seqs.append(await producer.send(alone))
                    seqs.extend(await producer.send_rows(large))
                    assert await producer.send_rows({"x": torch.zeros(0, 2)}) == []
            await receiver.wait_all_done()
        got = await _received(buffer)
    assert seqs == list(range(171))
    _assert_same(got, [*_expected(small), alone, *_expected(large)])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["async", "blocking"])
async def test_rows_too_large_for_a_frame_are_refused_and_nothing_is_kept(kind: str) -> None:
    token = secrets.token_hex(16)
    buffer = FifoBuffer(capacity=100, watermark=1)
    limit = 64 * 1024
    too_large = {"x": torch.zeros(3, 16384)}  # 64 KiB rows: over the frame limit with their header
    fine = {"x": torch.ones(3, 16)}
    outcome: dict[str, object] = {}

    def simulate(address: tuple[str, int]) -> None:
        with BlockingProducer(address, name="sim", token=token, max_frame_bytes=limit) as producer:
            with pytest.raises(FrameError) as raised:
                producer.send_rows(too_large)
            outcome["error"] = raised.value
            outcome["seqs"] = producer.send_rows({"x": torch.ones(3, 16)})

    with anyio.fail_after(25):
        async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:
            if kind == "blocking":
                await anyio.to_thread.run_sync(simulate, receiver.address)
            else:
                async with AsyncProducer(
                    receiver.address, name="sim", token=token, max_frame_bytes=limit
                ) as p:
                    with pytest.raises(FrameError) as raised:
                        await p.send_rows(too_large)
                    outcome["error"] = raised.value
                    outcome["seqs"] = await p.send_rows(fine)
            await receiver.wait_all_done()
        got = await _received(buffer)
    assert str(limit) in str(outcome["error"])
    assert outcome["seqs"] == [0, 1, 2]  # the refused rows took no seq
    _assert_same(got, _expected(fine))
