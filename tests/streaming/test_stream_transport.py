"""The streaming transport: producers send samples over TCP, a receiver puts them into a sink.

Real TCP on 127.0.0.1, real processes where a process dies; every wait is bounded.  The
sinks are small ones of this file (a list, a bounded anyio memory object stream), not the
buffers of :mod:`lamploop.streaming.buffers`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import attrs
import pytest
import safetensors.torch
import torch
import trustme
from anyio.streams.buffered import BufferedByteReceiveStream
from support import ROOT

from lamploop.errors import (
    ConfigurationError,
    ControlChannelError,
    FrameError,
    HandshakeError,
    StreamingError,
)
from lamploop.streaming.producer import AsyncProducer, BlockingProducer
from lamploop.streaming.receiver import SampleReceiver
from lamploop.streaming.sample import Sample
from lamploop.streaming.tensor_bytes import DTYPES
from lamploop.streaming.wire import (
    PROTOCOL_VERSION,
    Ack,
    Challenge,
    Done,
    FrameDecoder,
    FramedStream,
    Hello,
    Message,
    Redirect,
    Refuse,
    SamplesFrame,
    Welcome,
    decode_body,
    decode_tensors,
    encode_frame,
    encode_tensors,
    producer_proof,
    receiver_proof,
    redirect_proof,
    sample_frame,
    samples_frame,
)
from lamploop.transport.proofs import new_nonce, token_proof

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKEN = b"the streaming secret"
ROOT = ROOT


# -- helpers --


class ListSink:
    """Takes every sample at once."""

    def __init__(self) -> None:
        self.items: list[Sample] = []

    async def put(self, sample: Sample) -> None:
        self.items.append(sample)

    def seqs(self, producer: str) -> list[int]:
        return [s.seq for s in self.items if s.producer == producer]


class StreamSink:
    """A bounded anyio memory object stream: ``put`` waits while ``size`` samples are unread."""

    def __init__(self, size: float) -> None:
        self.send, self.receive = anyio.create_memory_object_stream[Sample](size)

    async def put(self, sample: Sample) -> None:
        await self.send.send(sample)

    def close(self) -> None:
        self.send.close()
        self.receive.close()


def tensors_for(seq: int) -> dict[str, torch.Tensor]:
    """Several dtypes and shapes, special values included; a function of ``seq``."""
    g = torch.Generator().manual_seed(seq)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "f64": torch.tensor([math.nan, math.inf, -0.0, float(seq)], dtype=torch.float64),
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(2, 2, 2, generator=g).bfloat16(),
        "i64": torch.tensor(seq),
        "i8": torch.arange(-4, 4, dtype=torch.int8) * (seq % 3),
        "u8": torch.randint(0, 256, (16,), dtype=torch.uint8, generator=g),
        "bool": torch.tensor([True, False, seq % 2 == 0]),
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
        "empty": torch.zeros(0, 4),
        "transposed": (torch.arange(12.0) + seq).reshape(3, 4).t(),  # not contiguous
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def assert_sample(sample: Sample, expected: dict[str, torch.Tensor]) -> None:
    assert set(sample.tensors) == set(expected)
    for name, tensor in expected.items():
        assert same_bits(sample.tensors[name], tensor), (sample.key, name)


async def eventually(condition: Callable[[], bool], within: float = 10.0) -> None:
    """Poll ``condition`` (state of another task or process) until true; TimeoutError after ``within`` s."""
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 (polling another object's state, not an event of ours)
            await anyio.sleep(0.01)


async def run_receiver(
    receiver: SampleReceiver, stop: anyio.Event, *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    async with receiver:
        task_status.started()
        await stop.wait()


# -- the wire --


def test_every_message_round_trips_and_samples_keep_their_bits() -> None:
    nonce = new_nonce()
    plain: list[Message] = [
        Challenge(PROTOCOL_VERSION, nonce),
        Hello(PROTOCOL_VERSION, "sim-3 (node 7)", nonce, "ab" * 32),
        Welcome(-1, 65536, "cd" * 32),
        Redirect("127.0.0.1", 4242, "ef" * 32),
        Refuse("why"),
        Ack(12),
        Done(-1),
    ]
    for message in plain:
        frame = encode_frame(message)
        assert int.from_bytes(frame[:4], "big") == len(frame) - 4
        assert decode_body(frame[4:]) == message
    frame = encode_frame(SamplesFrame("sim", 5, [tensors_for(5), tensors_for(6), tensors_for(7)]))
    decoded = decode_body(bytearray(frame[4:]))
    assert isinstance(decoded, SamplesFrame)
    assert (decoded.producer, decoded.first_seq, decoded.last_seq) == ("sim", 5, 7)
    for seq, tensors in enumerate(decoded.samples, start=5):
        assert_sample(Sample("sim", seq, tensors), tensors_for(seq))
    # The header is readable JSON, padded so that the payload starts 8-aligned; the payload is
    # each sample's safetensors bytes (the reference parser reads them), never a pickle.
    header_length = int.from_bytes(frame[4:6], "big")
    assert (2 + header_length) % 8 == 0
    header = json.loads(frame[6 : 6 + header_length])
    assert header.keys() == {"type", "producer", "first_seq", "sizes"}
    assert (header["type"], header["producer"], header["first_seq"]) == ("samples", "sim", 5)
    offset = 6 + header_length
    for seq, size in enumerate(header["sizes"], start=5):
        assert offset % 8 == 4  # 8-aligned in the body, after the 4-byte length prefix
        loaded = safetensors.torch.load(frame[offset : offset + size])
        assert_sample(Sample("sim", seq, loaded), tensors_for(seq))
        offset += size + (-size % 8)
    assert offset == len(frame)


def test_batched_tensors_are_views_of_the_frame_unless_small_beside_it() -> None:
    big = [{"x": torch.full((4096,), float(seq))} for seq in range(3)]
    body = bytearray(encode_frame(SamplesFrame("sim", 0, big))[4:])
    decoded = decode_body(body)
    assert isinstance(decoded, SamplesFrame)
    base = torch.frombuffer(body, dtype=torch.uint8).data_ptr()
    for seq, tensors in enumerate(decoded.samples):
        assert torch.equal(tensors["x"], big[seq]["x"])
        assert base <= tensors["x"].data_ptr() < base + len(body)  # no copy: a view of the body
    body[-4:] = b"\x00\x00\x80\x7f"  # the views see the bytes they were decoded from
    assert decoded.samples[2]["x"][-1].item() == math.inf
    # A sample under 1/8 of its frame is copied out: a buffer keeping it does not keep the frame.
    mixed = decode_body(bytearray(encode_frame(SamplesFrame("sim", 0, [{"s": torch.ones(2)}, *big]))[4:]))
    assert isinstance(mixed, SamplesFrame)
    assert mixed.samples[0]["s"].untyped_storage().nbytes() == 8


def test_the_tensor_codec_reads_and_writes_what_the_reference_safetensors_does() -> None:
    for seq in range(3):
        tensors = tensors_for(seq)
        ours = encode_tensors(tensors)
        assert_sample(Sample("p", seq, safetensors.torch.load(ours)), tensors)
        reference = safetensors.torch.save({name: t.contiguous() for name, t in tensors.items()})
        assert len(ours) == len(reference)  # the same data and padding (the order of equal sizes may differ)
        assert_sample(Sample("p", seq, decode_tensors(bytearray(reference))), tensors)
    # Unaligned bytes (a bytearray whose start moved) are copied once, not viewed misaligned.
    shifted = bytearray(b"x" + encode_tensors({"d": torch.arange(4.0, dtype=torch.float64)}))
    del shifted[:1]
    decoded = decode_tensors(shifted)["d"]
    assert decoded.data_ptr() % 8 == 0
    assert torch.equal(decoded, torch.arange(4.0, dtype=torch.float64))


def test_the_encoder_writes_the_values_of_lazy_views_and_every_dtype_as_safetensors_does() -> None:
    # The encoder copies a tensor's memory: a conjugate or negative view (whose memory is not
    # its values yet), a strided or expanded view, an offset slice and every dtype must come out
    # as safetensors' own encoder writes their values (from a materialised copy).
    complex_values = torch.complex(torch.arange(6.0), -torch.arange(6.0))
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "conj": complex_values.conj(),
        "neg": complex_values.conj().imag,  # a real tensor with the negative bit set
        "strided": base[:, ::2],
        "expanded": torch.arange(3.0).expand(4, 3),
        "offset": base.reshape(-1)[5:17],
        "scalar": torch.tensor(7, dtype=torch.int16),
    }
    assert tensors["conj"].is_conj()
    assert tensors["neg"].is_neg()
    generator = torch.Generator().manual_seed(0)
    for name, dtype in DTYPES.items():
        raw = torch.randint(0, 256, (2, 3 * dtype.itemsize), generator=generator, dtype=torch.uint8)
        tensors[f"dtype_{name}"] = raw.view(dtype)
    ours = safetensors.torch.load(encode_tensors(tensors))
    reference = safetensors.torch.load(
        safetensors.torch.save(
            {name: t.resolve_conj().resolve_neg().contiguous() for name, t in tensors.items()}
        )
    )
    assert ours.keys() == reference.keys()
    for name, expected in reference.items():
        assert (ours[name].dtype, ours[name].shape) == (expected.dtype, expected.shape), name
        assert (
            ours[name].reshape(-1).view(torch.uint8).tolist()
            == expected.reshape(-1).view(torch.uint8).tolist()
        ), name


def _body(header: dict[str, Any], payload: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(2, "big") + raw + payload


def _samples(payloads: list[bytes], **fields: Any) -> bytes:
    """A hand-made samples body: the header padded so the payload is 8-aligned, each payload padded."""
    header = {
        "type": "samples",
        "producer": "p",
        "first_seq": 0,
        "sizes": [len(p) for p in payloads],
        **fields,
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-(2 + len(raw)) % 8)
    return len(raw).to_bytes(2, "big") + raw + b"".join(p + bytes(-len(p) % 8) for p in payloads)


def _safetensors(header: dict[str, Any], data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data


GOOD_PAYLOAD = encode_tensors({"x": torch.ones(2)})
F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
BAD_BODIES = {
    "too short": (b"\x00", "too short"),
    "header longer than the body": (b"\x00\x40{}", "header announces 64 bytes"),
    "not JSON": (b"\x00\x04{{{{", "not UTF-8 JSON"),
    "not an object": (_body([1, 2]), "not an object"),  # type: ignore[arg-type]
    "unknown type": (_body({"type": "heartbeat"}), "unknown message type"),
    "missing field": (_body({"type": "ack"}), "missing fields ['upto_seq']"),
    "extra field": (_body({"type": "ack", "upto_seq": 1, "more": 2}), "extra fields ['more']"),
    "a bool for an int": (_body({"type": "ack", "upto_seq": True}), "upto_seq must be int"),
    "a string for an int": (_body({"type": "ack", "upto_seq": "1"}), "upto_seq must be int"),
    "a float for an int": (_body({"type": "ack", "upto_seq": 1.0}), "upto_seq must be int"),
    "seq below -1": (_body({"type": "ack", "upto_seq": -2}), "upto_seq must be in [-1"),
    "negative sample seq": (_samples([GOOD_PAYLOAD], first_seq=-1), "first_seq must be in [0"),
    "seq over 2**63-1": (_body({"type": "done", "last_seq": 2**63}), "last_seq must be in"),
    "a payload on an ack": (_body({"type": "ack", "upto_seq": 1}, b"xx"), "has no payload"),
    "tensors that are not safetensors": (
        _samples([b"\x08\x00\x00\x00\x00\x00\x00\x00{}"]),
        "tensors do not decode: the header announces 8 bytes",
    ),
    "a sample without tensors": (_samples([safetensors.torch.save({})]), "holds no tensor"),
    "an empty producer name": (_samples([GOOD_PAYLOAD], producer=""), "1 to 200 bytes"),
    "no sizes": (_samples([]), "sizes lists 1 to 4096 samples, got 0"),
    "a negative size": (_samples([GOOD_PAYLOAD], sizes=[-8]), "a size is not an int >= 0: -8"),
    "a string size": (_samples([GOOD_PAYLOAD], sizes=["8"]), "a size is not an int >= 0: '8'"),
    "sizes that do not add up": (
        _samples([GOOD_PAYLOAD], sizes=[len(GOOD_PAYLOAD) + 8]),
        f"make {len(GOOD_PAYLOAD) + 8 + (-len(GOOD_PAYLOAD) % 8)} bytes, the payload has",
    ),
    "a payload not 8-aligned": (
        _body(
            {"type": "samples", "producer": "p", "first_seq": 0, "sizes": [len(GOOD_PAYLOAD)]}, GOOD_PAYLOAD
        ),
        "not 8-aligned",
    ),
    "an unknown dtype": (
        _samples([_safetensors({"x": {**F32_2, "dtype": "F128"}}, bytes(8))]),
        "unknown dtype 'F128'",
    ),
    "offsets that do not match the shape": (
        _samples([_safetensors({"x": {**F32_2, "shape": [3]}}, bytes(8))]),
        "data_offsets [0, 8] do not match shape [3]",
    ),
    "a hole between tensors": (
        _samples([_safetensors({"x": F32_2, "y": {**F32_2, "data_offsets": [16, 24]}}, bytes(24))]),
        "a hole or an overlap at byte 16",
    ),
    "overlapping tensors": (
        _samples([_safetensors({"x": F32_2, "y": {**F32_2, "data_offsets": [4, 12]}}, bytes(12))]),
        "a hole or an overlap at byte 4",
    ),
    "data after the last tensor": (
        _samples([_safetensors({"x": F32_2}, bytes(16))]),
        "cover 8 bytes of data, but 16 follow",
    ),
    "a malformed shape": (
        _samples([_safetensors({"x": {**F32_2, "shape": [-2]}}, bytes(8))]),
        "malformed shape [-2]",
    ),
    "an extra key in a tensor's entry": (
        _samples([_safetensors({"x": {**F32_2, "more": 1}}, bytes(8))]),
        "is not an object of ['data_offsets', 'dtype', 'shape']",
    ),
    "a control character in a name": (
        _body({"type": "hello", "protocol_version": 1, "producer": "a\nb", "nonce": "0" * 64, "proof": ""}),
        "no control characters",
    ),
    "a malformed nonce": (
        _body({"type": "challenge", "protocol_version": 1, "nonce": "xyz"}),
        "64 lowercase",
    ),
    "NaN": (b"\x00\x15" + b'{"type":"ack","x":NaN}', "not valid JSON"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_decoding_refuses_a_malformed_body_with_a_clear_reason(case: str) -> None:
    body, reason = BAD_BODIES[case]
    with pytest.raises(FrameError, match=None) as info:
        decode_body(body)
    assert reason in str(info.value), str(info.value)


def test_the_decoder_splits_frames_anyhow_and_refuses_oversize_and_disorder_for_good() -> None:
    frames = (
        b"".join(sample_frame("p", seq, GOOD_PAYLOAD) for seq in range(3))
        + samples_frame("p", 3, [GOOD_PAYLOAD] * 2)
        + encode_frame(Done(4))
    )
    for step in (1, 7, len(frames)):  # byte by byte, in odd pieces, at once
        decoder = FrameDecoder()
        decoder.producer = "p"
        got = [m for i in range(0, len(frames), step) for m, _ in decoder.feed(frames[i : i + step])]
        batches = [m for m in got if isinstance(m, SamplesFrame)]
        assert [(m.first_seq, len(m.samples)) for m in batches] == [(0, 1), (1, 1), (2, 1), (3, 2)]
        assert all(torch.equal(t["x"], torch.ones(2)) for m in batches for t in m.samples)
        assert got[-1] == Done(4)
        assert decoder.buffered == 0

    small = FrameDecoder(max_frame_bytes=100)
    with pytest.raises(FrameError, match="announces 4000000000 bytes, over the limit of 100"):
        small.feed((4_000_000_000).to_bytes(4, "big"))  # refused at the header: no body needed
    with pytest.raises(FrameError, match="unusable after an earlier bad frame"):
        small.feed(encode_frame(Ack(1)))

    for producer, seqs, reason in [
        ("p", [3, 3], "seq 3 after seq 3"),
        ("p", [4, 2], "seq 2 after seq 4"),
        ("p", [4, 4], "seq 4 after seq 5"),  # a batch of 4 and 5, then 4 again
        ("q", [0], "a sample of producer 'q' on the connection of 'p'"),
    ]:
        decoder = FrameDecoder()
        decoder.producer = "p"
        with pytest.raises(FrameError, match=reason):
            decoder.feed(
                sample_frame(producer, seqs[0], GOOD_PAYLOAD)
                if len(seqs) == 1
                else samples_frame(producer, seqs[0], [GOOD_PAYLOAD] * (2 if seqs == [4, 4] else 1))
                + sample_frame(producer, seqs[1], GOOD_PAYLOAD)
            )

    with pytest.raises(FrameError, match="over the limit of 1024 bytes"):
        sample_frame("p", 0, bytes(2000), max_frame_bytes=1024)


def test_proofs_are_bound_to_the_token_the_nonces_and_their_role() -> None:
    receiver_nonce = new_nonce()
    hello = Hello(PROTOCOL_VERSION, "sim", new_nonce(), "")
    proof = producer_proof(TOKEN, receiver_nonce=receiver_nonce, hello=hello)
    assert proof == producer_proof(TOKEN, receiver_nonce=receiver_nonce, hello=attrs.evolve(hello, proof="x"))
    assert proof != producer_proof(b"other", receiver_nonce=receiver_nonce, hello=hello)
    assert proof != producer_proof(TOKEN, receiver_nonce=new_nonce(), hello=hello)
    assert proof != producer_proof(
        TOKEN, receiver_nonce=receiver_nonce, hello=attrs.evolve(hello, producer="x")
    )
    back = receiver_proof(
        TOKEN, receiver_nonce=receiver_nonce, hello=hello, acked_seq=7, max_frame_bytes=4096
    )
    assert back not in {
        proof,
        receiver_proof(TOKEN, receiver_nonce=receiver_nonce, hello=hello, acked_seq=8, max_frame_bytes=4096),
        receiver_proof(TOKEN, receiver_nonce=receiver_nonce, hello=hello, acked_seq=7, max_frame_bytes=4097),
    }
    there = redirect_proof(TOKEN, receiver_nonce=receiver_nonce, hello=hello, host="127.0.0.1", port=5)
    assert there not in {
        back,
        redirect_proof(TOKEN, receiver_nonce=receiver_nonce, hello=hello, host="127.0.0.1", port=6),
    }
    # The generic HMAC of the control channel, under a label of the stream's own.
    assert token_proof(TOKEN, b"a", b"b") != token_proof(TOKEN, b"ab")


# -- end to end --


async def test_samples_arrive_in_order_with_their_tensors_bitwise() -> None:
    sink = ListSink()
    count = 40
    with anyio.fail_after(30):
        async with SampleReceiver(sink, token=TOKEN, expected_producers=["a", "b"]) as receiver:

            async def produce(name: str) -> None:
                async with AsyncProducer(receiver.address, name=name, token=TOKEN, resend_window=8) as p:
                    for seq in range(count):
                        assert await p.send(tensors_for(seq)) == seq
                    await p.done()
                    assert p.acknowledged_seq == count - 1
                    assert p.unacknowledged == 0
                    assert p.stats.sent == count
                    assert p.stats.resent == 0

            async with anyio.create_task_group() as tg:
                tg.start_soon(produce, "a")
                tg.start_soon(produce, "b")
            await receiver.wait_all_done()
            assert receiver.producers_done == {"a", "b"}
            assert receiver.acknowledged == {"a": count - 1, "b": count - 1}
            stats = receiver.stats
    for name in ("a", "b"):
        assert sink.seqs(name) == list(range(count))
    for sample in sink.items:
        assert_sample(sample, tensors_for(sample.seq))
    assert stats.samples == 2 * count
    assert stats.bytes > 2 * count * 300
    assert stats.duplicates == stats.refusals == 0


@pytest.mark.parametrize(("floats", "window"), [(256, 256), (8192, 127), (65536, 64)])
async def test_the_default_window_holds_256_small_samples_at_most_4_mib_of_larger_ones_and_64_of_large_ones(
    floats: int, window: int
) -> None:
    """A receiver whose sink takes nothing: ``send`` waits once the default window is full, at
    256 samples of 1 KiB, 127 of 32 KiB and a header (128 would be over 4 MiB) and 64 of
    256 KiB, and nothing is acknowledged."""
    sink = StreamSink(0)  # put() waits until the test reads the sample: nothing is acknowledged
    x = torch.zeros(floats)
    with anyio.fail_after(40), contextlib.closing(sink):
        async with (
            SampleReceiver(sink, token=TOKEN) as receiver,
            AsyncProducer(receiver.address, name="sim", token=TOKEN) as producer,
        ):
            for _ in range(window):
                await producer.send({"x": x})  # the window takes them at once
            await eventually(lambda: sink.send.statistics().tasks_waiting_send == 1)
            with anyio.move_on_after(0.5) as blocked:
                await producer.send({"x": x})
            assert blocked.cancelled_caught  # full: send() waits
            assert producer.unacknowledged == window
            assert producer.acknowledged_seq == -1
            for seq in range(3):  # three taken: room for three more, not four
                assert (await sink.receive.receive()).seq == seq
            await eventually(lambda: producer.acknowledged_seq == 2)
            for _ in range(3):
                with anyio.fail_after(5):
                    await producer.send({"x": x})
            with anyio.move_on_after(0.5) as blocked:
                await producer.send({"x": x})
            assert blocked.cancelled_caught  # the cancelled sends took nothing

            async def drain() -> None:
                seqs = [(await sink.receive.receive()).seq for _ in range(window)]
                assert seqs == list(range(3, window + 3))

            async with anyio.create_task_group() as tg:
                tg.start_soon(drain)
                await producer.done()


async def test_acks_come_only_after_the_put_so_a_slow_sink_holds_the_producer_back() -> None:
    sink = StreamSink(0)  # put() waits until the test reads the sample
    window = 4
    with anyio.fail_after(30), contextlib.closing(sink):
        async with (
            SampleReceiver(sink, token=TOKEN) as receiver,
            AsyncProducer(receiver.address, name="sim", token=TOKEN, resend_window=window) as producer,
        ):
            for seq in range(window):
                await producer.send(tensors_for(seq))  # the window takes them at once
            # The put of seq 0 waits for the reader from here on (the clock below starts after).
            await eventually(lambda: sink.send.statistics().tasks_waiting_send == 1)
            with anyio.move_on_after(0.5) as blocked:
                await producer.send(tensors_for(window))
            assert blocked.cancelled_caught  # the window is full: send() waits
            assert producer.unacknowledged == window
            assert producer.acknowledged_seq == -1  # seq 0 is not in the sink yet, so not acknowledged
            assert receiver.acknowledged == {}

            first = await sink.receive.receive()  # the sink takes seq 0: its put returns, then the ack
            assert first.seq == 0
            await eventually(lambda: producer.acknowledged_seq == 0)
            assert receiver.acknowledged == {"sim": 0}
            with anyio.fail_after(5):
                assert await producer.send(tensors_for(window)) == window  # room for one more

            got = [first]

            async def drain() -> None:
                async for sample in sink.receive:
                    got.append(sample)
                    assert producer.acknowledged_seq < sample.seq  # never acknowledged before it was taken
                    if sample.seq == window + 5:
                        return

            async with anyio.create_task_group() as tg:
                tg.start_soon(drain)
                for seq in range(window + 1, window + 6):
                    await producer.send(tensors_for(seq))
                await producer.done()
            stats = receiver.stats
    assert [s.seq for s in got] == list(range(window + 6))
    assert stats.put_seconds >= 0.4  # the put of seq 0 waited for the reader
    assert stats.max_put_seconds >= 0.4


@pytest.mark.parametrize(
    ("checkpoint_seq", "keep_acknowledged"),
    [(19, 0), (9, 10)],
    ids=["checkpoint-at-the-last-ack", "checkpoint-older-than-the-acks"],
)
async def test_a_restarted_receiver_gets_exactly_what_its_restored_state_lacks(
    checkpoint_seq: int, keep_acknowledged: int
) -> None:
    """Receiver A takes 0..19 and stops; 20..29 are sent while no receiver listens; receiver B,
    on the same port and restored with ``acknowledged=`` from A's checkpoint, gets the rest."""
    sink_a, sink_b = ListSink(), ListSink()
    stop_a, stop_b = anyio.Event(), anyio.Event()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            receiver_a = SampleReceiver(sink_a, token=TOKEN)
            await tg.start(run_receiver, receiver_a, stop_a)
            port = receiver_a.address[1]
            async with AsyncProducer(
                ("127.0.0.1", port),
                name="sim",
                token=TOKEN,
                resend_window=32,
                keep_acknowledged=keep_acknowledged,
            ) as producer:
                for seq in range(20):
                    await producer.send(tensors_for(seq))
                await eventually(lambda: producer.acknowledged_seq == 19)
                assert receiver_a.acknowledged == {"sim": 19}
                stop_a.set()  # the trainer stops
                await eventually(lambda: producer.stats.connections == 1 and not _listening(port))
                for seq in range(20, 30):
                    await producer.send(tensors_for(seq))  # kept: nobody listens
                assert producer.unacknowledged == 10
                receiver_b = SampleReceiver(
                    sink_b,
                    token=TOKEN,
                    port=port,
                    acknowledged={"sim": checkpoint_seq},
                    expected_producers=["sim"],
                )
                await tg.start(run_receiver, receiver_b, stop_b)
                await producer.done()
                stats = producer.stats
            await receiver_b.wait_all_done()
            stop_b.set()
    assert sink_a.seqs("sim") == list(range(20))
    assert sink_b.seqs("sim") == list(range(checkpoint_seq + 1, 30))  # exactly the missing ones, once
    for sample in sink_b.items:
        assert_sample(sample, tensors_for(sample.seq))
    assert receiver_b.stats.duplicates == 0
    assert receiver_b.acknowledged == {"sim": 29}
    assert stats.connections == 2
    assert stats.resent == 19 - checkpoint_seq
    assert stats.sent == 30


