"""Acceptance tests of the shared transport and three concept pages, written from the docs alone.

Sources: docs/transport.md (the modules of ``lamploop.transport`` and their promises, the one
handshake and its order of checks on both sides, the differences on purpose between the control
channel, streaming and federated), docs/concepts/control-channels.md, docs/concepts/loop-state.md,
docs/concepts/sync-strategies.md, /work/shared/DESIGN.md and the public docstrings of the modules
named there.  What other acceptance modules already pin (tests/control/test_acceptance_docs_control.py,
tests/test_acceptance_docs.py, tests/transport/test_transport_conformance.py) is not repeated.

Real parts only: sockets on 127.0.0.1 (the real control root, sample receiver and aggregator, or a
fake server written here that speaks the frames by hand, to play a server that misbehaves), TLS
with certificates made by trustme, one follower in a child process killed with SIGKILL.  Every
wait is bounded.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import attrs
import pytest
import torch
import trustme
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from support import ROOT

import lamploop
from lamploop.control import (
    Rendezvous,
    Stop,
    TcpControlFollower,
    TcpControlRoot,
    Train,
    Valid,
    local_control,
)
from lamploop.control import wire as control_wire
from lamploop.errors import (
    ConfigurationError,
    ControlChannelError,
    FrameError,
    HandshakeError,
    PeerLostError,
    StreamingError,
    TransportError,
)
from lamploop.federated import wire as federated_wire
from lamploop.federated.link import Link, join_aggregator
from lamploop.modelspec import ModelSpec, TensorSpec
from lamploop.state import converter
from lamploop.streaming import FifoBuffer
from lamploop.streaming import wire as stream_wire
from lamploop.streaming.producer import AsyncProducer
from lamploop.streaming.receiver import SampleReceiver
from lamploop.transport import frames, handshake, proofs
from lamploop.transport.connection import GOODBYE_TIMEOUT, FramedConnection
from lamploop.transport.envelope import canonical_json
from lamploop.transport.listen import serve_tcp
from lamploop.transport.settings import check_int_in, check_seconds_each
from lamploop.transport.strangers import REFUSALS_LOGGER, PendingHandshakes, RefusalLog, spoke_first
from lamploop.transport.tls import check_context, wrap

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKEN = "acceptance transport token"
TOKEN_BYTES = TOKEN.encode()
SPEC = ModelSpec((TensorSpec("fc.weight", (10, 4), "float32"), TensorSpec("fc.bias", (10,), "float32")))
RDV = Rendezvous(host="127.0.0.1", port=29500)
WRONG_TOKEN = "the proof of the shared token did not match (wrong token?)"


# ---------------------------------------------------------------------------------------------
# helpers


def header(length: int) -> bytes:
    return length.to_bytes(4, "big")


def json_frame(obj: dict[str, Any], *, prefix: int = 0) -> bytes:
    """A frame by hand: 4-byte length, then (streaming, federated) a 2-byte header length, the JSON."""
    document = json.dumps(obj).encode()
    body = (len(document).to_bytes(prefix, "big") if prefix else b"") + document
    return header(len(body)) + body


class BytesDecoder(frames.FrameDecoder[bytes]):
    """The smallest protocol: a body is its bytes; the body b"bad" does not decode."""

    def decode_body(self, body: bytearray) -> bytes:
        if body == b"bad":
            raise FrameError("a bad body")
        return bytes(body)


async def tcp_pair() -> tuple[SocketStream, SocketStream]:
    """Both ends of one TCP connection on 127.0.0.1: (client, server)."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener:
        client = await anyio.connect_tcp("127.0.0.1", listener.extra(SocketAttribute.local_port))
        server = await listener.listeners[0].accept()
    return client, server


async def drain(stream: Any) -> bytes:
    data = bytearray()
    with suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        while True:
            data += await stream.receive()
    return bytes(data)


async def read_body(reader: BufferedByteReceiveStream) -> bytes:
    size = int.from_bytes(await reader.receive_exactly(4), "big")
    return await reader.receive_exactly(size)


class FakeServer:
    """A server that speaks first with ``first``, reads the client's hello (one frame) and
    answers it with ``answer`` (``None``: hangs up instead); counts connections and hellos."""

    def __init__(self, first: bytes, answer: bytes | None) -> None:
        self.first = first
        self.answer = answer
        self.connections = 0
        self.hellos: list[bytes] = []

    async def serve(self, stream: SocketStream) -> None:
        async with stream:
            self.connections += 1
            await stream.send(self.first)
            reader = BufferedByteReceiveStream(stream)
            try:
                with anyio.fail_after(3):
                    body = await read_body(reader)
            except (
                TimeoutError,
                anyio.EndOfStream,
                anyio.IncompleteRead,
                anyio.BrokenResourceError,
                OSError,
            ):
                return
            self.hellos.append(body)
            if self.answer is not None:
                with suppress(anyio.BrokenResourceError, OSError):
                    await stream.send(self.answer)
                with anyio.move_on_after(3):
                    await drain(stream)


@asynccontextmanager
async def fake_server(first: bytes, answer: bytes | None) -> AsyncIterator[tuple[int, FakeServer]]:
    server = FakeServer(first, answer)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, server.serve)
        yield listener.extra(SocketAttribute.local_port), server
        group.cancel_scope.cancel()


async def outcome_of(client: Callable[[], Awaitable[object]], within: float = 15.0) -> BaseException | None:
    try:
        with anyio.fail_after(within):
            await client()
    except Exception as error:
        return error
    return None


# ---------------------------------------------------------------------------------------------
# transport/frames.py: the length checked at the header, one frame at a time before the proof,
# a stream that cannot be used after a bad frame


def test_a_frame_over_the_limit_is_refused_at_its_4_byte_header() -> None:
    """transport.md: 'a 4-byte length checked at the header, before a byte of the body is
    buffered'; the FrameError names the announced size and the limit."""
    assert frames.HEADER_BYTES == 4
    decoder = BytesDecoder(max_frame_bytes=10)
    with pytest.raises(FrameError) as caught:
        decoder.feed(header(11))  # the header alone: no body byte was ever sent
    assert "11" in str(caught.value), str(caught.value)
    assert "10" in str(caught.value), str(caught.value)

    split = BytesDecoder(max_frame_bytes=10)  # a header that arrives in two reads
    assert split.feed(header(1 << 30)[:2]) == []
    with pytest.raises(FrameError):
        split.feed(header(1 << 30)[2:])

    exact = BytesDecoder(max_frame_bytes=10)  # the limit itself is taken, its body in pieces
    assert exact.feed(header(10) + b"01234") == []
    assert exact.feed(b"56789" + header(0)) == [b"0123456789", b""]
    assert exact.buffered == 0


@pytest.mark.parametrize("bad", [header(11), header(3) + b"bad"], ids=["oversized", "undecodable"])
def test_after_a_bad_frame_the_decoder_refuses_everything(bad: bytes) -> None:
    """frames.py: 'after a FrameError the stream cannot be resynchronised: every later feed
    raises again' (transport.md: 'a stream that cannot be used after a bad frame')."""
    decoder = BytesDecoder(max_frame_bytes=10)
    with pytest.raises(FrameError):
        decoder.feed(bad)
    for later in (b"", header(2) + b"ok", b"more"):
        with pytest.raises(FrameError):
            decoder.feed(later)


def test_one_frame_at_a_time_until_the_peer_proved_the_token() -> None:
    """transport.md: 'the pre-authentication limit ... and one frame at a time until the peer
    proved the token'; FrameDecoder.authenticated lifts both."""
    decoder = BytesDecoder(max_frame_bytes=8, one_at_a_time=True)
    data = header(1) + b"a" + header(2) + b"bc" + header(20) + b"x" * 20
    assert decoder.feed(data) == [b"a"]
    assert decoder.buffered == len(data) - 5
    assert decoder.feed(b"") == [b"bc"]
    decoder.authenticated(64)  # the 20-byte frame was never judged under the limit of 8
    assert decoder.max_frame_bytes == 64
    assert decoder.feed(b"") == [b"x" * 20]
    assert decoder.feed(header(1) + b"d" + header(1) + b"e") == [b"d", b"e"]


