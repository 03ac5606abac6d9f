"""A producer's numbering and resend window (lamploop.streaming.outbox), without a socket."""

from __future__ import annotations

import random

import pytest
import torch

from lamploop.errors import FrameError, StreamingError
from lamploop.streaming.outbox import (
    DEFAULT_WINDOW_BYTES,
    DEFAULT_WINDOW_FLOOR,
    DEFAULT_WINDOW_SAMPLES,
    WRITE_BATCH_SAMPLES,
    Outbox,
    frame_full,
)
from lamploop.streaming.wire import FrameDecoder, SamplesFrame, encode_tensors

PAYLOAD = encode_tensors({"x": torch.ones(2)})
RECEIVER = "the receiver at test:1"


def outbox(window: int = 4, keep_acknowledged: int = 0, start_seq: int = 0, limit: int = 1 << 20) -> Outbox:
    return Outbox(
        "sim", window=window, keep_acknowledged=keep_acknowledged, start_seq=start_seq, max_frame_bytes=limit
    )


def seqs_in(frame: bytes) -> list[int]:
    decoder = FrameDecoder()
    ((message, _),) = decoder.feed(frame)
    assert isinstance(message, SamplesFrame)
    return list(range(message.first_seq, message.last_seq + 1))


def test_samples_are_numbered_in_order_and_the_window_holds_the_sender_back() -> None:
    box = outbox(window=3, start_seq=5)
    assert [box.keep(PAYLOAD) for _ in range(3)] == [5, 6, 7]
    assert box.unacknowledged == 3
    assert not box.has_room()
    assert box.acknowledge(6)
    assert not box.acknowledge(6)  # no news
    assert box.unacknowledged == 1
    assert box.has_room()
    assert [seq for seq, _ in box.frames] == [7]  # acknowledged ones dropped


def test_a_frame_holds_the_samples_after_the_last_one_sent_and_counts_resends() -> None:
    box = outbox(window=8)
    box.keep_run([PAYLOAD] * 5)
    count, frame = box.batch(after=-1, receiver=RECEIVER) or (0, b"")
    assert count == 5
    assert seqs_in(frame) == [0, 1, 2, 3, 4]
    assert box.record_sent(after=-1, count=count) == 4
    assert (box.sent, box.resent) == (5, 0)
    assert box.batch(after=4, receiver=RECEIVER) is None  # nothing new
    # The connection is lost; the receiver holds up to 1: 2..4 go out again, as resends.
    box.take_welcome(1, 1 << 20, receiver=RECEIVER)
    count, frame = box.batch(after=box.acked, receiver=RECEIVER) or (0, b"")
    assert seqs_in(frame) == [2, 3, 4]
    box.record_sent(after=1, count=count)
    assert (box.sent, box.resent) == (5, 3)


def test_samples_the_receiver_holds_are_skipped_not_sent() -> None:
    box = outbox(window=2)
    box.take_welcome(2, 1 << 20, receiver=RECEIVER)  # a restarted producer; the receiver holds 0..2
    assert [box.keep(PAYLOAD) for _ in range(4)] == [0, 1, 2, 3]
    assert box.skipped == 3
    assert [seq for seq, _ in box.frames] == [3]
    count, frame = box.batch(after=box.acked, receiver=RECEIVER) or (0, b"")
    assert (count, seqs_in(frame)) == (1, [3])


def test_acknowledged_samples_are_kept_for_a_receiver_restored_from_an_older_state() -> None:
    box = outbox(window=4, keep_acknowledged=2)
    box.keep_run([PAYLOAD] * 4)
    box.record_sent(after=-1, count=4)
    box.acknowledge(3)
    assert [seq for seq, _ in box.frames] == [2, 3]
    box.take_welcome(1, 1 << 20, receiver=RECEIVER)  # restored: it holds up to 1 only
    _, frame = box.batch(after=box.acked, receiver=RECEIVER) or (0, b"")
    assert seqs_in(frame) == [2, 3]
    with pytest.raises(StreamingError, match=r"holds seqs up to 0 only.*no longer has 1..1"):
        box.take_welcome(0, 1 << 20, receiver=RECEIVER)


def test_frames_are_cut_at_a_batchs_worth_and_at_the_receivers_limit() -> None:
    box = outbox(window=4096)
    box.keep_run([PAYLOAD] * (WRITE_BATCH_SAMPLES * 3))
    count, _ = box.batch(after=-1, receiver=RECEIVER) or (0, b"")
    assert count == WRITE_BATCH_SAMPLES * 3  # small samples: one frame (under 256 KiB)
    assert not frame_full(count, count * len(PAYLOAD))
    big = outbox(window=64)
    big.keep_run([bytes(10_000)] * 40)
    count, _ = big.batch(after=-1, receiver=RECEIVER) or (0, b"")
    assert count == WRITE_BATCH_SAMPLES  # 256 KiB and 32 samples: cut
    small = outbox(window=64)
    small.keep_run([PAYLOAD] * 40)
    small.take_welcome(-1, 4096, receiver=RECEIVER)  # the receiver takes 4 KiB frames
    count, frame = small.batch(after=-1, receiver=RECEIVER) or (0, b"")
    assert len(frame) - 4 <= 4096  # within the receiver's limit (the header's size bounded from above)
    assert 1 < count < 40