async def test_a_restarted_producer_keeping_acknowledged_samples_skips_what_the_receiver_holds() -> None:
    """A producer restarted from seq 0 with keep_acknowledged: samples queued before the Welcome
    said the receiver holds up to 5, then 2..5 skipped, then 6.. sent (the kept seqs stay contiguous)."""
    sink = ListSink()
    stop = anyio.Event()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            receiver = SampleReceiver(sink, token=TOKEN, acknowledged={"sim": 5}, expected_producers=["sim"])
            await tg.start(run_receiver, receiver, stop)
            async with AsyncProducer(
                receiver.address, name="sim", token=TOKEN, resend_window=2, keep_acknowledged=20
            ) as producer:
                for seq in range(10):  # 0 and 1 are queued before the connection is made
                    await producer.send(tensors_for(seq))
                await producer.done()
            await receiver.wait_all_done()
            stop.set()
    assert sink.seqs("sim") == list(range(6, 10))
    assert producer.stats.skipped == 6


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_a_receiver_restored_older_than_what_the_producer_kept_fails_the_producer_clearly() -> None:
    sink_a, sink_b = ListSink(), ListSink()
    stop_a, stop_b = anyio.Event(), anyio.Event()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            receiver_a = SampleReceiver(sink_a, token=TOKEN)
            await tg.start(run_receiver, receiver_a, stop_a)
            port = receiver_a.address[1]

            async def produce() -> None:
                async with AsyncProducer(("127.0.0.1", port), name="sim", token=TOKEN) as producer:
                    for seq in range(10):
                        await producer.send(tensors_for(seq))
                    await eventually(lambda: producer.acknowledged_seq == 9)
                    stop_a.set()
                    await eventually(lambda: not _listening(port))
                    receiver_b = SampleReceiver(sink_b, token=TOKEN, port=port, acknowledged={"sim": 4})
                    await tg.start(run_receiver, receiver_b, stop_b)
                    await producer.send(tensors_for(10))
                    await producer.done()

            with pytest.raises(StreamingError, match=r"holds seqs up to 4 only.*no longer has 5..9") as info:
                await produce()
            stop_b.set()
    assert "keep_acknowledged=" in str(info.value)
    assert sink_b.items == []