def test_a_frame_is_its_length_then_its_body_and_parts_join_to_it() -> None:
    """transport.md: frames (`frame`, and `frame_parts` for a frame sent in parts); frames.py:
    FrameError for a body over the limit, naming the message; large parts 'as they are'."""
    assert frames.frame([b"ab", b"c"], "Train", 3) == header(3) + b"abc"
    with pytest.raises(FrameError) as caught:
        frames.frame([b"ab", b"cd"], "Train", 3)
    assert "Train" in str(caught.value), str(caught.value)
    big = b"x" * frames.SCATTER_BYTES
    parts = frames.frame_parts([b"h", big, b"t"], "Samples", 1 << 20)
    assert b"".join(parts) == frames.frame([b"h", big, b"t"], "Samples", 1 << 20)
    assert any(part is big for part in parts)  # not copied
    with pytest.raises(FrameError):
        frames.frame_parts([big], "Samples", 100)


def test_the_pre_authentication_limits_of_the_table() -> None:
    """transport.md: streaming and federated take PREAUTH_FRAME_BYTES before the proof, the
    control channel max(4 x PREAUTH_FRAME_BYTES, 2 x own hello); frames.preauth_frame_bytes:
    'never over max_frame_bytes'."""
    limit = frames.PREAUTH_FRAME_BYTES
    assert stream_wire.PREAUTH_FRAME_BYTES == federated_wire.PREAUTH_FRAME_BYTES == limit
    assert frames.preauth_frame_bytes(1 << 20) == limit
    assert frames.preauth_frame_bytes(1 << 20, floor_factor=4) == 4 * limit
    assert frames.preauth_frame_bytes(1 << 20, hello_bytes=limit, floor_factor=4) == 4 * limit
    assert frames.preauth_frame_bytes(1 << 20, hello_bytes=3 * limit, floor_factor=4) == 6 * limit
    assert frames.preauth_frame_bytes(5 * limit, hello_bytes=3 * limit, floor_factor=4) == 5 * limit
    assert frames.preauth_frame_bytes(limit // 2) == limit // 2


# ---------------------------------------------------------------------------------------------
# transport/envelope.py: canonical JSON tagged with a "type", strict decoding in all three


def test_messages_travel_as_canonical_json_tagged_with_their_type() -> None:
    """envelope.py: 'the canonical JSON (sorted keys, no spaces, no NaN) of an object whose
    "type" field names the message'; a non-finite number or a non-message is a FrameError."""
    assert canonical_json({"b": 1, "a": [1, 2.5], "c": {"y": None, "x": True}}) == (
        b'{"a":[1,2.5],"b":1,"c":{"x":true,"y":null}}'
    )
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="JSON"):
            canonical_json({"a": bad})
    assert control_wire.encode_frame(Train(epoch=1, lr_factor=0.5))[4:] == (
        b'{"epoch":1,"lr_factor":0.5,"type":"train"}'
    )
    with pytest.raises(FrameError):
        control_wire.ENVELOPE.dump({"type": "stop", "reason": math.nan})
    for wire in (control_wire, stream_wire, federated_wire):
        with pytest.raises(FrameError) as caught:
            wire.encode_frame("not a message")  # type: ignore[arg-type]
        assert "str" in str(caught.value), str(caught.value)


WIRES = {"control": (control_wire, 0), "streaming": (stream_wire, 2), "federated": (federated_wire, 2)}


def challenge_body(protocol: str, **fields: Any) -> bytes:
    wire, prefix = WIRES[protocol]
    obj = {"type": "challenge", "protocol_version": wire.PROTOCOL_VERSION, "nonce": proofs.new_nonce()}
    obj.update(fields)
    return json_frame(obj, prefix=prefix)[4:]


@pytest.mark.parametrize("protocol", list(WIRES))
def test_every_protocol_decodes_strictly_and_names_what_is_wrong(protocol: str) -> None:
    """envelope.py: JSON values 'of the exact type only (no "1" for 1, no true for 1, no 1.5 for
    an integer)'; 'Whatever does not decode is a FrameError that says what and where'; extra keys
    refused. transport.md: header fields are checked by the converter (control, federated) or by
    hand-written checks (streaming): the same verdicts either way."""
    wire, prefix = WIRES[protocol]
    assert wire.decode_body(challenge_body(protocol)).protocol_version == wire.PROTOCOL_VERSION
    for value in ("1", True, 1.5, None, [1]):
        with pytest.raises(FrameError) as caught:
            wire.decode_body(challenge_body(protocol, protocol_version=value))
        assert "protocol_version" in str(caught.value), (value, str(caught.value))
    with pytest.raises(FrameError) as caught:
        wire.decode_body(challenge_body(protocol, surplus_field=1))
    assert "surplus_field" in str(caught.value), str(caught.value)
    no_version = json_frame({"type": "challenge", "nonce": proofs.new_nonce()}, prefix=prefix)[4:]
    with pytest.raises(FrameError) as caught:
        wire.decode_body(no_version)
    assert "protocol_version" in str(caught.value), str(caught.value)
    with pytest.raises(FrameError) as caught:
        wire.decode_body(json_frame({"type": "no_such_message"}, prefix=prefix)[4:])
    assert "no_such_message" in str(caught.value), str(caught.value)
    with pytest.raises(FrameError):
        wire.decode_body(json_frame([1, 2], prefix=prefix)[4:])  # type: ignore[arg-type]
    not_utf8 = (b"\x00\x02" if prefix else b"") + b"\xff\xfe"
    with pytest.raises(FrameError):
        wire.decode_body(not_utf8)


def test_the_challenge_difference_on_purpose() -> None:
    """transport.md table 'the challenge': the control channel's own class decodes any nonce
    (the follower judges it); streaming's and federated's (the transport's Challenge): 'a
    malformed nonce does not decode'."""
    assert control_wire.decode_body(challenge_body("control", nonce="xyz")).nonce == "xyz"
    assert stream_wire.Challenge is federated_wire.Challenge is handshake.Challenge
    for protocol in ("streaming", "federated"):
        with pytest.raises(FrameError) as caught:
            WIRES[protocol][0].decode_body(challenge_body(protocol, nonce="xyz"))
        assert "nonce" in str(caught.value), str(caught.value)


def test_what_a_proof_signs_of_a_hello_per_protocol() -> None:
    """transport.md table: a proof signs the hello as its tagged JSON, "type" included (control),
    or its fields untagged (streaming, federated); envelope.Envelope.transcript: 'the canonical JSON
    of its fields but proof'."""
    nonce = proofs.new_nonce()
    control = control_wire.Hello(control_wire.PROTOCOL_VERSION, 1, 2, SPEC, nonce, "ab" * 32)
    text = control_wire.ENVELOPE.transcript(control, tagged=True)
    fields = json.loads(text)
    assert fields["type"] == "hello"
    assert "proof" not in fields
    assert {"protocol_version", "rank", "nranks", "model_spec", "nonce"} <= set(fields)
    assert canonical_json(fields) == text
    streaming = stream_wire.Hello(stream_wire.PROTOCOL_VERSION, "sim", nonce, "ab" * 32)
    text = stream_wire.ENVELOPE.transcript(streaming, tagged=False)
    assert json.loads(text) == {
        "protocol_version": stream_wire.PROTOCOL_VERSION,
        "producer": "sim",
        "nonce": nonce,
    }
    assert canonical_json(json.loads(text)) == text
    federated = federated_wire.Hello(federated_wire.PROTOCOL_VERSION, "node-0", nonce, "ab" * 32)
    text = federated_wire.ENVELOPE.transcript(federated, tagged=False)
    assert json.loads(text) == {
        "protocol_version": federated_wire.PROTOCOL_VERSION,
        "node": "node-0",
        "nonce": nonce,
    }


# ---------------------------------------------------------------------------------------------
# transport/proofs.py: the token, nonces, HMAC-SHA256 proofs with a label per kind


def test_token_proofs_are_hmac_sha256_bound_to_token_label_and_each_part() -> None:
    """proofs.py: HMAC-SHA256 as hex of a label and parts 'each part length-prefixed so that no
    two lists of parts read alike'; the docstring's example."""
    proof = proofs.token_proof(b"secret", b"example proof", b"part")
    assert len(proof) == 64
    assert set(proof) <= set("0123456789abcdef")
    assert proofs.proof_matches(proof, proofs.token_proof(b"secret", b"example proof", b"part"))
    assert not proofs.proof_matches(proof, proofs.token_proof(b"secreT", b"example proof", b"part"))
    assert not proofs.proof_matches(proof, proofs.token_proof(b"secret", b"another label", b"part"))
    assert proofs.token_proof(b"k", b"L", b"ab", b"c") != proofs.token_proof(b"k", b"L", b"a", b"bc")
    assert proofs.token_proof(b"k", b"L", b"ab") != proofs.token_proof(b"k", b"L", b"ab", b"")


