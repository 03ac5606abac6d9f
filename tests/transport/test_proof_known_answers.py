"""Known answers for the handshake proofs of the three protocols.

A proof is what an old peer and a new one must compute alike: if the bytes a proof signs
changed (the hello's transcript, a label, the order of the parts), a peer of the previous
release would be refused for a "wrong token" instead of being told it speaks another version.
These hex strings were computed by the code as released; a change that alters one of them
changes the wire, and needs a new protocol version, not a new expected value here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest

from lamploop.control import wire as control
from lamploop.federated import wire as federated
from lamploop.modelspec import ModelSpec, TensorSpec
from lamploop.streaming import wire as streaming

TOKEN = b"known-answer token"
SERVER_NONCE = "0123456789abcdef" * 4
CLIENT_NONCE = "fedcba9876543210" * 4
SPEC = ModelSpec((TensorSpec("fc.weight", (10, 4), "float32"), TensorSpec("fc.bias", (10,), "float32")))

# The protocol versions are written out (not PROTOCOL_VERSION): the proofs pin the transcript of
# a given hello, whatever version the code speaks today.
CONTROL_HELLO = control.Hello(3, 1, 2, SPEC, CLIENT_NONCE, "ignored")
STREAMING_HELLO = streaming.Hello(2, "sim-3", CLIENT_NONCE, "ignored")
FEDERATED_HELLO = federated.Hello(1, "node-a", CLIENT_NONCE, "ignored")


def _control_follower(hello: control.Hello) -> str:
    return control.follower_proof(TOKEN, root_nonce=SERVER_NONCE, hello=hello)


def _control_root(hello: control.Hello) -> str:
    return control.root_proof(TOKEN, root_nonce=SERVER_NONCE, hello=hello)


def _producer(hello: streaming.Hello) -> str:
    return streaming.producer_proof(TOKEN, receiver_nonce=SERVER_NONCE, hello=hello)


def _receiver(hello: streaming.Hello) -> str:
    return streaming.receiver_proof(
        TOKEN, receiver_nonce=SERVER_NONCE, hello=hello, acked_seq=41, max_frame_bytes=1 << 20
    )


def _redirect(hello: streaming.Hello) -> str:
    return streaming.redirect_proof(
        TOKEN, receiver_nonce=SERVER_NONCE, hello=hello, host="127.0.0.1", port=5123
    )


def _node(hello: federated.Hello) -> str:
    return federated.node_proof(TOKEN, aggregator_nonce=SERVER_NONCE, hello=hello)


def _aggregator(hello: federated.Hello) -> str:
    return federated.aggregator_proof(TOKEN, aggregator_nonce=SERVER_NONCE, hello=hello)


CASES = [
    (_control_follower, CONTROL_HELLO, "2fa387b8f1fad393078478191d6f7c9c9f875346720e78d1cdac8e0cf56e364d"),
    (_control_root, CONTROL_HELLO, "4b3bd365ba1e774368a6a4724bfa5ffca5337938e512ac6cb95f5fe0eb6a7802"),
    (_producer, STREAMING_HELLO, "67de2b44f158881af826d584e8382845b8ce43edd376149e2f3561d737db3e5b"),
    (_receiver, STREAMING_HELLO, "d4687fbd88855444bf845b10a7fdfb51290923d726a81362caa170c229e834a2"),
    (_redirect, STREAMING_HELLO, "35606aa58ecdfefa630da4c0eab62be0d9a8699a63c196b5fd2d70fd1d697e50"),
    (_node, FEDERATED_HELLO, "59fd878c2797f03becfe91be82db5f311f3a575d3959a5b47d51e82d23d2d832"),
    (_aggregator, FEDERATED_HELLO, "484fc520ad501ec4b02b5bf2b756e1ecaa462cf273fb03c109345df2a99c62ea"),
]


@pytest.mark.parametrize(("proof", "hello", "expected"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_a_proof_signs_the_same_bytes_as_released(
    proof: Callable[[Any], str], hello: Any, expected: str
) -> None:
    assert proof(hello) == expected


@pytest.mark.parametrize(("proof", "hello", "expected"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_a_proof_ignores_the_hellos_own_proof_but_not_its_other_fields(
    proof: Callable[[Any], str], hello: Any, expected: str
) -> None:
    assert proof(attrs.evolve(hello, proof="something else")) == expected
    assert proof(attrs.evolve(hello, protocol_version=hello.protocol_version + 1)) != expected