# -- strangers and broken producers --


async def _raw_handshake(port: int, name: str, token: bytes = TOKEN) -> tuple[FramedStream, Welcome]:
    """A hand-made producer's handshake."""
    conn = FramedStream(await anyio.connect_tcp("127.0.0.1", port), max_frame_bytes=4096)
    challenge = await conn.receive()
    assert isinstance(challenge, Challenge)
    hello = Hello(PROTOCOL_VERSION, name, new_nonce(), "")
    hello = attrs.evolve(hello, proof=producer_proof(token, receiver_nonce=challenge.nonce, hello=hello))
    await conn.send(encode_frame(hello))
    welcome = await conn.receive()
    assert isinstance(welcome, Welcome)
    assert welcome.proof == receiver_proof(
        token,
        receiver_nonce=challenge.nonce,
        hello=hello,
        acked_seq=welcome.acked_seq,
        max_frame_bytes=welcome.max_frame_bytes,
    )
    return conn, welcome


async def _read_to_end(conn: FramedStream) -> list[Message]:
    """What the receiver sends until it closes the connection."""
    got: list[Message] = []
    try:
        while (message := await conn.receive()) is not None:
            got.append(message)
    except ControlChannelError:
        pass  # a reset
    finally:
        await conn.aclose()
    return got


