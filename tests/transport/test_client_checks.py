"""The client's checks of the server's answers (transport/handshake.py), without sockets.

The three clients (a control follower, a producer, a federated node) word the failures as their
own errors; these tests pin the order and the cases they map, once.  The clients' messages are
asserted over real sockets in tests/control, tests/streaming and tests/federated.
"""

from __future__ import annotations

import pytest

from lamploop.control import wire as control
from lamploop.federated import wire as federated
from lamploop.streaming import wire as streaming
from lamploop.transport.handshake import (
    Challenge,
    NotAChallenge,
    NotWelcomed,
    Refuse,
    judge_challenge,
    judge_welcome,
)
from lamploop.transport.proofs import new_nonce

PROOF = "ab" * 32


def _expected(_welcome: object) -> str:
    return PROOF


def test_a_proven_welcome_is_returned() -> None:
    welcome = federated.Welcome(PROOF)
    assert judge_welcome(welcome, federated.Welcome, expected_proof=_expected) is welcome


def test_a_refuse_carries_the_servers_reason() -> None:
    with pytest.raises(NotWelcomed) as info:
        judge_welcome(Refuse("rank 1 has already joined"), control.Welcome, expected_proof=_expected)
    assert (info.value.case, info.value.detail) == ("refused", "rank 1 has already joined")


@pytest.mark.parametrize(
    ("reply", "detail"),
    [
        (None, "closed the connection"),
        (control.Heartbeat(), "sent Heartbeat"),
        (federated.Welcome(PROOF), "sent Welcome"),  # another protocol's welcome is not this one's
    ],
)
def test_anything_but_the_welcome_names_what_came(reply: object, detail: str) -> None:
    with pytest.raises(NotWelcomed) as info:
        judge_welcome(reply, control.Welcome, expected_proof=_expected)
    assert (info.value.case, info.value.detail) == ("no welcome", detail)


def test_a_welcome_must_prove_the_token_and_its_own_fields_count() -> None:
    seen: list[int] = []

    def expected(welcome: streaming.Welcome) -> str:
        seen.append(welcome.acked_seq)
        return PROOF if welcome.acked_seq == 4 else "cd" * 32

    judge_welcome(streaming.Welcome(4, 1 << 20, PROOF), streaming.Welcome, expected_proof=expected)
    with pytest.raises(NotWelcomed) as info:
        judge_welcome(streaming.Welcome(5, 1 << 20, PROOF), streaming.Welcome, expected_proof=expected)
    assert info.value.case == "unproven"
    assert "did not prove the shared token" in info.value.detail
    assert seen == [4, 5]


def test_the_proof_is_not_computed_for_what_is_no_welcome() -> None:
    def expected(_welcome: object) -> str:
        raise AssertionError("the proof of a non-welcome was computed")

    for reply in (Refuse("no"), None, control.Heartbeat()):
        with pytest.raises(NotWelcomed):
            judge_welcome(reply, control.Welcome, expected_proof=expected)


def test_streaming_and_federated_share_the_transports_challenge() -> None:
    assert streaming.Challenge is federated.Challenge is Challenge
    nonce = new_nonce()
    assert judge_challenge(Challenge(2, nonce), Challenge).nonce == nonce
    with pytest.raises(ValueError, match="nonce must be 64 lowercase hex digits"):
        Challenge(2, "not a nonce")
    with pytest.raises(NotAChallenge) as info:
        judge_challenge(None, Challenge)
    assert info.value.what == "closed the connection instead of a challenge"
