"""A receiver's decoder copies a large batch's runs straight from the received bytes (one copy).

The samples must come out as :func:`decode_body` gives them (bitwise, in order, each holding its
run of samples, not the whole frame), whatever the cut of the bytes into reads, also when the
samples of one frame differ in kind; a malformed batch is refused as before.
"""

from __future__ import annotations

import pytest
import torch

from lamploop.errors import FrameError
from lamploop.streaming.wire import FrameDecoder, SamplesFrame, decode_body, encode_frame

FLOATS = 16384  # 64 KiB of float32: runs of 8 samples, 512 KiB each


def _samples(count: int, *, other_kind_at: int | None = None) -> list[dict[str, torch.Tensor]]:
    samples = []
    for seq in range(count):
        name = "z" if seq == other_kind_at else "x"  # a name of the same length: the same size
        samples.append({name: torch.arange(FLOATS, dtype=torch.float32) + seq, "y": torch.tensor(seq)})
    return samples


def _feed(frame: bytes, cuts: list[int]) -> list[SamplesFrame]:
    decoder = FrameDecoder()
    decoded = []
    begin = 0
    for end in [*cuts, len(frame)]:
        for message, size in decoder.feed(frame[begin:end]):
            assert size == len(frame)
            assert isinstance(message, SamplesFrame)
            decoded.append(message)
        begin = end
    assert decoder.buffered == 0
    return decoded


@pytest.mark.parametrize("cuts", [[], [3, 1000, 700_001, 700_002], list(range(1, 1_400_000, 65_537))])
def test_a_large_batch_decodes_as_decode_body_does_each_sample_holding_its_run(cuts: list[int]) -> None:
    sent = _samples(20)  # runs of 8, 8 and 4 samples
    frame = encode_frame(SamplesFrame("sim", 5, sent))
    (message,) = _feed(frame, cuts)
    reference = decode_body(bytearray(frame[4:]))
    assert isinstance(reference, SamplesFrame)
    assert (message.producer, message.first_seq, len(message.samples)) == ("sim", 5, 20)
    storages = []
    for seq, (ours, theirs) in enumerate(zip(message.samples, reference.samples, strict=True)):
        assert sorted(ours) == ["x", "y"]
        for name in ("x", "y"):
            assert torch.equal(ours[name], sent[seq][name])
            assert torch.equal(ours[name], theirs[name])
        storage = ours["x"].untyped_storage()
        assert storage.nbytes() == (8 if seq < 16 else 4) * 65672  # its run's samples, not the whole frame
        storages.append(storage.data_ptr())
    assert len(set(storages)) == 3  # one block of memory per run
    assert message.signatures[0] is message.signatures[19]  # one header: one signature


def test_a_large_batch_of_samples_of_two_kinds_decodes_each_by_its_own_header() -> None:
    sent = _samples(20, other_kind_at=11)
    frame = encode_frame(SamplesFrame("sim", 0, sent))
    (message,) = _feed(frame, [500_000])
    for seq, tensors in enumerate(message.samples):
        assert sorted(tensors) == sorted(sent[seq])
        for name, tensor in tensors.items():
            assert torch.equal(tensor, sent[seq][name])
    assert message.signatures[11] != message.signatures[10]
    assert message.signatures[10] == message.signatures[12]


def test_a_large_batch_whose_sizes_do_not_match_its_payload_is_refused_for_good() -> None:
    frame = bytearray(encode_frame(SamplesFrame("sim", 0, _samples(12))))
    decoder = FrameDecoder()
    short = frame.replace(b'"sizes":[65672,', b'"sizes":[65664,', 1)  # the same length, 8 bytes fewer
    assert short != frame
    with pytest.raises(FrameError, match=r"sizes .* make"):
        decoder.feed(bytes(short))
    with pytest.raises(FrameError, match="unusable"):
        decoder.feed(bytes(frame))