async def _raw_bytes_to_end(stream: anyio.abc.ByteStream) -> bytes:
    chunks = []
    try:
        while True:
            chunks.append(await stream.receive())
    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
        pass
    finally:
        await stream.aclose()
    return b"".join(chunks)


async def _speaks_first(port: int) -> None:
    # Blocking calls on purpose: the receiver (on this event loop) accepts only once the
    # bytes are there, as with a stranger that does not wait for the challenge.
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET / HTTP/1.1\r\n\r\n")

    def read_all() -> bytes:
        with s:
            chunks = []
            try:
                while chunk := s.recv(4096):
                    chunks.append(chunk)
            except ConnectionResetError:
                pass
            return b"".join(chunks)

    assert await anyio.to_thread.run_sync(read_all) == b""  # not even a challenge


async def _after_the_challenge(port: int, data: bytes) -> bytes:
    stream = await anyio.connect_tcp("127.0.0.1", port)
    conn = FramedStream(stream, max_frame_bytes=4096)
    assert isinstance(await conn.receive(), Challenge)
    await stream.send(data)
    return await _raw_bytes_to_end(stream)


async def _garbage(port: int) -> None:
    assert await _after_the_challenge(port, b"\x00\x00\x00\x0c\x00\x0anot json!!") == b""  # no reply


