"""The TCP control channel's wire format: frames, strict decoding, size limits and handshake proofs."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lamploop.control import Rendezvous, Stop, Train, Valid
from lamploop.control.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Challenge,
    EndOfMessages,
    FrameDecoder,
    Heartbeat,
    Hello,
    Message,
    Refuse,
    Welcome,
    decode_body,
    encode_frame,
    follower_proof,
    is_nonce,
    new_nonce,
    proof_matches,
    root_proof,
)
from lamploop.errors import ConfigurationError, FrameError
from lamploop.modelspec import ModelSpec, TensorSpec

pytestmark = pytest.mark.timeout(30)

SPEC = ModelSpec((TensorSpec("fc.weight", (10, 4), "float32"), TensorSpec("fc.bias", (10,), "float32")))

epochs = st.integers(min_value=0, max_value=2**62)
finite = st.floats(allow_nan=False, allow_infinity=False)
specs = st.builds(
    ModelSpec,
    st.lists(
        st.builds(
            TensorSpec,
            name=st.text(max_size=20),
            shape=st.lists(st.integers(0, 2**40), max_size=4).map(tuple),
            dtype=st.sampled_from(["float32", "float16", "bfloat16", "int64", "bool"]),
        ),
        max_size=5,
    ).map(tuple),
)
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Train, epoch=epochs, lr_factor=finite),
    st.builds(Valid, epoch=epochs),
    st.builds(Stop, reason=st.text()),
    st.builds(Rendezvous, host=st.text(), port=st.integers(0, 65535)),
    st.builds(Challenge, protocol_version=st.integers(), nonce=st.text()),
    st.builds(
        Hello,
        protocol_version=st.integers(),
        rank=st.integers(),
        nranks=st.integers(),
        model_spec=specs,
        nonce=st.text(),
        proof=st.text(),
    ),
    st.builds(Welcome, proof=st.text()),
    st.builds(Refuse, reason=st.text()),
    st.just(Heartbeat()),
    st.just(EndOfMessages()),
    st.builds(Abort, reason=st.text()),
)


def body_of(frame: bytes) -> bytes:
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    return frame[4:]


def hello_body(**changes: object) -> bytes:
    fields = {"type": "hello", "protocol_version": 1, "rank": 1, "nranks": 2, "nonce": "n", "proof": "p"}
    return json.dumps({**fields, **changes}).encode()


def frame_of(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


# --- round trips -------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(message=messages)
def test_every_message_round_trips_fed_byte_by_byte(message: Message) -> None:
    frame = encode_frame(message)
    decoder = FrameDecoder()
    decoded: list[Message] = []
    for i in range(len(frame)):
        decoded += decoder.feed(frame[i : i + 1])
        if i < len(frame) - 1:
            assert decoded == []
            assert decoder.buffered == i + 1
    assert decoded == [message]
    assert decoder.buffered == 0


@settings(max_examples=100, deadline=None)
@given(batch=st.lists(messages, min_size=1, max_size=8), data=st.data())
def test_a_stream_of_messages_round_trips_in_random_chunks(batch: list[Message], data: st.DataObject) -> None:
    stream = b"".join(encode_frame(m) for m in batch)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(stream)), max_size=10)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    decoder = FrameDecoder()
    decoded = [m for chunk in chunks for m in decoder.feed(chunk)]
    assert decoded == batch


def test_the_body_is_tagged_json() -> None:
    body = body_of(encode_frame(Train(epoch=3, lr_factor=0.5)))
    assert json.loads(body) == {"type": "train", "epoch": 3, "lr_factor": 0.5}
    hello = Hello(PROTOCOL_VERSION, 1, 2, SPEC, "n", "p")
    assert json.loads(body_of(encode_frame(hello)))["model_spec"] == [
        ["fc.weight", [10, 4], "float32"],
        ["fc.bias", [10], "float32"],
    ]


def test_the_control_package_never_pickles() -> None:
    import lamploop.control

    for module in Path(lamploop.control.__file__).parent.glob("*.py"):
        source = module.read_text()
        assert not re.search(r"^\s*(import|from)\s+(pickle|marshal|shelve)\b", source, re.MULTILINE), module
        assert "torch.load" not in source, module


# --- size limits in both directions --------------------------------------------------------------


def test_an_oversized_header_is_refused_before_the_body_arrives() -> None:
    decoder = FrameDecoder(max_frame_bytes=100)
    assert decoder.feed(struct.pack(">I", 101)[:3]) == []  # not a whole header yet
    with pytest.raises(FrameError, match="a frame announces 101 bytes, over the limit of 100 bytes"):
        decoder.feed(struct.pack(">I", 101)[3:])  # the 4th header byte: no body was sent


def test_a_frame_at_the_limit_is_accepted() -> None:
    message = Stop(reason="x" * 50)
    size = len(body_of(encode_frame(message)))
    assert FrameDecoder(max_frame_bytes=size).feed(encode_frame(message, max_frame_bytes=size)) == [message]
    with pytest.raises(FrameError, match="over the limit"):
        FrameDecoder(max_frame_bytes=size - 1).feed(encode_frame(message))


def test_encoding_refuses_a_frame_over_the_limit() -> None:
    with pytest.raises(FrameError, match=r"a Stop frame of \d+ bytes is over the limit of 64 bytes"):
        encode_frame(Stop(reason="y" * 100), max_frame_bytes=64)


def test_the_default_limit_fits_a_large_model_spec() -> None:
    spec = ModelSpec(
        tuple(TensorSpec(f"layers.{i}.attention.weight", (4096, 4096), "bfloat16") for i in range(20000))
    )
    hello = Hello(PROTOCOL_VERSION, 1, 8, spec, new_nonce(), "0" * 64)
    assert len(encode_frame(hello)) < DEFAULT_MAX_FRAME_BYTES


# --- malformed frames ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"", "not UTF-8 JSON"),
        (b"not json", "not UTF-8 JSON"),
        (b"\xff\xfe{}", "not UTF-8 JSON"),
        (b'{"type": "train", "epoch": 1, "lr_factor": NaN}', "NaN is not valid JSON"),
        (b"[" * 100_000, "not UTF-8 JSON"),  # nesting deep enough to exhaust the recursion limit
        (b"[1, 2]", "a JSON list, not an object"),
        (b'{"epoch": 1}', "unknown message type None"),
        (b'{"type": "pickle", "data": "gASVAA=="}', "unknown message type 'pickle'"),
        (b'{"type": 7}', "unknown message type 7"),
        (b'{"type": "train", "lr_factor": 1.0}', r"malformed 'train' message: missing field 'epoch'"),
        (b'{"type": "train", "epoch": 1, "lr_factor": 1.0, "x": 0}', "Extra fields.*: x"),
        (
            b'{"type": "train", "epoch": "1", "lr_factor": 1.0}',
            r"expected an integer, got str '1' @ \$\.epoch",
        ),
        (b'{"type": "train", "epoch": true, "lr_factor": 1.0}', r"expected an integer, got bool"),
        (b'{"type": "train", "epoch": 1.5, "lr_factor": 1.0}', r"expected an integer, got float"),
        (
            b'{"type": "train", "epoch": -1, "lr_factor": 1.0}',
            r"Train.epoch must be an int in \[0, inf\], got -1",
        ),
        (b'{"type": "train", "epoch": 1, "lr_factor": "fast"}', "expected a number"),
        (
            b'{"type": "rendezvous", "host": "h", "port": 70000}',
            r"Rendezvous.port must be an int in \[0, 65535\]",
        ),
        (b'{"type": "heartbeat", "beat": 1}', "Extra fields"),
        (hello_body(model_spec=[["w", [-1], "float32"]]), "a model spec entry is"),
        (hello_body(model_spec=[["w", [1], "float32", "extra"]]), "a model spec entry is"),
        (hello_body(model_spec={"w": [1]}), "a model spec is a list"),
    ],
)
def test_malformed_bodies_are_refused(body: bytes, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        decode_body(body)
    with pytest.raises(FrameError, match=match):
        FrameDecoder().feed(frame_of(body))


def test_messages_before_a_bad_frame_are_not_lost_but_the_decoder_stops_after_it() -> None:
    decoder = FrameDecoder()
    good = encode_frame(Heartbeat())
    assert decoder.feed(good) == [Heartbeat()]
    with pytest.raises(FrameError, match="not UTF-8 JSON"):
        decoder.feed(frame_of(b"junk") + good)
    with pytest.raises(FrameError, match="unusable after an earlier bad frame"):
        decoder.feed(good)


def test_non_finite_numbers_cannot_be_encoded() -> None:
    # A command refuses a non-finite factor itself (no channel could carry it as JSON) ...
    with pytest.raises(ConfigurationError, match=r"Train\.lr_factor must be a finite number, got inf"):
        Train(epoch=0, lr_factor=float("inf"))
    # ... and a message that holds one anyway is refused by the encoder.
    hacked = Train(epoch=0, lr_factor=1.0)
    object.__setattr__(hacked, "lr_factor", float("nan"))
    with pytest.raises(FrameError, match="cannot encode 'train' message"):
        encode_frame(hacked)


def test_only_control_messages_can_be_encoded() -> None:
    with pytest.raises(FrameError, match=r"'dict'.*not a control message"):
        encode_frame({"type": "train"})  # type: ignore[arg-type]


# --- handshake proofs ------------------------------------------------------------------------------


def test_nonces_are_fresh_hex() -> None:
    a, b = new_nonce(), new_nonce()
    assert a != b
    assert is_nonce(a)
    assert is_nonce(b)
    assert not is_nonce(a.upper())
    assert not is_nonce(a[:-1])
    assert not is_nonce("g" * 64)


def test_proofs_bind_the_token_the_nonces_and_every_hello_field() -> None:
    token, root_nonce = b"secret", new_nonce()
    hello = Hello(PROTOCOL_VERSION, 1, 2, SPEC, new_nonce(), proof="")
    proof = follower_proof(token, root_nonce=root_nonce, hello=hello)
    assert proof == follower_proof(token, root_nonce=root_nonce, hello=attrs.evolve(hello, proof="ignored"))
    assert proof != follower_proof(b"secreT", root_nonce=root_nonce, hello=hello)
    assert proof != follower_proof(token, root_nonce=new_nonce(), hello=hello)
    changed = [
        attrs.evolve(hello, protocol_version=PROTOCOL_VERSION + 1),
        attrs.evolve(hello, rank=2),
        attrs.evolve(hello, nranks=3),
        attrs.evolve(hello, model_spec=ModelSpec(SPEC.tensors[:1])),
        attrs.evolve(hello, nonce=new_nonce()),
    ]
    for other in changed:
        assert proof != follower_proof(token, root_nonce=root_nonce, hello=other), other
    # The root's proof is not the follower's (no reflection), and it binds the follower's nonce.
    answer = root_proof(token, root_nonce=root_nonce, hello=hello)
    assert answer != proof
    assert answer != root_proof(token, root_nonce=root_nonce, hello=attrs.evolve(hello, nonce=new_nonce()))


def test_proof_comparison_accepts_any_string() -> None:
    proof = follower_proof(b"k", root_nonce=new_nonce(), hello=Hello(1, 1, 2, SPEC, new_nonce(), ""))
    assert proof_matches(proof, proof)
    assert not proof_matches(proof, proof[:-1])
    assert not proof_matches(proof, "é" * 64)