@pytest.mark.parametrize("received", ["", "x", "é" * 64, "AB" * 32, "\x00" * 64])
def test_proof_matches_takes_any_string(received: str) -> None:
    """proofs.proof_matches: 'Constant-time comparison of two proofs (any string is accepted as
    received)': a non-hex, non-ASCII or empty string is only a mismatch, never an error."""
    expected = proofs.token_proof(b"k", b"L", b"p")
    assert proofs.proof_matches(expected, received) is False
    assert proofs.proof_matches(expected, expected) is True


def test_nonces_are_64_fresh_lowercase_hex_digits() -> None:
    """proofs.new_nonce / is_nonce: 32 bytes from secrets as hex; 64 lowercase hex digits."""
    nonces = {proofs.new_nonce() for _ in range(50)}
    assert len(nonces) == 50
    assert all(proofs.is_nonce(n) and len(n) == proofs.NONCE_HEX_CHARS == 64 for n in nonces)
    nonce = nonces.pop()
    for bad in (nonce.upper(), nonce[:-1], nonce + "0", "g" * 64, None, 12, nonce.encode()):
        assert not proofs.is_nonce(bad), bad


def test_the_shared_token_and_peer_names_are_checked() -> None:
    """proofs.check_token: 'raises ConfigurationError unless a non-empty str or bytes';
    check_name: why a value cannot name a peer (1 to 200 bytes of UTF-8)."""
    assert proofs.check_token("é") == "é".encode()
    assert proofs.check_token(b"abc") == b"abc"
    for bad in ("", b"", None, 42, ["token"]):
        with pytest.raises(ConfigurationError) as caught:
            proofs.check_token(bad)
        assert "token" in str(caught.value), str(caught.value)
    assert proofs.MAX_NAME_BYTES == 200
    assert proofs.check_name("a" * 200, "producer") is None
    assert proofs.check_name("é" * 100, "producer") is None  # 200 bytes
    for bad in ("", "a" * 201, "é" * 101, 5, None):
        reason = proofs.check_name(bad, "producer")
        assert reason is not None, bad
        assert "producer" in reason, (bad, reason)


def test_each_kind_of_proof_has_its_own_label_and_binds_what_it_answers() -> None:
    """transport.md: client_proof signs 'the server's nonce and the hello', server_proof 'both
    nonces, the hello and what its answer carries'; a label per kind, so that one proof is never
    accepted as another (a follower's reflected back as the root's). Streaming's welcome proves
    its acknowledged seq and frame limit, a Redirect its address."""
    token, server_nonce, client_nonce = b"k", proofs.new_nonce(), proofs.new_nonce()
    base = proofs.server_proof(
        token, b"L", b"5", client_nonce=client_nonce, server_nonce=server_nonce, transcript=b"T"
    )
    assert base != proofs.server_proof(
        token, b"L", b"6", client_nonce=client_nonce, server_nonce=server_nonce, transcript=b"T"
    )
    assert base != proofs.server_proof(
        token, b"L", b"5", client_nonce=server_nonce, server_nonce=client_nonce, transcript=b"T"
    )
    assert base != proofs.server_proof(
        token, b"L", b"5", client_nonce=client_nonce, server_nonce=server_nonce, transcript=b"U"
    )
    client = proofs.client_proof(token, b"L", server_nonce=server_nonce, transcript=b"T")
    assert client != proofs.client_proof(token, b"L", server_nonce=client_nonce, transcript=b"T")
    assert client != proofs.client_proof(token, b"L", server_nonce=server_nonce, transcript=b"U")

    hello = control_wire.Hello(control_wire.PROTOCOL_VERSION, 1, 2, SPEC, client_nonce, "")
    follower = control_wire.follower_proof(token, root_nonce=server_nonce, hello=hello)
    assert follower != control_wire.root_proof(token, root_nonce=server_nonce, hello=hello)
    assert follower == control_wire.follower_proof(
        token, root_nonce=server_nonce, hello=attrs.evolve(hello, proof=follower)
    )
    assert follower != control_wire.follower_proof(
        token, root_nonce=server_nonce, hello=attrs.evolve(hello, rank=2)
    )

    s_hello = stream_wire.Hello(stream_wire.PROTOCOL_VERSION, "sim", client_nonce, "")
    welcome = stream_wire.receiver_proof(
        token, receiver_nonce=server_nonce, hello=s_hello, acked_seq=4, max_frame_bytes=1 << 20
    )
    assert welcome != stream_wire.receiver_proof(
        token, receiver_nonce=server_nonce, hello=s_hello, acked_seq=5, max_frame_bytes=1 << 20
    )
    assert welcome != stream_wire.receiver_proof(
        token, receiver_nonce=server_nonce, hello=s_hello, acked_seq=4, max_frame_bytes=1 << 21
    )
    redirect = stream_wire.redirect_proof(
        token, receiver_nonce=server_nonce, hello=s_hello, host="10.0.0.1", port=7000
    )
    assert redirect != stream_wire.redirect_proof(
        token, receiver_nonce=server_nonce, hello=s_hello, host="10.0.0.1", port=7001
    )
    assert redirect != stream_wire.redirect_proof(
        token, receiver_nonce=server_nonce, hello=s_hello, host="10.0.0.2", port=7000
    )

    f_hello = federated_wire.Hello(federated_wire.PROTOCOL_VERSION, "node-0", client_nonce, "")
    assert federated_wire.node_proof(token, aggregator_nonce=server_nonce, hello=f_hello) != (
        federated_wire.aggregator_proof(token, aggregator_nonce=server_nonce, hello=f_hello)
    )


# ---------------------------------------------------------------------------------------------
# transport/handshake.py: the server's order of checks, without I/O


def control_rules() -> handshake.HelloRules[Any]:
    return handshake.HelloRules(
        protocol="control",
        server="the root",
        version=control_wire.PROTOCOL_VERSION,
        hello_type=control_wire.Hello,
        expected_proof=lambda token, nonce, hello: control_wire.follower_proof(
            token, root_nonce=nonce, hello=hello
        ),
        client=lambda hello: f"rank {hello.rank}",
    )


def test_the_server_judges_a_hello_in_the_documented_order() -> None:
    """transport.md, 'The server checks a hello in this order': 1. a hello with a well-formed
    nonce, else a stranger closed without a reply; 2. the proof ('refused with "the proof of the
    shared token did not match (wrong token?)"'); 3. the version, naming both."""
    assert handshake.WRONG_TOKEN == WRONG_TOKEN
    nonce = proofs.new_nonce()
    rules = control_rules()
    version = control_wire.PROTOCOL_VERSION

    def hello(*, token: bytes = TOKEN_BYTES, v: int = version, client_nonce: str | None = None) -> Any:
        message = control_wire.Hello(v, 1, 2, SPEC, client_nonce or proofs.new_nonce(), "")
        return attrs.evolve(
            message, proof=control_wire.follower_proof(token, root_nonce=nonce, hello=message)
        )

    def refusal(message: Any) -> handshake.Refusal:
        with pytest.raises(handshake.Refusal) as caught:
            handshake.judge_hello(message, rules, token=TOKEN_BYTES, nonce=nonce)
        return caught.value

    for stranger in (
        None,
        control_wire.Heartbeat(),
        hello(client_nonce="xyz"),
        hello(client_nonce="xyz", token=b"x"),
    ):
        assert refusal(stranger).reply is False, stranger
    for wrong in (hello(token=b"another"), hello(token=b"another", v=version + 7)):
        refused = refusal(wrong)
        assert (refused.reason, refused.reply, refused.hello) == (WRONG_TOKEN, True, None)
        assert str(version + 7) not in str(refused)
    other_version = refusal(hello(v=version + 7))
    assert other_version.reply is True
    assert other_version.hello is not None  # it proved the token
    assert str(version + 7) in other_version.reason
    assert str(version) in other_version.reason
    good = hello()
    assert handshake.judge_hello(good, rules, token=TOKEN_BYTES, nonce=nonce) == good


def test_a_version_mismatch_names_both_versions() -> None:
    """handshake.version_mismatch's example, and None for one version."""
    assert handshake.version_mismatch(
        1, 2, protocol="streaming", them="producer 'old'", us="the receiver"
    ) == ("producer 'old' speaks streaming protocol version 1, the receiver speaks version 2")
    assert handshake.version_mismatch(2, 2, protocol="streaming", them="x", us="y") is None