async def _oversized(port: int) -> None:
    started = anyio.current_time()
    assert await _after_the_challenge(port, (2**31).to_bytes(4, "big") + b"x" * 1000) == b""
    # At the header, long before the handshake timeout (HANDSHAKE_TIMEOUT_S, 10 s in this case).
    assert anyio.current_time() - started < HANDSHAKE_TIMEOUT_S / 2


async def _wrong_token(port: int) -> None:
    async def produce() -> None:
        async with AsyncProducer(("127.0.0.1", port), name="intruder", token=b"wrong") as p:
            await p.send(tensors_for(0))
            await p.done()

    with pytest.raises(HandshakeError, match=r"refused by .*did not match \(wrong token\?\)"):
        await produce()


async def _silent(port: int) -> None:
    stream = await anyio.connect_tcp("127.0.0.1", port)
    conn = FramedStream(stream, max_frame_bytes=4096)
    assert isinstance(await conn.receive(), Challenge)
    assert await _read_to_end(conn) == [Refuse(f"no valid hello within {SILENT_TIMEOUT_S:g} s")]


def _after_handshake(frames: Callable[[], bytes]) -> Callable[[int], Awaitable[None]]:
    async def attack(port: int) -> None:
        conn, welcome = await _raw_handshake(port, "broken")
        assert welcome.acked_seq == -1
        await conn.send(frames())
        replies = await _read_to_end(conn)
        assert len(replies) >= 1
        assert isinstance(replies[-1], Refuse), replies  # told why, then closed

    return attack