def test_a_sample_over_the_limit_is_refused_before_it_takes_a_seq() -> None:
    box = outbox(limit=4096)
    with pytest.raises(FrameError, match="over the limit of 4096 bytes"):
        box.keep(bytes(5000))
    assert box.next_seq == 0
    assert box.keep(PAYLOAD) == 0
    with pytest.raises(StreamingError, match="sample 5 would go out as 1"):
        box.keep(PAYLOAD, expected_seq=5)
    box.take_welcome(-1, 4096, receiver=RECEIVER)
    assert box.receiver_limit == 4096
    box2 = outbox(limit=1 << 20)
    box2.keep(bytes(8000))
    box2.take_welcome(-1, 4096, receiver=RECEIVER)  # the receiver takes less than this producer
    with pytest.raises(StreamingError, match="sample 0 cannot be sent to the receiver at test:1"):
        box2.batch(after=-1, receiver=RECEIVER)


def test_a_frame_is_due_once_a_batchs_worth_or_half_the_window_waits() -> None:
    box = outbox(window=8)
    box.keep_run([PAYLOAD] * 3)
    assert not box.frame_due()
    box.keep(PAYLOAD)
    assert box.frame_due()  # half the window
    box.batch(after=-1, receiver=RECEIVER)
    assert not box.frame_due()  # taken by a frame


def _default_window(start_seq: int = 0, keep_acknowledged: int = 0) -> Outbox:
    return Outbox(
        "sim",
        window=DEFAULT_WINDOW_SAMPLES,
        window_bytes=DEFAULT_WINDOW_BYTES,
        window_floor=DEFAULT_WINDOW_FLOOR,
        keep_acknowledged=keep_acknowledged,
        start_seq=start_seq,
        max_frame_bytes=64 << 20,
    )


def _kept_until_full(box: Outbox, size: int) -> int:
    kept = 0
    while box.has_room(size):
        box.keep(b"\0" * size)
        kept += 1
    return kept


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (1024, 256),  # small samples: the window's 256
        (32 * 1024, 128),  # 4 MiB of them, exactly
        (32 * 1024 + 1, 127),  # one more would be over 4 MiB
        (64 * 1024, 64),
        (1 << 20, 64),  # large ones: the floor, the former default
    ],
)
def test_the_default_window_holds_256_samples_of_at_most_4_mib_and_64_whatever_their_size(
    size: int, expected: int
) -> None:
    box = _default_window()
    assert _kept_until_full(box, size) == expected
    assert box.pending_bytes == expected * size
    assert box.acknowledge(9)  # ten leave the window: room for ten more
    assert box.pending_bytes == (expected - 10) * size
    assert _kept_until_full(box, size) == 10


def test_the_windows_bytes_follow_acks_welcomes_and_runs_as_a_recount_does() -> None:
    """pending_bytes, kept step by step, equals the bytes of the kept samples after the acked
    seq counted afresh, through keeps, runs, acks, a receiver restored from an older state and
    samples the receiver held already."""
    rng = random.Random(3)
    box = _default_window(start_seq=10, keep_acknowledged=5)
    box.take_welcome(14, 1 << 20, receiver=RECEIVER)  # the receiver holds 10..14 already
    for step in range(400):
        move = rng.random()
        if move < 0.4 and box.has_room(size := rng.randrange(1, 70_000)):
            box.keep(b"\0" * size)
        elif move < 0.6 and box.has_room():
            payloads = [b"\0" * rng.randrange(1, 40_000) for _ in range(rng.randrange(1, 9))]
            if box.next_seq > box.acked:
                box.keep_run(payloads[: box.fitting(payloads)])
        elif move < 0.9:
            box.acknowledge(rng.randrange(box.acked, max(box.next_seq, box.acked + 1)))
        elif box.frames:  # reconnected to a receiver that holds a little less (within what is kept)
            box.take_welcome(max(box.lowest_kept - 1, box.acked - 2), 1 << 20, receiver=RECEIVER)
        recount = sum(len(payload) for seq, payload in box.frames if seq > box.acked)
        assert box.pending_bytes == recount, step
        assert box.unacknowledged <= DEFAULT_WINDOW_SAMPLES


def test_fitting_counts_what_keep_would_take_one_by_one() -> None:
    box = _default_window()
    assert _kept_until_full(box, 70_000) == 64  # the floor: 64 of them are over 4 MiB
    assert box.fitting([b"\0"] * 10) == 0
    box.acknowledge(box.acked + 3)
    assert box.fitting([b"\0" * 70_000] * 10) == 3
    assert box.has_room(70_000)
    box.acknowledge(box.next_seq - 1)
    sizes = [1_000_000, 1_000_000, 3_000_000, 10, 10]
    assert box.fitting([b"\0" * n for n in sizes]) == 5  # fewer than 64 kept: the floor lets them in