# ---------------------------------------------------------------------------------------------
# the real servers: challenge, hello with proof, welcome with proof back (what each carries)


async def handshake_by_hand(
    address: tuple[str, int], wire: Any, make_hello: Callable[[str], Any]
) -> tuple[Any, Any, Any]:
    """Challenge in, our hello out, the server's answer in: (challenge, hello, answer)."""
    async with await anyio.connect_tcp(*address) as stream:
        reader = BufferedByteReceiveStream(stream)
        with anyio.fail_after(5):
            challenge = wire.decode_body(bytearray(await read_body(reader)))
            hello = make_hello(challenge.nonce)
            await stream.send(wire.encode_frame(hello))
            answer = wire.decode_body(bytearray(await read_body(reader)))
    return challenge, hello, answer


async def test_the_control_roots_welcome_carries_only_its_proof() -> None:
    """transport.md: 'Welcome with proof back'; table 'the welcome carries: a proof' (control)."""

    def make_hello(nonce: str) -> Any:
        hello = control_wire.Hello(control_wire.PROTOCOL_VERSION, 1, 2, SPEC, proofs.new_nonce(), "")
        return attrs.evolve(
            hello, proof=control_wire.follower_proof(TOKEN_BYTES, root_nonce=nonce, hello=hello)
        )

    async with TcpControlRoot(nranks=2, token=TOKEN, model_spec=SPEC) as root:
        challenge, hello, welcome = await handshake_by_hand(root.address, control_wire, make_hello)
    assert challenge.protocol_version == control_wire.PROTOCOL_VERSION
    assert isinstance(welcome, control_wire.Welcome)
    assert [field.name for field in attrs.fields(control_wire.Welcome)] == ["proof"]
    assert welcome.proof == control_wire.root_proof(TOKEN_BYTES, root_nonce=challenge.nonce, hello=hello)


async def test_a_receivers_welcome_proves_its_acked_seq_and_frame_limit_and_strangers_are_counted() -> None:
    """transport.md table: the streaming welcome carries 'a proof, the acknowledged seq and the
    receiver's frame limit'; refused strangers: 'SampleReceiver.recent_refusals and refusals'."""

    def make_hello(nonce: str) -> Any:
        hello = stream_wire.Hello(stream_wire.PROTOCOL_VERSION, "sim", proofs.new_nonce(), "")
        return attrs.evolve(
            hello, proof=stream_wire.producer_proof(TOKEN_BYTES, receiver_nonce=nonce, hello=hello)
        )

    buffer = FifoBuffer(capacity=8, watermark=1, seed=0)
    async with SampleReceiver(
        buffer, token=TOKEN, max_frame_bytes=1 << 20, acknowledged={"sim": 6}
    ) as receiver:
        challenge, hello, welcome = await handshake_by_hand(receiver.address, stream_wire, make_hello)
        before = int(receiver.refusals)
        async with await anyio.connect_tcp(*receiver.address) as stranger:
            reader = BufferedByteReceiveStream(stranger)
            with anyio.fail_after(5):
                await read_body(reader)
                await stranger.send(header(7) + b"garbage")
                assert await drain(stranger) == b""
        with anyio.fail_after(5):
            while int(receiver.refusals) == before:  # noqa: ASYNC110 - a counter, no event to wait on
                await anyio.sleep(0.02)
        refusals = list(receiver.recent_refusals)
    assert isinstance(welcome, stream_wire.Welcome)
    assert (welcome.acked_seq, welcome.max_frame_bytes) == (6, 1 << 20)
    assert welcome.proof == stream_wire.receiver_proof(
        TOKEN_BYTES, receiver_nonce=challenge.nonce, hello=hello, acked_seq=6, max_frame_bytes=1 << 20
    )
    assert refusals, refusals
    assert refusals[-1].startswith("127.0.0.1:"), refusals


async def test_the_aggregators_welcome_carries_only_its_proof() -> None:
    """transport.md table: the federated welcome carries 'a proof'; the aggregator checks no
    fields of its own."""
    from lamploop.federated import (
        AggregatorSettings,
        ModelDescription,
        OptimizerConfig,
        TrainingPlan,
        mlp,
        run_aggregator,
    )
    from lamploop.modelspec import model_spec

    options = {"sizes": [4, 4, 2], "seed": 0}
    plan = TrainingPlan(
        name="acceptance",
        model=ModelDescription("mlp", options, model_spec(mlp(options))),
        optimizer=OptimizerConfig("sgd", learning_rate=0.05),
        local_epochs=1,
        optimizer_state="reset",
    )
    ports: list[int] = []

    def make_hello(nonce: str) -> Any:
        hello = federated_wire.Hello(federated_wire.PROTOCOL_VERSION, "any-node", proofs.new_nonce(), "")
        return attrs.evolve(
            hello, proof=federated_wire.node_proof(TOKEN_BYTES, aggregator_nonce=nonce, hello=hello)
        )

    async with anyio.create_task_group() as group:
        group.start_soon(
            lambda: run_aggregator(
                plan=plan,
                initial_model=mlp(options),
                token=TOKEN,
                settings=AggregatorSettings(
                    rounds=1, min_nodes=2, expected_nodes=2, join_timeout=60, handshake_timeout=5
                ),
                on_listening=ports.append,
            )
        )
        with anyio.fail_after(10):
            while not ports:  # noqa: ASYNC110 - filled by on_listening
                await anyio.sleep(0.01)
        challenge, hello, welcome = await handshake_by_hand(
            ("127.0.0.1", ports[0]), federated_wire, make_hello
        )
        group.cancel_scope.cancel()
    assert isinstance(welcome, federated_wire.Welcome)
    assert [field.name for field in attrs.fields(federated_wire.Welcome)] == ["proof"]
    assert welcome.proof == federated_wire.aggregator_proof(
        TOKEN_BYTES, aggregator_nonce=challenge.nonce, hello=hello
    )


# ---------------------------------------------------------------------------------------------
# the client's checks, in one order, against servers that misbehave (transport.md: 'The client
# checks the server's side in one order too'; the table's errors for a refusal / no welcome / an
# unproven welcome, and who checks the challenge's version)


def control_challenge(**fields: Any) -> bytes:
    return json_frame(
        {
            "type": "challenge",
            "protocol_version": control_wire.PROTOCOL_VERSION,
            "nonce": proofs.new_nonce(),
            **fields,
        }
    )


async def control_follower(port: int) -> None:
    follower = TcpControlFollower(
        host="127.0.0.1",
        port=port,
        rank=1,
        nranks=2,
        token=TOKEN,
        model_spec=SPEC,
        connect_timeout=2.0,
        handshake_timeout=2.0,
    )
    async with follower:
        await follower.join()


async def test_a_follower_refuses_a_challenge_with_a_malformed_nonce_before_answering() -> None:
    """transport.md, the client's order: '1. the first frame is a challenge with a well-formed
    nonce' (the control follower judges the nonce itself); every failure is a TransportError."""
    async with fake_server(control_challenge(nonce="xyz"), None) as (port, server):
        error = await outcome_of(lambda: control_follower(port))
    assert isinstance(error, TransportError), repr(error)
    assert server.hellos == []


async def test_a_followers_error_for_a_malformed_nonce_says_what_is_wrong() -> None:
    """As the streaming and federated clients do ('nonce must be 64 lowercase hex digits, got 'xyz'')."""
    async with fake_server(control_challenge(nonce="xyz"), None) as (port, _server):
        error = await outcome_of(lambda: control_follower(port))
    assert isinstance(error, TransportError), repr(error)
    assert "nonce" in str(error), str(error)


async def test_a_follower_does_not_check_the_challenges_version_and_gets_the_roots_reason() -> None:
    """transport.md table 'the client checks the challenge's version': control 'no: the root names
    the mismatch to both sides'; a Refuse ends the handshake with the server's reason
    (HandshakeError)."""
    reason = "rank 1 speaks control protocol version 3, the root speaks version 999"
    first = control_challenge(protocol_version=999)
    async with fake_server(first, json_frame({"type": "refuse", "reason": reason})) as (port, server):
        error = await outcome_of(lambda: control_follower(port))
    assert len(server.hellos) == 1  # it answered a challenge of version 999
    hello = control_wire.decode_body(bytearray(server.hellos[0]))
    assert isinstance(hello, control_wire.Hello)
    assert hello.protocol_version == control_wire.PROTOCOL_VERSION
    assert isinstance(error, HandshakeError), repr(error)
    assert reason in str(error), str(error)