def _malformed_sample() -> bytes:
    body = _samples([b"\x08\x00\x00\x00\x00\x00\x00\x00{}"], producer="broken")
    return len(body).to_bytes(4, "big") + body


HANDSHAKE_TIMEOUT_S = 10.0
SILENT_TIMEOUT_S = 2.0
"""The receiver's handshake timeout in the hostile cases: long, so that a loaded machine never
times out the honest producer's handshake or an attack's; 2 s where the attack is silence
(0.5 s timed out handshakes when CI ran 3 workers on 2 cores)."""

HOSTILE: dict[str, tuple[Callable[[int], Awaitable[None]], str]] = {
    "garbage before the challenge": (_speaks_first, "it spoke before the receiver's challenge"),
    "garbage after the challenge": (_garbage, "not UTF-8 JSON"),
    "an oversized length prefix": (_oversized, "announces 2147483648 bytes, over the limit of 4096"),
    "a wrong token": (_wrong_token, "did not match (wrong token?)"),
    "a silent connection": (_silent, f"no valid hello within {SILENT_TIMEOUT_S:g} s"),
    "a malformed frame after a valid handshake": (
        _after_handshake(_malformed_sample),
        "producer 'broken': the sample's tensors do not decode",
    ),
    "a frame over max_frame_bytes after the handshake": (
        _after_handshake(lambda: sample_frame("broken", 0, bytes(70_000))),
        "over the limit of 65536 bytes",
    ),
    "a gap in the seqs": (
        _after_handshake(lambda: sample_frame("broken", 3, GOOD_PAYLOAD)),
        "sample seq 3 leaves a gap: the receiver holds up to -1",
    ),
    "a seq that does not increase": (
        _after_handshake(lambda: sample_frame("broken", 0, GOOD_PAYLOAD) * 2),
        "seq 0 after seq 0",
    ),
    "another producer's sample": (
        _after_handshake(lambda: sample_frame("honest", 0, GOOD_PAYLOAD)),
        "a sample of producer 'honest' on the connection of 'broken'",
    ),
    "a second hello": (
        _after_handshake(lambda: encode_frame(Hello(1, "broken", new_nonce(), ""))),
        "sent a Hello message after the handshake",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
async def test_a_hostile_connection_is_refused_and_counted_while_an_honest_producer_goes_on(
    case: str,
) -> None:
    attack, reason = HOSTILE[case]
    sink = ListSink()
    attacked = anyio.Event()
    with anyio.fail_after(30):
        async with SampleReceiver(
            sink,
            token=TOKEN,
            handshake_timeout=SILENT_TIMEOUT_S if case == "a silent connection" else HANDSHAKE_TIMEOUT_S,
            max_frame_bytes=65536,
            expected_producers=["honest"],
        ) as receiver:

            async def honest() -> None:
                async with AsyncProducer(receiver.address, name="honest", token=TOKEN, resend_window=16) as p:
                    for seq in range(100):
                        await p.send(tensors_for(seq))
                    await attacked.wait()  # connected, mid-stream, while the attack runs
                    for seq in range(100, 200):
                        await p.send(tensors_for(seq))
                    await p.done()
                    assert p.stats.connections == 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(honest)
                await eventually(lambda: receiver.stats.samples >= 50)
                await attack(receiver.address[1])
                attacked.set()
            await receiver.wait_all_done()
            refusals = receiver.recent_refusals
            assert receiver.refusals == 1, refusals
    assert reason in refusals[0], refusals
    assert sink.seqs("honest") == list(range(200))
    assert {s.producer for s in sink.items} == {"honest"}


async def test_duplicates_from_a_producer_that_ignores_the_welcome_are_dropped() -> None:
    sink = ListSink()
    with anyio.fail_after(20):
        async with SampleReceiver(sink, token=TOKEN) as receiver:
            port = receiver.address[1]
            conn, welcome = await _raw_handshake(port, "replay")
            assert welcome.acked_seq == -1
            await conn.send(
                b"".join(sample_frame("replay", seq, encode_tensors(tensors_for(seq))) for seq in range(5))
            )
            await eventually(lambda: receiver.acknowledged == {"replay": 4})
            await conn.aclose()
            conn, welcome = await _raw_handshake(port, "replay")
            assert welcome.acked_seq == 4
            # Resent from 0 anyway: 0..4 are dropped, 5..9 taken, and every one acknowledged.
            await conn.send(
                b"".join(sample_frame("replay", seq, encode_tensors(tensors_for(seq))) for seq in range(10))
            )
            await conn.send(encode_frame(Done(9)))
            replies: list[Message | None] = []
            while (reply := await conn.receive()) != Done(9):  # answers Done: it holds up to 9
                replies.append(reply)
            assert all(isinstance(r, Ack) and r.upto_seq <= 9 for r in replies), replies
            await conn.aclose()
            stats = receiver.stats
    assert sink.seqs("replay") == list(range(10))
    assert stats.duplicates == 5
    assert stats.samples == 10
    assert stats.refusals == 0


async def test_a_new_connection_of_a_producer_replaces_its_old_one() -> None:
    """A producer that reconnects before the receiver noticed its old connection is gone."""
    sink = ListSink()
    with anyio.fail_after(20):
        async with SampleReceiver(sink, token=TOKEN) as receiver:
            old, _ = await _raw_handshake(receiver.address[1], "sim")
            await old.send(
                b"".join(sample_frame("sim", seq, encode_tensors(tensors_for(seq))) for seq in range(3))
            )
            await eventually(lambda: receiver.acknowledged == {"sim": 2})
            async with AsyncProducer(receiver.address, name="sim", token=TOKEN) as producer:  # from 0 again
                for seq in range(10):
                    await producer.send(tensors_for(seq))
                await producer.done()
                assert producer.stats.skipped == 3
            assert all(isinstance(m, Ack) for m in await _read_to_end(old))  # then closed by the receiver
            stats = receiver.stats
    assert sink.seqs("sim") == list(range(10))
    assert stats.refusals == stats.duplicates == 0


async def test_batches_stay_under_the_receivers_frame_limit_and_a_sample_over_it_fails_clearly() -> None:
    sink = ListSink()
    small = {"x": torch.arange(200.0)}  # 896 bytes of safetensors: several fit in 8 KiB frames
    with anyio.fail_after(20):
        async with SampleReceiver(sink, token=TOKEN, max_frame_bytes=8192) as receiver:
            async with AsyncProducer(
                receiver.address, name="sim", token=TOKEN, resend_window=256
            ) as producer:
                for _ in range(300):
                    await producer.send(small)
                await producer.done()
            assert receiver.refusals == 0
            assert sink.seqs("sim") == list(range(300))
            assert receiver.stats.bytes > 300 * 800

            async def too_big() -> None:
                async with AsyncProducer(receiver.address, name="big", token=TOKEN) as producer:
                    await producer.send({"x": torch.zeros(4096)})  # 16 KiB: under the producer's limit
                    await producer.done()

            with pytest.raises(
                StreamingError, match=r"sample 0 cannot be sent to the receiver at .* limit of 8192"
            ):
                await too_big()
            assert receiver.refusals == 0  # never sent: the producer knew the limit from the Welcome


async def test_an_idle_producer_is_closed_and_connects_again_when_it_has_more() -> None:
    sink = ListSink()
    with anyio.fail_after(20):
        async with (
            # 1 s: with 0.3 s a loaded machine's pause between two sends closed a third connection.
            SampleReceiver(sink, token=TOKEN, idle_timeout=1.0) as receiver,
            AsyncProducer(receiver.address, name="sim", token=TOKEN) as producer,
        ):
            for seq in range(5):
                await producer.send(tensors_for(seq))
            await anyio.sleep(2.5)  # the simulation computes; the receiver closes the idle connection
            for seq in range(5, 10):
                await producer.send(tensors_for(seq))
            await producer.done()
            assert producer.stats.connections == 2
            assert producer.stats.resent == 0
    assert sink.seqs("sim") == list(range(10))


async def test_a_failing_sink_fails_the_receiver_with_its_error() -> None:
    class Broken:
        async def put(self, sample: Sample) -> None:
            raise RuntimeError("the buffer is closed")

    async def receive() -> None:
        async with (
            SampleReceiver(Broken(), token=TOKEN) as receiver,
            AsyncProducer(receiver.address, name="sim", token=TOKEN) as producer,
        ):
            await producer.send(tensors_for(0))
            await anyio.sleep(30)  # cancelled by the receiver's failure

    with (
        anyio.fail_after(20),
        pytest.raises(StreamingError, match=r"sink's put failed for sample \('sim', 0\)"),
    ):
        await receive()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": ""}, "name: a producer's name is 1 to 200 bytes"),
        ({"name": "x" * 201}, "1 to 200 bytes"),
        ({"token": b""}, "token must be a non-empty"),
        ({"resend_window": 0}, "resend_window must be an integer"),
        ({"start_seq": -1}, "start_seq must be an integer"),
        ({"ack_timeout": 0}, "ack_timeout must be a positive number"),
        ({"address": "127.0.0.1:80"}, "address must be a (host, port) tuple"),
    ],
)
def test_bad_producer_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"address": ("127.0.0.1", 80), "name": "sim", "token": TOKEN, **kwargs}
    with pytest.raises(ConfigurationError) as info:
        AsyncProducer(**arguments)
    assert message in str(info.value)


