"""Frames read from the socket straight into their bodies' memory (``lamploop.transport.receive_into``).

Whatever the cut of the stream into reads, and whichever reads land in a body's memory and
which reach the decoder as chunks (a read that comes while an earlier chunk waits), the
messages must be the ones sent: each sample equal to the tensors it was made of, in order;
a large batch's runs must be the memory the socket wrote (no copy after the kernel's); and a
connection must still tell a clean end from one in the middle of a frame.  Over a real TCP
connection, anyio's stream must keep working as a stream (sends, end of stream) after the swap.
"""

from __future__ import annotations

import random

import anyio
import pytest
import torch

from lamploop.errors import FrameError
from lamploop.streaming.wire import Ack, FrameDecoder, FramedStream, SamplesFrame, encode_frame
from lamploop.transport.frames import DIRECT_BODY_BYTES
from lamploop.transport.receive_into import receive_into

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

LARGE = 16384  # 64 KiB of float32: runs of 8 samples
SMALL = 256  # 1 KiB


def _batch(first_seq: int, count: int, floats: int, *, other_kind_at: int | None = None) -> SamplesFrame:
    samples = []
    for seq in range(first_seq, first_seq + count):
        name = "z" if seq == other_kind_at else "x"
        samples.append({name: torch.arange(floats, dtype=torch.float32) * 0.5 + seq, "y": torch.tensor(seq)})
    return SamplesFrame("sim", first_seq, samples)


def _sent() -> list[SamplesFrame | Ack]:
    return [
        _batch(0, 20, LARGE),  # runs of 8, 8 and 4
        Ack(upto_seq=3),
        _batch(20, 200, SMALL),  # one body of about 200 KiB
        _batch(220, 3, SMALL),  # a small body: gathered from the reads
        _batch(223, 17, LARGE, other_kind_at=230),  # two kinds in one large batch
        _batch(240, 9, LARGE),
    ]


def _assert_same(received: list[object], sent: list[SamplesFrame | Ack]) -> None:
    assert len(received) == len(sent)
    for got, want in zip(received, sent, strict=True):
        if isinstance(want, Ack):
            assert got == want
            continue
        assert isinstance(got, SamplesFrame)
        assert (got.producer, got.first_seq, len(got.samples)) == (
            want.producer,
            want.first_seq,
            len(want.samples),
        )
        for ours, theirs in zip(got.samples, want.samples, strict=True):
            assert sorted(ours) == sorted(theirs)
            for name, tensor in theirs.items():
                assert ours[name].dtype == tensor.dtype
                assert torch.equal(ours[name], tensor)


class _Socket:
    """The bytes of a stream, read as a socket reads them: into the decoder's target when it
    offers one (unless ``chunk_chance`` says a chunk waits), else handed to ``feed``."""

    def __init__(self, data: bytes, seed: int, chunk_chance: float) -> None:
        self.data, self.at = data, 0
        self.random = random.Random(seed)
        self.chunk_chance = chunk_chance
        self.landed = self.fed = 0

    def read_all(self, decoder: FrameDecoder) -> list[object]:
        decoder.direct = True
        items: list[object] = []
        while self.at < len(self.data):
            n = min(self.random.choice([1, 7, 4096, 65_536, 300_000, 1 << 20]), len(self.data) - self.at)
            target = decoder.receive_target()
            if target is not None and self.random.random() >= self.chunk_chance:
                n = min(n, len(target))
                target[:n] = self.data[self.at : self.at + n]
                decoder.landed(n)
                self.landed += n
                chunk = b""
            else:  # the protocol's own buffer holds 256 KiB
                n = min(n, 256 * 1024)
                chunk = self.data[self.at : self.at + n]
                self.fed += n
            self.at += n
            items.extend(message for message, _size in decoder.feed(chunk))
        return items


@pytest.mark.parametrize(("seed", "chunk_chance"), [(0, 0.0), (1, 0.0), (2, 0.3), (3, 0.9)])
def test_frames_read_into_their_bodies_decode_to_the_samples_sent(seed: int, chunk_chance: float) -> None:
    sent = _sent()
    stream = b"".join(encode_frame(message) for message in sent)
    socket = _Socket(stream, seed, chunk_chance)
    decoder = FrameDecoder()
    received = socket.read_all(decoder)
    _assert_same(received, sent)
    assert decoder.buffered == 0
    assert decoder.receive_target() is None
    if chunk_chance == 0.0:  # the large bodies went straight into their memory
        assert socket.landed > 0.6 * len(stream), (socket.landed, socket.fed)


def test_a_large_batch_s_runs_are_the_memory_the_socket_wrote() -> None:
    sent = _batch(0, 20, LARGE)
    frame = encode_frame(sent)
    decoder = FrameDecoder()
    decoder.direct = True
    assert decoder.feed(frame[:4096]) == []  # the length, the header and the start of the payload
    targets = []
    while (target := decoder.receive_target()) is not None:
        targets.append(target)
        begin = decoder.buffered  # every byte of the frame so far is with the decoder
        target[:] = frame[begin : begin + len(target)]
        decoder.landed(len(target))
    assert [len(t) for t in targets][-2:] == [8 * 65672, 4 * 65672]  # the last two runs, whole
    ((message, size),) = decoder.feed(b"")
    assert size == len(frame)
    _assert_same([message], [sent])
    assert {type(t.obj) for t in targets} == {bytearray}
    written = {id(t.obj) for t in targets}  # type: ignore[union-attr]
    pointers = {sample["x"].untyped_storage().data_ptr() for sample in message.samples}
    assert len(pointers) == 3  # one block of memory per run
    # The last two runs' samples view the bytearrays the socket wrote into, not copies of them.
    for target, samples in ((targets[-2], message.samples[8:16]), (targets[-1], message.samples[16:])):
        base = torch.frombuffer(target.obj, dtype=torch.uint8).data_ptr()  # type: ignore[arg-type]
        assert {sample["x"].untyped_storage().data_ptr() for sample in samples} == {base}
    assert len(written) == len(targets)