@pytest.mark.parametrize(
    ("answer", "named"),
    [(None, "closed the connection"), (json_frame({"type": "heartbeat"}), "Heartbeat")],
    ids=["hang-up", "heartbeat"],
)
async def test_a_follower_that_gets_no_welcome_fails_with_a_control_channel_error(
    answer: bytes | None, named: str
) -> None:
    """transport.md: 'anything but the protocol's welcome (a hang-up included) is a failure naming
    what came'; table: the control client's error for no welcome is ControlChannelError (for a
    refusal and an unproven welcome: HandshakeError), a hang-up first tried past twice more (a
    root ending its run closes the handshakes in flight; control-channel.md)."""
    async with fake_server(control_challenge(), answer) as (port, server):
        error = await outcome_of(lambda: control_follower(port))
    assert len(server.hellos) == (3 if answer is None else 1)
    assert isinstance(error, ControlChannelError), repr(error)
    assert not isinstance(error, HandshakeError), repr(error)
    assert named in str(error), str(error)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (json_frame({"type": "welcome", "proof": "ab" * 32}), "did not prove the shared token"),
        (json_frame({"type": "refuse", "reason": "go away, rank 1"}), "go away, rank 1"),
    ],
    ids=["unproven", "refused"],
)
async def test_a_follower_fails_with_a_handshake_error_for_a_refusal_or_an_unproven_welcome(
    answer: bytes, expected: str
) -> None:
    """transport.md: '4. the welcome's proof must match before anything in it is believed';
    table: HandshakeError for a refusal and an unproven welcome (the follower fails)."""
    async with fake_server(control_challenge(), answer) as (port, server):
        error = await outcome_of(lambda: control_follower(port))
    assert server.connections == 1
    assert isinstance(error, HandshakeError), repr(error)
    assert expected in str(error), str(error)


def federated_challenge(**fields: Any) -> bytes:
    obj = {
        "type": "challenge",
        "protocol_version": federated_wire.PROTOCOL_VERSION,
        "nonce": proofs.new_nonce(),
    }
    return json_frame({**obj, **fields}, prefix=2)


async def federated_node(port: int) -> None:
    stream = await anyio.connect_tcp("127.0.0.1", port)
    link = Link(stream, max_frame_bytes=1 << 20)
    try:
        await join_aggregator(link, TOKEN_BYTES, "node-0")
    finally:
        await link.aclose()


FEDERATED_CASES = {
    "refused": (
        federated_challenge(),
        json_frame({"type": "refuse", "reason": "go away"}, prefix=2),
        HandshakeError,
        ["go away"],
        1,
    ),
    "hang-up": (federated_challenge(), None, HandshakeError, ["closed"], 1),
    "no-welcome": (
        federated_challenge(),
        json_frame({"type": "finish", "reason": "x", "failed": False}, prefix=2),
        HandshakeError,
        ["Finish"],
        1,
    ),
    "unproven": (
        federated_challenge(),
        json_frame({"type": "welcome", "proof": "ab" * 32}, prefix=2),
        HandshakeError,
        ["did not prove the shared token"],
        1,
    ),
    "other-version": (
        federated_challenge(protocol_version=999),
        None,
        HandshakeError,
        ["999", str(federated_wire.PROTOCOL_VERSION)],
        0,
    ),
    "malformed-nonce": (federated_challenge(nonce="xyz"), None, FrameError, ["nonce"], 0),
}


@pytest.mark.parametrize("case", list(FEDERATED_CASES))
async def test_a_node_judges_the_aggregator_in_the_documented_order(case: str) -> None:
    """transport.md table: the federated client's error for a refusal / no welcome / an unproven
    welcome is 'HandshakeError for all three'; it checks the challenge's version 'yes, before it
    answers'; a malformed nonce does not decode (FrameError), so nothing is answered."""
    first, answer, error_type, named, hellos = FEDERATED_CASES[case]
    async with fake_server(first, answer) as (port, server):
        error = await outcome_of(lambda: federated_node(port))
    assert isinstance(error, error_type), repr(error)
    assert isinstance(error, TransportError), repr(error)
    for word in named:
        assert word in str(error), (word, str(error))
    assert len(server.hellos) == hellos


def stream_challenge() -> bytes:
    obj = {"type": "challenge", "protocol_version": stream_wire.PROTOCOL_VERSION, "nonce": proofs.new_nonce()}
    return json_frame(obj, prefix=2)


async def producer(port: int) -> None:
    async with AsyncProducer(
        ("127.0.0.1", port), name="sim", token=TOKEN, reconnect_timeout=1.0, handshake_timeout=1.0
    ) as sender:
        await sender.send({"x": torch.zeros(2)})


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (json_frame({"type": "refuse", "reason": "go away"}, prefix=2), "go away"),
        (
            json_frame(
                {"type": "welcome", "acked_seq": -1, "max_frame_bytes": 1 << 20, "proof": "ab" * 32}, prefix=2
            ),
            "did not prove the shared token",
        ),
    ],
    ids=["refused", "unproven"],
)
async def test_a_producer_fails_at_once_for_a_refusal_or_an_unproven_welcome(
    answer: bytes, expected: str
) -> None:
    """transport.md table (streaming): HandshakeError for a refusal and for an unproven welcome,
    not tried again."""
    async with fake_server(stream_challenge(), answer) as (port, server):
        error = await outcome_of(lambda: producer(port))
    assert isinstance(error, HandshakeError), repr(error)
    assert expected in str(error), str(error)
    assert server.connections == 1


@pytest.mark.parametrize(
    "answer", [None, json_frame({"type": "ack", "upto_seq": 3}, prefix=2)], ids=["hang-up", "an-ack-instead"]
)
async def test_a_producer_that_gets_no_welcome_tries_again(answer: bytes | None) -> None:
    """transport.md table (streaming): no welcome is 'a lost connection, tried again with backoff';
    a receiver unreachable for reconnect_timeout then fails (not a HandshakeError)."""
    async with fake_server(stream_challenge(), answer) as (port, server):
        error = await outcome_of(lambda: producer(port))
    assert server.connections >= 2, server.connections
    assert len(server.hellos) >= 2
    assert isinstance(error, StreamingError), repr(error)
    assert not isinstance(error, HandshakeError), repr(error)


# ---------------------------------------------------------------------------------------------
# transport/connection.py: reading, the end-of-stream rules, transport errors wrapped, last words
# within 2 s, a close that never waits


async def test_a_clean_end_between_frames_is_none_and_an_end_inside_one_an_error() -> None:
    """connection.py: 'the end-of-stream rules (clean between frames, an error inside one)';
    errors are of the ``error`` class given, naming the peer (default its host:port)."""
    client, server = await tcp_pair()
    conn = FramedConnection(client, BytesDecoder(max_frame_bytes=100), error=StreamingError)
    port = server.extra(SocketAttribute.local_port)
    assert conn.peer == f"127.0.0.1:{port}"
    await server.send(frames.frame([b"hi"], "x", 100) + frames.frame([b"yo"], "x", 100))
    await server.aclose()
    with anyio.fail_after(5):
        assert await conn.receive_item() == b"hi"
        assert await conn.receive_item() == b"yo"
        assert await conn.receive_item() is None
    await conn.aclose()

    client, server = await tcp_pair()
    conn = FramedConnection(
        client, BytesDecoder(max_frame_bytes=100), error=StreamingError, peer="the far end"
    )
    await server.send(header(5) + b"ab")
    await server.aclose()
    with anyio.fail_after(5), pytest.raises(StreamingError) as caught:
        await conn.receive_item()
    assert "the far end" in str(caught.value), str(caught.value)
    await conn.aclose()


async def test_transport_errors_are_wrapped_naming_the_peer() -> None:
    """transport.md: 'transport errors wrapped'; connection.py: a failed connection raises the
    ``error`` class (a TransportError), never a bare OSError."""
    client, server = await tcp_pair()
    conn = FramedConnection(client, BytesDecoder(max_frame_bytes=100), error=StreamingError)
    raw = server.extra(SocketAttribute.raw_socket)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await server.aclose()  # a reset
    await anyio.sleep(0.1)
    errors: list[BaseException] = []
    with anyio.fail_after(5):
        for _ in range(3):
            try:
                await conn.send_bytes(b"x" * 100_000)
            except Exception as error:
                errors.append(error)
        try:
            await conn.receive_item()
        except Exception as error:
            errors.append(error)
    await conn.aclose()
    assert errors, "nothing failed on a reset connection"
    for error in errors:
        assert isinstance(error, StreamingError), repr(error)
        assert "127.0.0.1:" in str(error), str(error)