def test_bad_receiver_arguments_are_named() -> None:
    with pytest.raises(ConfigurationError, match="acknowledged\\['sim'\\] must be an integer in \\[-1"):
        SampleReceiver(ListSink(), token=TOKEN, acknowledged={"sim": -5})
    with pytest.raises(ConfigurationError, match="needs SampleReceiver\\(expected_producers"):
        anyio.run(SampleReceiver(ListSink(), token=TOKEN).wait_all_done)
    with pytest.raises(ConfigurationError, match="sink must have an async put"):
        SampleReceiver(object(), token=TOKEN)  # type: ignore[arg-type]


# -- processes --

PRODUCER_SCRIPT = """
import json, os, sys, time
import torch
from lamploop.streaming.producer import BlockingProducer

port, name, count, pause = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
token = os.environ["STREAM_TOKEN"].encode()
with BlockingProducer(("127.0.0.1", port), name=name, token=token, resend_window=8) as producer:
    for seq in range(count):
        g = torch.Generator().manual_seed(seq)
        producer.send({"x": torch.randn(4, 3, generator=g), "seq": torch.tensor(seq)})
        print(json.dumps({"sent": seq, "acked": producer.acknowledged_seq}), flush=True)
        time.sleep(pause)
stats = producer.stats
summary = {"skipped": stats.skipped, "sent": stats.sent, "acked": producer.acknowledged_seq}
print(json.dumps(summary), flush=True)
"""


