"""A link that always breaks mid-frame: the producer fails after ``reconnect_timeout``.

Every connection goes through a relay that passes the handshake and then cuts the connection
after a few KiB of the first frame, so the receiver never takes a sample.  The handshake
succeeds each time; before the fix that reset the producer's failure clock, and a producer on
such a link retried forever.  A link that lets some samples through before each cut is a flaky
network, not a failure (tests/streaming/test_acceptance_docs_streaming_r2.py
``test_dropped_connections_lose_and_repeat_nothing``), and so is a full buffer nobody reads
(``test_async_producer_waits_exactly_at_its_window_and_a_full_buffer_is_no_failure``).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import anyio
import anyio.abc
import pytest
import torch
from support import cutting_relay

from lamploop.errors import StreamingError
from lamploop.streaming import FifoBuffer
from lamploop.streaming.producer import AsyncProducer, BlockingProducer
from lamploop.streaming.receiver import SampleReceiver

pytestmark = pytest.mark.anyio

RECONNECT_TIMEOUT = 1.5
CUT_AFTER = 16 * 1024
"""Bytes from the producer a relayed connection carries: the handshake's and part of a frame
of one 256 KiB sample."""


def _big_sample() -> dict[str, torch.Tensor]:
    return {"x": torch.arange(64 * 1024, dtype=torch.float32)}  # 256 KiB: never whole through the relay


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["async", "blocking"])
async def test_a_link_cut_before_any_sample_gets_through_fails_the_producer(kind: str) -> None:
    token = secrets.token_hex(16)
    buffer = FifoBuffer(capacity=4, watermark=1)
    outcome: dict[str, Any] = {}

    def simulate(address: tuple[str, int]) -> None:
        started = time.monotonic()
        try:
            with BlockingProducer(address, name="sim", token=token, reconnect_timeout=RECONNECT_TIMEOUT) as p:
                p.send(_big_sample())
        except StreamingError as exc:
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - started
        outcome["connections"] = p.stats.connections

    with anyio.fail_after(25):
        async with SampleReceiver(buffer, token=token, expected_producers=["sim"]) as receiver:
            async with anyio.create_task_group() as relays:
                relay = await cutting_relay(receiver.address, lambda: CUT_AFTER, relays)
                if kind == "blocking":
                    await anyio.to_thread.run_sync(simulate, relay)
                else:
                    started = time.monotonic()
                    try:
                        async with AsyncProducer(
                            relay, name="sim", token=token, reconnect_timeout=RECONNECT_TIMEOUT
                        ) as producer:
                            await producer.send(_big_sample())
                            await producer.done()
                    except StreamingError as exc:
                        outcome["error"] = exc
                    outcome["seconds"] = time.monotonic() - started
                    outcome["connections"] = producer.stats.connections
                relays.cancel_scope.cancel()
            assert buffer.fill == 0  # the relay never let a whole frame through
    assert "error" in outcome, f"the producer ended without an error after {outcome['seconds']:.1f} s"
    message = str(outcome["error"])
    assert "'sim'" in message, message
    assert f"{RECONNECT_TIMEOUT:g} s" in message, message
    assert outcome["connections"] >= 2  # the handshakes went through: it was cut, not unreachable
    # reconnect_timeout, plus at most one backoff (1 s) and a handshake's time on a loaded machine.
    assert RECONNECT_TIMEOUT <= outcome["seconds"] < RECONNECT_TIMEOUT + 8, outcome