async def test_no_item_comes_out_of_a_connection_after_a_bad_frame() -> None:
    """transport.md: 'a stream that cannot be used after a bad frame': the good frame behind the
    bad one is never handed out, and more bytes raise FrameError again."""
    client, server = await tcp_pair()
    conn = FramedConnection(client, BytesDecoder(max_frame_bytes=100), error=StreamingError)
    await server.send(frames.frame([b"bad"], "x", 100) + frames.frame([b"ok"], "x", 100))
    with anyio.fail_after(5), pytest.raises(FrameError):
        await conn.receive_item()
    with anyio.move_on_after(0.3):
        with pytest.raises(FrameError):
            await conn.receive_item()
    await server.send(frames.frame([b"more"], "x", 100))
    with anyio.fail_after(5), pytest.raises(FrameError):
        await conn.receive_item()
    await conn.aclose()
    await server.aclose()


async def test_last_words_take_at_most_the_goodbye_timeout_even_when_cancelled() -> None:
    """transport.md: 'last words within 2 s, a close that never waits'; connection.last_words:
    'within GOODBYE_TIMEOUT, even in a cancelled scope'; aclose: 'Close at once, also in a
    cancelled scope'."""
    assert GOODBYE_TIMEOUT == 2.0
    client, server = await tcp_pair()
    conn = FramedConnection(client, BytesDecoder(max_frame_bytes=100))

    async def never() -> None:
        await anyio.sleep_forever()

    start = time.monotonic()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await conn.last_words(never, "a Refuse")
    assert GOODBYE_TIMEOUT - 0.2 <= time.monotonic() - start <= GOODBYE_TIMEOUT + 1.0

    async def goodbye() -> None:
        await conn.send_bytes(frames.frame([b"bye"], "Refuse", 100))

    with anyio.CancelScope() as scope:
        scope.cancel()
        await conn.last_words(goodbye, "a Refuse")  # said even though cancelled
    reader = BufferedByteReceiveStream(server)
    with anyio.fail_after(5):
        assert await read_body(reader) == b"bye"
    start = time.monotonic()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await conn.aclose()
    assert time.monotonic() - start < 0.5
    await server.aclose()


async def test_a_close_does_not_wait_for_a_peer_that_reads_nothing() -> None:
    """connection.py: 'a close that never waits', also with the socket's buffers full."""
    client, server = await tcp_pair()
    conn = FramedConnection(client, BytesDecoder(max_frame_bytes=1 << 30))
    failed: list[BaseException] = []

    async def fill() -> None:
        try:
            while True:
                await conn.send_bytes(b"y" * (1 << 20))
        except Exception as error:
            failed.append(error)

    async with anyio.create_task_group() as group:
        group.start_soon(fill)
        await anyio.sleep(0.5)  # the peer reads nothing: the send waits
        start = time.monotonic()
        with anyio.fail_after(5):
            await conn.aclose()
        closed_after = time.monotonic() - start
        with anyio.fail_after(5):
            while not failed:  # noqa: ASYNC110 - the sender's failure, no event to wait on
                await anyio.sleep(0.01)
    await server.aclose()
    assert closed_after < 0.5, closed_after
    assert isinstance(failed[0], TransportError), repr(failed[0])


@pytest.fixture(scope="module")
def tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    return server_context, client_context