def _expected(seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seq)
    return {"x": torch.randn(4, 3, generator=g), "seq": torch.tensor(seq)}


async def _start_producer(port: int, name: str, count: int, pause: float) -> anyio.abc.Process:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STREAM_TOKEN": TOKEN.decode()}
    return await anyio.open_process(
        [sys.executable, "-c", PRODUCER_SCRIPT, str(port), name, str(count), str(pause)],
        env=env,
        stderr=subprocess.STDOUT,
    )


async def _lines(process: anyio.abc.Process) -> Any:
    assert process.stdout is not None
    reader = BufferedByteReceiveStream(process.stdout)
    while True:
        try:
            line = await reader.receive_until(b"\n", 1 << 20)
        except (anyio.EndOfStream, anyio.IncompleteRead):
            return
        yield line.decode()


async def test_a_blocking_producer_in_a_plain_script_delivers_every_sample() -> None:
    sink = ListSink()
    with anyio.fail_after(50):
        async with SampleReceiver(sink, token=TOKEN, expected_producers=["script"]) as receiver:
            async with await _start_producer(receiver.address[1], "script", 50, 0.0) as process:
                output = [line async for line in _lines(process)]
                assert await process.wait() == 0, "".join(output)
            await receiver.wait_all_done()
    assert json.loads(output[-1]) == {"skipped": 0, "sent": 50, "acked": 49}, output[-3:]
    assert sink.seqs("script") == list(range(50))
    for sample in sink.items:
        assert_sample(sample, _expected(sample.seq))


@pytest.mark.slow
async def test_a_producer_killed_and_restarted_from_zero_delivers_each_seq_once() -> None:
    sink = ListSink()
    count = 60
    with anyio.fail_after(50):
        async with SampleReceiver(sink, token=TOKEN, expected_producers=["sim"]) as receiver:
            port = receiver.address[1]
            async with await _start_producer(port, "sim", count, 0.02) as first:
                async for line in _lines(first):
                    if line.startswith("{") and json.loads(line).get("acked", -1) >= 20:
                        break
                first.kill()  # SIGKILL: no goodbye, unacknowledged samples lost with the process
                assert await first.wait() == -9
            held = receiver.acknowledged["sim"]
            assert 20 <= held < count - 1
            async with await _start_producer(port, "sim", count, 0.0) as second:  # from 0 again
                output = [line async for line in _lines(second)]
                assert await second.wait() == 0, "".join(output)
            await receiver.wait_all_done()
            stats = receiver.stats
    seqs = sink.seqs("sim")
    assert seqs == list(range(count))  # each seq once, in order
    for sample in sink.items:
        assert_sample(sample, _expected(sample.seq))
    summary = json.loads(output[-1])
    assert summary["skipped"] == held + 1  # the restarted producer did not even send them
    assert summary["sent"] == count - held - 1
    assert stats.duplicates == 0


async def test_a_blocking_producer_with_a_wrong_token_raises_the_refusal() -> None:
    with anyio.fail_after(20):
        async with SampleReceiver(ListSink(), token=TOKEN) as receiver:

            def produce() -> None:
                with BlockingProducer(receiver.address, name="sim", token=b"wrong") as producer:
                    producer.send(tensors_for(0))
                    producer.done()

            with pytest.raises(HandshakeError, match="did not match"):
                await anyio.to_thread.run_sync(produce)
            assert receiver.refusals == 1


# -- TLS --


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


async def test_over_tls_samples_arrive_and_an_untrusted_receiver_is_refused(ca: trustme.CA) -> None:
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    sink = ListSink()
    with anyio.fail_after(30):
        async with SampleReceiver(sink, token=TOKEN, ssl_context=server) as receiver:
            async with AsyncProducer(
                receiver.address, name="sim", token=TOKEN, ssl_context=client
            ) as producer:
                for seq in range(10):
                    await producer.send(tensors_for(seq))
                await producer.done()

            async def untrusting() -> None:
                context = ssl.create_default_context()  # does not trust the test CA
                async with AsyncProducer(receiver.address, name="x", token=TOKEN, ssl_context=context) as p:
                    await p.done()

            with pytest.raises(HandshakeError, match="CERTIFICATE_VERIFY_FAILED"):
                await untrusting()
    assert sink.seqs("sim") == list(range(10))
    for sample in sink.items:
        assert_sample(sample, tensors_for(sample.seq))