def test_a_stream_that_ends_inside_a_body_read_into_its_memory_is_seen_to() -> None:
    frame = encode_frame(_batch(0, 20, LARGE))
    decoder = FrameDecoder()
    decoder.direct = True
    decoder.feed(frame[:1000])
    target = decoder.receive_target()
    assert target is not None
    target[:500] = frame[1000:1500]
    decoder.landed(500)
    assert decoder.feed(b"") == []
    assert decoder.buffered == 1500  # what a connection's end of stream calls the middle of a frame


def test_a_small_body_is_gathered_from_the_reads_as_before() -> None:
    frame = encode_frame(_batch(0, 3, SMALL))
    assert len(frame) < DIRECT_BODY_BYTES
    decoder = FrameDecoder()
    decoder.direct = True
    assert decoder.feed(frame[:100]) == []
    assert decoder.receive_target() is None


async def test_over_tcp_the_stream_keeps_working_after_its_reads_go_into_the_bodies() -> None:
    sent = _sent()
    stream = b"".join(encode_frame(message) for message in sent)
    received: list[object] = []
    answered = anyio.Event()
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)

        async def serve(raw: anyio.abc.SocketStream) -> None:
            conn = FramedStream(raw, max_frame_bytes=8 << 20)
            assert conn.receive_into_frames()
            assert conn.decoder.direct
            assert not receive_into(conn.stream, conn.decoder)  # once: its protocol is not anyio's now
            while (message := await conn.receive()) is not None:
                received.append(message)
            await conn.send(encode_frame(Ack(upto_seq=len(received))))  # sending still works
            answered.set()
            await conn.aclose()

        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, serve)
            with anyio.fail_after(60):
                async with await anyio.connect_tcp("127.0.0.1", port) as client:
                    cut = random.Random(5)
                    at = 0
                    while at < len(stream):  # writes of every size, with pauses between some
                        n = cut.choice([3, 1000, 70_000, 600_000])
                        await client.send(stream[at : at + n])
                        at += n
                        if cut.random() < 0.2:
                            await anyio.sleep(0.002)
                    await client.send_eof()
                    await answered.wait()
                    reply = FrameDecoder()
                    ((ack, _size),) = reply.feed(await client.receive())
                    assert ack == Ack(upto_seq=len(sent))
            tg.cancel_scope.cancel()
    _assert_same(received, sent)


def _refusal(data: bytes, *, direct: bool) -> tuple[str, FrameDecoder]:
    """The FrameError of reading ``data`` (into the bodies' memory or gathered), and the decoder."""
    decoder = FrameDecoder()
    try:
        if direct:
            _Socket(data, seed=7, chunk_chance=0.0).read_all(decoder)
        else:
            decoder.feed(data)
    except FrameError as exc:
        return str(exc), decoder
    raise AssertionError("no FrameError")


@pytest.mark.parametrize("damage", ["sizes", "header"])
def test_a_malformed_large_frame_read_into_its_memory_is_refused_as_when_gathered(damage: str) -> None:
    frame = bytearray(encode_frame(_batch(0, 12, LARGE)))
    if damage == "sizes":  # the same length, 8 bytes fewer: the plan cannot use it
        bad = frame.replace(b'"sizes":[65672,', b'"sizes":[65664,', 1)
    else:  # a header that is not JSON
        bad = frame.replace(b'"producer"', b'"produce\xff"', 1)
    assert bad != frame
    gathered, _ = _refusal(bytes(bad), direct=False)
    direct, decoder = _refusal(bytes(bad), direct=True)
    assert direct == gathered
    assert decoder.receive_target() is None
    with pytest.raises(FrameError, match="unusable after an earlier bad frame"):
        decoder.feed(b"more")


class _BadPlan(FrameDecoder):
    """A protocol whose plan does not add up to the body: a bug the decoder names."""

    def plan_body(self, length: int) -> tuple[int, list[int]] | None:
        return 0, [length - 1]


def test_a_plan_that_does_not_fit_the_body_and_a_read_past_the_target_are_named() -> None:
    frame = encode_frame(_batch(0, 20, LARGE))
    decoder = _BadPlan()
    decoder.direct = True
    with pytest.raises(FrameError, match=r"planned layout 0 \+ \[\d+\] does not fit its body of \d+ bytes"):
        decoder.feed(frame[:1000])
    decoder = FrameDecoder()
    decoder.direct = True
    decoder.feed(frame[:1000])
    target = decoder.receive_target()
    assert target is not None
    with pytest.raises(ValueError, match=rf"{len(target) + 1} bytes landed in a target of {len(target)}"):
        decoder.landed(len(target) + 1)