async def tls_pair(contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> tuple[Any, Any]:
    client, server = await tcp_pair()
    wrapped: dict[str, Any] = {}

    async def server_side() -> None:
        wrapped["server"] = await wrap(server, contexts[0], server_side=True)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(server_side)
            wrapped["client"] = await wrap(client, contexts[1], server_side=False, hostname="localhost")
    return wrapped["client"], wrapped["server"]


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
async def test_frames_sent_in_parts_and_received_into_memory_arrive_whole(
    tls: bool, tls_contexts: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    """transport.md: send_parts writes a frame given in parts with sendmsg on plain TCP with
    asyncio's selector loop 'and joins the parts over TLS'; receive_into_frames reads bodies
    straight into memory there, 'over TLS ... the bodies are gathered from the stream's reads'
    (connection.receive_into_frames: 'whether the stream allows it')."""
    client, server = await (tls_pair(tls_contexts) if tls else tcp_pair())
    receiving = FramedConnection(client, BytesDecoder(max_frame_bytes=1 << 22))
    sending = FramedConnection(server, BytesDecoder(max_frame_bytes=1 << 22))
    assert receiving.receive_into_frames() is (not tls)
    big = bytes(range(256)) * 4096  # 1 MiB, over DIRECT_BODY_BYTES
    assert len(big) >= frames.DIRECT_BODY_BYTES
    received: list[bytes | None] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:

            async def send() -> None:
                await sending.send_parts(frames.frame_parts([b"head", big, b"tail"], "x", 1 << 22))
                await sending.send_bytes(frames.frame([b"small"], "x", 100) * 3)
                await sending.send_parts(frames.frame_parts([big], "x", 1 << 22))

            group.start_soon(send)
            for _ in range(5):
                received.append(await receiving.receive_item())
    await receiving.aclose()
    await sending.aclose()
    assert received[0] == b"head" + big + b"tail"
    assert received[1:4] == [b"small"] * 3
    assert received[4] == big


async def test_tls_failures_are_transport_errors_that_say_why(
    tls_contexts: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    """tls.wrap: 'TransportError: the TLS handshake failed (a certificate not trusted, a peer that
    does not speak TLS, a hang-up); the message says why'; check_context: the wrong side is a
    clear error."""
    server_context, client_context = tls_contexts
    client, server = await tcp_pair()
    await client.send(header(5) + b"hello")  # not TLS
    with anyio.fail_after(5), pytest.raises(TransportError) as caught:
        await wrap(server, server_context, server_side=True)
    assert "127.0.0.1:" in str(caught.value), str(caught.value)
    await client.aclose()
    await server.aclose()

    client, server = await tcp_pair()
    untrusting = ssl.create_default_context()
    async with anyio.create_task_group() as group:

        async def server_side() -> None:
            with suppress(TransportError), anyio.fail_after(5):
                await wrap(server, server_context, server_side=True)
            await server.aclose()

        group.start_soon(server_side)
        with anyio.fail_after(5), pytest.raises(TransportError) as caught:
            await wrap(client, untrusting, server_side=False, hostname="localhost")
        await client.aclose()
    assert "certificate" in str(caught.value).lower(), str(caught.value)

    assert check_context("ssl_context", None, server_side=True) is None
    assert check_context("ssl_context", server_context, server_side=True) is server_context
    for context, side in ((client_context, True), (server_context, False), ("tls", True)):
        with pytest.raises(ConfigurationError, match="ssl_context"):
            check_context("ssl_context", context, server_side=side)


async def test_a_tls_hang_up_names_the_peer(tls_contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    client, server = await tcp_pair()
    address = f"127.0.0.1:{server.extra(SocketAttribute.local_port)}"
    await server.aclose()
    await anyio.sleep(0.05)
    try:
        with anyio.fail_after(5), pytest.raises(TransportError) as caught:
            await wrap(client, tls_contexts[1], server_side=False, hostname="localhost")
    finally:
        await client.aclose()
    assert address in str(caught.value), str(caught.value)


# ---------------------------------------------------------------------------------------------
# transport/settings.py: the checks of ports, limits and timeouts


def test_integer_checks_name_the_argument_the_inclusive_range_and_the_value() -> None:
    """settings.py: 'Every check names the argument and the bad value and raises ConfigurationError.
    The ranges are inclusive at both ends, and the message says so (port must be an integer in
    [0, 65535], got 70000)'; check_int_in: 'an integer (not a bool)'."""
    with pytest.raises(ConfigurationError) as caught:
        check_int_in("port", 70000, 0, 65535)
    assert str(caught.value) == "port must be an integer in [0, 65535], got 70000"
    check_int_in("port", 0, 0, 65535)
    check_int_in("port", 65535, 0, 65535)
    check_int_in("max_frame_bytes", 10**12, 1)
    for bad in (-1, 65536, True, 1.0, "80", None):
        with pytest.raises(ConfigurationError) as caught:
            check_int_in("port", bad, 0, 65535)
        assert "port" in str(caught.value), str(caught.value)
        assert repr(bad) in str(caught.value), str(caught.value)


def test_seconds_must_be_positive_and_finite_and_the_first_bad_one_is_named() -> None:
    """settings.check_seconds_each: 'Each value is a positive, finite number of seconds; raises
    ConfigurationError naming the first not'."""
    check_seconds_each(a=0.5, b=1e-9, c=3)
    for bad in (0, -1, math.nan, math.inf, "5", None, True):
        with pytest.raises(ConfigurationError) as caught:
            check_seconds_each(join_timeout=1.0, heartbeat_timeout=bad)
        assert "heartbeat_timeout" in str(caught.value), (bad, str(caught.value))
    with pytest.raises(ConfigurationError) as caught:
        check_seconds_each(a=1, b=-2, c=0)
    assert str(caught.value).startswith("b "), str(caught.value)


# ---------------------------------------------------------------------------------------------
# transport/listen.py and strangers.py: the listener, bounded handshakes, the refusal log


def test_the_refusal_log_writes_a_few_lines_per_window_then_a_count(caplog: pytest.LogCaptureFixture) -> None:
    """transport.md: 'The refusal log of all three writes to the lamploop.control logger, a few lines
    per window and then a count'; RefusalLog: at most ``burst`` lines per ``window``."""
    assert REFUSALS_LOGGER == "lamploop.control"
    caplog.set_level(logging.WARNING, logger="lamploop.control")
    log = RefusalLog(burst=3, window=0.5, who="sample receiver")
    for index in range(7):
        log.refused(f"10.0.0.{index}:4000", f"reason {index}")
    log.flush()
    lines = [r.getMessage() for r in caplog.records if r.name == "lamploop.control"]
    assert len(lines) == 4, lines
    for index in range(3):
        assert f"10.0.0.{index}:4000" in lines[index], lines
        assert f"reason {index}" in lines[index], lines
        assert "sample receiver" in lines[index], lines
    assert "4" in lines[3], lines
    assert "sample receiver" in lines[3], lines
    assert not any("10.0.0.5" in line for line in lines)
    time.sleep(0.6)  # a new window
    log.refused("10.0.0.9:4000", "later")
    lines = [r.getMessage() for r in caplog.records if r.name == "lamploop.control"]
    assert len(lines) == 5, lines
    assert "10.0.0.9:4000" in lines[4], lines


async def test_pending_handshakes_past_the_limit_drop_the_oldest() -> None:
    """strangers.PendingHandshakes: 'At most limit handshakes at once; a new one past the limit
    cancels the oldest'."""
    pending = PendingHandshakes(2)
    ended: dict[int, bool] = {}

    async def handshake_slot(index: int) -> None:
        with pending.slot() as scope:
            await anyio.sleep(1.0)
        ended[index] = scope.cancelled_caught

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            for index in range(4):
                group.start_soon(handshake_slot, index)
                await anyio.sleep(0.05)
    assert ended == {0: True, 1: True, 2: False, 3: False}


def test_spoke_first_finds_peers_that_spoke_or_hung_up_before_being_spoken_to() -> None:
    """strangers.spoke_first: 'Whether the peer of a just-accepted socket sent bytes or hung up
    before being spoken to'."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = server.getsockname()
        verdicts = []
        for action in ("speaks", "hangs up", "waits"):
            peer = socket.create_connection(address, timeout=5)
            if action == "speaks":
                peer.sendall(b"GET / HTTP/1.0\r\n\r\n")
            elif action == "hangs up":
                peer.close()
            time.sleep(0.1)
            accepted, _ = server.accept()
            with accepted:
                verdicts.append(spoke_first(accepted))
            peer.close()
    assert verdicts == [True, True, False]


async def test_the_listener_closes_a_peer_that_speaks_first_and_hands_over_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """transport.md: 'the listener (a peer that speaks before the challenge is closed at accept)';
    listen.serve_tcp: the real port when port=0, TCP_NODELAY on every handed stream, OSError
    before starting when the address cannot be listened on."""
    caplog.set_level(logging.WARNING, logger="lamploop.control")
    handed: list[SocketStream] = []
    refusals = RefusalLog(who="test server")

    async def serve(port: int, *, task_status: Any) -> None:
        await serve_tcp(
            "127.0.0.1",
            port,
            on_connection=handed.append,
            refusals=refusals,
            who="test server",
            checks_first_bytes=True,
            task_status=task_status,
        )

    async with anyio.create_task_group() as group:
        host, port = await group.start(serve, 0)
        assert host == "127.0.0.1"
        assert port > 0
        # Without yielding to the event loop: it cannot accept before the bytes are there.
        speaker = connect_and_speak((host, port))
        speaker_port = speaker.getsockname()[1]
        try:
            with anyio.fail_after(5):
                reply = await anyio.to_thread.run_sync(drain_socket, speaker)
        finally:
            speaker.close()
        assert reply == b""
        with anyio.fail_after(5):
            while not any(f"127.0.0.1:{speaker_port}" in r.getMessage() for r in caplog.records):  # noqa: ASYNC110
                await anyio.sleep(0.02)
        assert handed == []
        async with await anyio.connect_tcp(host, port):
            with anyio.fail_after(5):
                while not handed:  # noqa: ASYNC110 - on_connection is a plain callback
                    await anyio.sleep(0.01)
            raw = handed[0].extra(SocketAttribute.raw_socket)
            assert raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        await handed[0].aclose()
        with pytest.raises(OSError, match=r"."):
            await group.start(serve, port)
        group.cancel_scope.cancel()


def connect_and_speak(address: tuple[str, int]) -> socket.socket:
    """A blocking client that sends an HTTP request at once and lets it land."""
    sock = socket.create_connection(address, timeout=5)
    sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
    time.sleep(0.05)
    return sock


def drain_socket(sock: socket.socket) -> bytes:
    data = b""
    with suppress(OSError):
        while chunk := sock.recv(4096):
            data += chunk
    return data


# ---------------------------------------------------------------------------------------------
# docs/concepts/control-channels.md


async def follow(follower: Any, seen: list[Any]) -> None:
    try:
        async with follower:
            rendezvous, commands = await follower.join()
            seen.append(rendezvous)
            async for command in commands:
                seen.append(command)
    except Exception as error:
        seen.append(error)


def tcp_follower(address: tuple[str, int], rank: int, nranks: int, **kw: Any) -> TcpControlFollower:
    args: dict[str, Any] = {"connect_timeout": 10.0, "heartbeat_interval": 0.1, "heartbeat_timeout": 2.0}
    args.update(kw)
    return TcpControlFollower(
        host=address[0], port=address[1], rank=rank, nranks=nranks, token=TOKEN, model_spec=SPEC, **args
    )


@pytest.mark.parametrize(
    "kind",
    [
        "local",
        "tcp",
    ],
)
async def test_a_cancelled_root_tells_every_follower_the_run_was_aborted_and_why(kind: str) -> None:
    seen: dict[int, list[Any]] = {1: [], 2: []}
    with anyio.fail_after(15):
        async with anyio.create_task_group() as group:
            if kind == "local":
                root: Any
                root, followers = local_control(3)
                for follower in followers:
                    group.start_soon(follow, follower, seen[follower.rank])
            else:
                root = TcpControlRoot(
                    nranks=3, token=TOKEN, model_spec=SPEC, heartbeat_interval=0.1, heartbeat_timeout=2.0
                )
            with anyio.CancelScope() as scope:
                async with root:
                    if kind == "tcp":
                        for rank in (1, 2):
                            group.start_soon(follow, tcp_follower(root.address, rank, 3), seen[rank])
                    await root.on_rendezvous_ready(RDV)
                    await root.broadcast(Train(epoch=0, lr_factor=1.0))
                    scope.cancel()  # e.g. the run's deadline
                    await anyio.sleep(10)
            assert scope.cancelled_caught
    for rank in (1, 2):
        assert seen[rank][:2] == [RDV, Train(epoch=0, lr_factor=1.0)], seen[rank]
        error = seen[rank][-1]
        assert isinstance(error, PeerLostError), seen[rank]
        assert error.how == "aborted", (error.how, str(error))
        assert "cancel" in str(error), str(error)


async def test_peers_are_the_joined_followers_sorted_whatever_order_they_join_in() -> None:
    """concepts/control-channels.md: 'peers() -> tuple[int, ...]  # the followers that joined, sorted'."""
    seen: dict[int, list[Any]] = {1: [], 2: [], 3: []}
    with anyio.fail_after(15):
        async with (
            anyio.create_task_group() as group,
            TcpControlRoot(nranks=4, token=TOKEN, model_spec=SPEC) as root,
        ):
            for rank in (3, 1, 2):
                group.start_soon(follow, tcp_follower(root.address, rank, 4), seen[rank])
                await anyio.sleep(0.15)
            await root.on_rendezvous_ready(RDV)
            assert root.peers() == (1, 2, 3)
            await root.broadcast(Stop(reason="done"))
    assert all(seen[rank] == [RDV, Stop(reason="done")] for rank in (1, 2, 3)), seen


FOLLOWER_PROCESS = """
import sys
import anyio
from lamploop.control import TcpControlFollower
from lamploop.modelspec import ModelSpec, TensorSpec

SPEC = ModelSpec((TensorSpec("fc.weight", (10, 4), "float32"), TensorSpec("fc.bias", (10,), "float32")))

async def main() -> None:
    follower = TcpControlFollower(
        host="127.0.0.1", port=int(sys.argv[1]), rank=1, nranks=3, token=sys.argv[2], model_spec=SPEC,
        connect_timeout=30, heartbeat_interval=0.2, heartbeat_timeout=20,
    )
    async with follower:
        _, commands = await follower.join()
        async for command in commands:
            print(type(command).__name__, flush=True)

anyio.run(main)
"""


async def test_a_follower_process_that_dies_ends_the_run_on_every_rank_naming_it(tmp_path: Path) -> None:
    """concepts/control-channels.md: with TcpControlRoot / TcpControlFollower 'a rank that dies,
    freezes or is cut off ends the run on every rank within the heartbeat timeout, naming it'.
    A follower process killed with SIGKILL (heartbeat timeout 20 s: its death must be noticed by
    the disconnection, long before that). The root's error comes from the broadcast it waits in,
    or when its block exits (control-channel.md, 'Where the error appears')."""
    stderr = tmp_path / "follower.stderr"
    seen: list[Any] = []
    outcome: dict[str, Any] = {}
    killed = time.monotonic()
    with stderr.open("wb") as errors, anyio.fail_after(50):
        async with anyio.create_task_group() as group:
            try:
                async with TcpControlRoot(
                    nranks=3,
                    token=TOKEN,
                    model_spec=SPEC,
                    join_timeout=40,
                    heartbeat_interval=0.2,
                    heartbeat_timeout=20,
                ) as root:
                    process = await anyio.open_process(
                        [sys.executable, "-c", FOLLOWER_PROCESS, str(root.address[1]), TOKEN],
                        cwd=ROOT,
                        stdout=subprocess.DEVNULL,
                        stderr=errors,
                    )
                    try:
                        survivor = tcp_follower(
                            root.address, 2, 3, heartbeat_interval=0.2, heartbeat_timeout=20
                        )
                        group.start_soon(follow, survivor, seen)
                        await root.on_rendezvous_ready(RDV)
                        await root.broadcast(Train(epoch=0, lr_factor=1.0))
                        process.send_signal(signal.SIGKILL)
                        killed = time.monotonic()
                        with anyio.fail_after(15):
                            while True:
                                await anyio.sleep(0.05)
                                await root.broadcast(Valid(epoch=0))
                    finally:
                        with anyio.CancelScope(shield=True), anyio.fail_after(10):
                            with suppress(ProcessLookupError):
                                process.kill()
                            await process.wait()
                            await process.aclose()
            except PeerLostError as error:
                outcome["error"], outcome["after"] = error, time.monotonic() - killed
    assert "error" in outcome, stderr.read_text()[-2000:]
    error = outcome["error"]
    assert error.rank == 1, (error.rank, str(error))
    assert "rank 1" in str(error), str(error)
    assert outcome["after"] < 5.0, outcome["after"]
    assert len(seen) >= 2, seen
    assert seen[:2] == [RDV, Train(epoch=0, lr_factor=1.0)], seen
    assert isinstance(seen[-1], PeerLostError), seen
    assert seen[-1].rank == 1, (seen[-1].rank, str(seen[-1]))


# ---------------------------------------------------------------------------------------------
# docs/concepts/loop-state.md and sync-strategies.md


def test_a_learning_curve_entry_holds_metrics_and_its_factor_through_a_json_round_trip() -> None:
    """loop-state.md: an entry holds 'the epoch, its training_loss, its validation_loss as
    (smoothed, raw) or None, the metrics (training_metrics, validation_metrics) and the
    learning_rate_factor it trained with (informational: left out of ==)'; checkpoints store the
    rest as JSON through lamploop.state.converter."""
    entry = lamploop.LearningCurveEntry(
        3,
        0.5,
        (0.4, 0.3),
        training_metrics={"accuracy": 0.75},
        validation_metrics={"accuracy": (0.8, 0.9)},
        learning_rate_factor=0.25,
    )
    state = lamploop.LoopState(
        epoch=4,
        last_validation_loss=0.4,
        min_validation_loss=0.4,
        min_validation_epoch=3,
        learning_curve=(entry,),
    )
    back = converter.structure(json.loads(json.dumps(converter.unstructure(state))), lamploop.LoopState)
    assert back == state
    (restored,) = back.learning_curve
    assert restored.training_metrics == {"accuracy": 0.75}
    assert tuple(restored.validation_metrics["accuracy"]) == (0.8, 0.9)
    assert restored.learning_rate_factor == 0.25
    other_metrics = attrs.evolve(entry, training_metrics={"accuracy": 0.5})
    assert other_metrics != entry  # metrics count in ==, the factor does not
    assert attrs.evolve(entry, learning_rate_factor=1.0) == entry
    fields = {field.name for field in attrs.fields(lamploop.LoopStateWithModelAndOptimizerData)}
    assert {"loop_state", "model", "optimizer", "best_model", "averaged_model"} <= fields


def test_epochs_records_each_epochs_factor_and_carries_the_smoothed_loss() -> None:
    """loop-state.md: learning_curve holds 'one LearningCurveEntry per finished epoch, oldest first'
    with the factor it trained with; last_validation_loss 'carried over epochs that do not
    validate'; 'stop if ... the factor is <= 0'."""
    training = [0.9, 0.7, 0.6, 0.55, 0.5, 0.48]
    validation = [1.0, 0.5, 0.75, 0.5, 1.0, 0.75]
    epoch = [0]
    factors: list[float] = []

    async def train(factor: float) -> float:
        factors.append(factor)
        return training[epoch[0]]

    async def validate() -> float:
        return validation[epoch[0]]

    async def save() -> None:
        pass

    async def checkpoint(state: lamploop.LoopState, _schedule_state: object) -> None:
        epoch[0] = state.epoch

    async def run(schedule: Any, frequency: int) -> lamploop.LoopState:
        epoch[0] = 0
        factors.clear()
        return await lamploop.epochs(
            max_epochs=6,
            train_epoch=train,
            validation_epoch=validate,
            save_min_validation_loss_model=save,
            checkpoint_state=checkpoint,
            validation_frequency=frequency,
            return_min_validation_loss_model=lamploop.ALL_EPOCHS,
            learning_rate_schedule=schedule,
            validation_loss_exponential_smoothing_factor=0.5,
        )

    plateau = lamploop.reduce_lr_on_plateau(patience=0, reduce_factor=0.5, validation_frequency=2)
    final = anyio.run(run, plateau, 2)
    curve = final.learning_curve
    assert [entry.epoch for entry in curve] == [0, 1, 2, 3, 4, 5]
    assert [entry.training_loss for entry in curve] == training
    assert [entry.validation_loss for entry in curve] == [
        (1.0, 1.0),
        None,
        (0.875, 0.75),
        None,
        (0.9375, 1.0),
        None,
    ]
    assert [entry.learning_rate_factor for entry in curve] == factors
    assert final.last_validation_loss == 0.9375
    assert (final.min_validation_loss, final.min_validation_epoch) == (0.875, 2)
    stopped = anyio.run(run, lamploop.linear(start=1.0, end=-1.0, max_steps=4), 1)
    assert [entry.learning_rate_factor for entry in stopped.learning_curve] == [1.0, 0.5]  # then 0: stop
    assert stopped.epoch == 2


def test_every_entry_point_defaults_to_the_auto_strategy() -> None:
    """sync-strategies.md: 'Every entry point takes strategy= and defaults to "auto"'."""
    import inspect

    assert inspect.signature(lamploop.fit).parameters["strategy"].default == "auto"
    assert lamploop.TrainingSettings().strategy == "auto"
    assert {"all_reduce", "reduce_to_root", "all_reduce_bf16", "all_reduce_fp16"} <= set(
        lamploop.strategy_names()
    )
