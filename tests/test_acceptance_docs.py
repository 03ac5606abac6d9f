"""Acceptance tests written from the documentation only (not from lamploop's source).

Each test quotes the page it checks.  They cover this week's features: the settings object of
the drivers (docs/architecture.md "Adding a setting", docs/contract-changes.md), the shared
transport (docs/transport.md), the step breakdown and the profiler (docs/observability.md), the
three learning-rate mechanisms (docs/schedules.md), DataLoader workers and signals
(docs/reliability.md) and why a run ended early (CHANGELOG.md, ``RunFinished.reason``).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from torch.optim.lr_scheduler import StepLR
from workers import warm_start

import lamploop
import lamploop.streaming
from lamploop.distributed import local_data_parallel_training_loop
from lamploop.errors import (
    ConfigurationError,
    ControlChannelError,
    FrameError,
    HandshakeError,
    PeerLostError,
    StreamingError,
    TransportError,
)
from lamploop.inspection import format_report, inspect_checkpoint
from lamploop.reporting import MetricsFileReporter
from lamploop.reporting.events import EpochFinished, RunFinished
from lamploop.schedules import linear, noop
from lamploop.schedules.step import warmup_cosine, warmup_linear
from lamploop.transport.proofs import new_nonce

WORKERS = Path(__file__).parent / "workers"
WRONG_TOKEN = "the proof of the shared token did not match (wrong token?)"


# --------------------------------------------------------------------------------------------
# shared helpers


def _data(n: int = 64, features: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=generator), torch.randint(0, 2, (n,), generator=generator)


def _module(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


class Recorder:
    """A reporter (docs/how-to/custom-reporters.md: any object with ``report``) keeping every event."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def report(self, event: Any) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list[Any]:
        return [event for event in self.events if isinstance(event, kind)]


def _parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


# --------------------------------------------------------------------------------------------
# 1. One settings object (docs/contract-changes.md "One settings object", architecture.md)


def _local_run(**arguments: Any) -> tuple[lamploop.LoopState, list[torch.Tensor]]:
    """Two CPU replicas in one process (docs/distributed.md "One process, several devices")."""
    x, y = _data()
    batches = lamploop.tensor_batches(x, y, batch_size=8)
    valid = lamploop.tensor_batches(x[:32], y[:32], batch_size=16, shuffle=False)
    replicas = [(lamploop.SupervisedModel(_module()), batches, valid) for _ in range(2)]

    async def run() -> lamploop.LoopState:
        with anyio.fail_after(60):
            return await local_data_parallel_training_loop(
                replicas,
                lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.5),
                2,
                return_min_validation_loss_model=(),
                **arguments,
            )

    state = anyio.run(run)
    return state, _parameters(replicas[0][0].module)


def test_settings_object_equals_the_keywords_on_two_local_replicas() -> None:
    """contract-changes.md: the older keywords still work, one keyword each; settings= is the same run."""
    schedule = warmup_linear(warmup_steps=2, total_steps=8, steps_per_epoch=4)
    by_keywords, parameters_k = _local_run(
        strategy="reduce_to_root", max_gradient_norm=0.05, step_schedule=schedule
    )
    by_settings, parameters_s = _local_run(
        settings=lamploop.TrainingSettings(
            strategy="reduce_to_root", max_gradient_norm=0.05, step_schedule=schedule
        )
    )
    plain, parameters_p = _local_run()
    assert by_keywords.learning_curve == by_settings.learning_curve
    assert all(torch.equal(a, b) for a, b in zip(parameters_k, parameters_s, strict=True))
    # The settings did act: clipping to 0.05 and a warm-up change the trained parameters.
    assert not all(torch.equal(a, b) for a, b in zip(parameters_k, parameters_p, strict=True))
    assert by_settings.epoch == plain.epoch == 2


def _drive_alone(**arguments: Any) -> lamploop.LoopState:
    """drive_distributed_training(nranks=1, control=None): one rank, no channel (contract-changes.md)."""
    x, y = _data()
    arguments.setdefault("max_epochs", 3)
    optimizer_factory = arguments.pop("optimizer_factory", lambda params: torch.optim.SGD(params, lr=0.1))

    async def run() -> lamploop.LoopState:
        with anyio.fail_after(30):
            return await lamploop.drive_distributed_training(
                nranks=1,
                device="cpu",
                control=None,
                model=lamploop.SupervisedModel(_module()),
                optimizer_factory=optimizer_factory,
                train_batches=lamploop.tensor_batches(x, y, batch_size=16),
                validation_batches=lamploop.tensor_batches(x, y, batch_size=32, shuffle=False),
                **arguments,
            )

    return anyio.run(run)


@pytest.mark.parametrize("entry", ["drive_distributed_training", "local_data_parallel_training_loop"])
def test_a_setting_given_both_ways_is_a_configuration_error_naming_it(entry: str) -> None:
    """contract-changes.md: 'A setting given both as a keyword and in settings= ... a
    ConfigurationError naming the function and the keyword'."""
    run = _drive_alone if entry == "drive_distributed_training" else _local_run
    with pytest.raises(ConfigurationError) as caught:
        run(settings=lamploop.TrainingSettings(max_gradient_norm=1.0), max_gradient_norm=1.0)
    assert "max_gradient_norm" in str(caught.value)
    assert entry in str(caught.value)


@pytest.mark.parametrize("entry", ["drive_distributed_training", "local_data_parallel_training_loop"])
def test_an_unknown_keyword_is_a_configuration_error_not_a_type_error(entry: str) -> None:
    """contract-changes.md: an unknown keyword 'was Python's TypeError'; now ConfigurationError."""
    run = _drive_alone if entry == "drive_distributed_training" else _local_run
    with pytest.raises(ConfigurationError) as caught:
        run(max_gradient_value=1.0)
    assert "max_gradient_value" in str(caught.value)
    assert entry in str(caught.value)


def test_follow_refuses_a_setting_given_both_ways_before_touching_its_channel() -> None:
    """The same merge in follow_distributed_training (architecture.md: the three drivers)."""

    async def follow(**arguments: Any) -> None:
        root, followers = lamploop.local_control(2)
        try:
            with anyio.fail_after(20):
                await lamploop.follow_distributed_training(
                    rank=1,
                    nranks=2,
                    device="cpu",
                    control=followers[0],
                    model=lamploop.SupervisedModel(_module()),
                    train_batches=lamploop.tensor_batches(*_data(), batch_size=16),
                    validation_batches=None,
                    **arguments,
                )
        finally:
            await followers[0].aclose()
            await root.aclose()

    with pytest.raises(ConfigurationError) as both:
        anyio.run(
            lambda: follow(settings=lamploop.TrainingSettings(strategy="all_reduce"), strategy="all_reduce")
        )
    assert "strategy" in str(both.value)
    assert "follow_distributed_training" in str(both.value)
    with pytest.raises(ConfigurationError) as unknown:
        anyio.run(lambda: follow(early_stopping_patience=2))  # root-only: not a follower keyword
    assert "early_stopping_patience" in str(unknown.value)


def test_a_lamp_keyword_at_its_default_takes_the_settings_value() -> None:
    """contract-changes.md: 'A lamp keyword left at its default takes the settings' value'."""
    state = _drive_alone(settings=lamploop.TrainingSettings(validation_frequency=2))
    validated = [entry.epoch for entry in state.learning_curve if entry.validation_loss is not None]
    assert validated == [0, 2]


def test_a_lamp_keyword_that_contradicts_the_settings_is_refused() -> None:
    """contract-changes.md: a lamp keyword 'given and different from a value set in settings= is refused'."""
    with pytest.raises(ConfigurationError) as caught:
        _drive_alone(settings=lamploop.TrainingSettings(validation_frequency=2), validation_frequency=3)
    assert "validation_frequency" in str(caught.value)
    with pytest.raises(ConfigurationError, match="max_epochs"):
        _drive_alone(settings=lamploop.TrainingSettings(max_epochs=5), max_epochs=3)
    # The same value both ways is no contradiction.
    state = _drive_alone(settings=lamploop.TrainingSettings(validation_frequency=2), validation_frequency=2)
    assert [entry.epoch for entry in state.learning_curve if entry.validation_loss is not None] == [0, 2]


# --------------------------------------------------------------------------------------------
# 2. The transport (docs/transport.md), probed as a hostile peer would


class RawPeer:
    """A TCP client that speaks frames by hand: a 4-byte big-endian length, then the body."""

    def __init__(self, stream: anyio.abc.ByteStream, prefix: int) -> None:
        self.stream = stream
        self.buffer = b""
        self.prefix = prefix  # bytes before the JSON in a body (streaming, federated: its 2-byte length)

    @classmethod
    @asynccontextmanager
    async def connect(cls, address: tuple[str, int], prefix: int = 0) -> AsyncIterator[RawPeer]:
        stream = await anyio.connect_tcp(*address)
        try:
            yield cls(stream, prefix)
        finally:
            await stream.aclose()

    async def _fill(self, n: int) -> bool:
        while len(self.buffer) < n:
            try:
                chunk = await self.stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError, OSError):
                return False
            self.buffer += chunk
        return True

    async def frame(self, within: float = 5.0) -> dict[str, Any] | None:
        """The next frame's JSON (its first JSON part), or None at the end of the stream."""
        with anyio.fail_after(within):
            if not await self._fill(4):
                return None
            length = int.from_bytes(self.buffer[:4], "big")
            if not await self._fill(4 + length):
                return None
            body, self.buffer = self.buffer[4 : 4 + length], self.buffer[4 + length :]
        decoded, _ = json.JSONDecoder().raw_decode(body[self.prefix :].decode("utf-8", errors="replace"))
        assert isinstance(decoded, dict)
        return decoded

    async def closed_without_reply(self, within: float = 5.0) -> bool:
        """Whether the server closes the connection and sends nothing more."""
        with anyio.fail_after(within):
            more = await self._fill(len(self.buffer) + 1)
        return not more

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)


def _header(length: int) -> bytes:
    return length.to_bytes(4, "big")


def _padded(frame: bytes, body_length: int, prefix: int) -> bytes:
    """``frame`` (a JSON object after ``prefix`` bytes of JSON length) with spaces before its
    closing brace, to a body of ``body_length`` bytes."""
    body = frame[4:]
    assert body.endswith(b"}")
    assert len(body) <= body_length
    document = body[prefix:-1] + b" " * (body_length - len(body)) + b"}"
    length = len(document).to_bytes(prefix, "big") if prefix else b""
    return _header(prefix + len(document)) + length + document


class Listener:
    """One protocol's server, as transport.md describes it, and what a hostile peer needs of it."""

    def __init__(
        self,
        name: str,
        address: tuple[str, int],
        preauth_limit: int,
        hello: Callable[..., bytes],
        real_client: Callable[[], Awaitable[None]],
        wrong_token_client: Callable[[], Awaitable[None]],
        refusals: Callable[[], int],
        prefix: int = 0,
    ) -> None:
        self.prefix = prefix
        self.name = name
        self.address = address
        self.preauth_limit = preauth_limit
        self.hello = hello  # (nonce, *, version, token) -> frame bytes
        self.real_client = real_client
        self.wrong_token_client = wrong_token_client
        self.refusals = refusals


TOKEN = "acceptance token"


@asynccontextmanager
async def _control_listener() -> AsyncIterator[Listener]:
    from lamploop.control import Rendezvous, Stop, TcpControlFollower, TcpControlRoot, wire
    from lamploop.modelspec import model_spec

    spec = model_spec(torch.nn.Linear(3, 2))
    async with TcpControlRoot(nranks=2, token=TOKEN, model_spec=spec, handshake_timeout=1.5) as root:

        def hello(nonce: str, *, version: int = wire.PROTOCOL_VERSION, token: str | None = TOKEN) -> bytes:
            message = wire.Hello(
                protocol_version=version, rank=1, nranks=2, model_spec=spec, nonce=new_nonce(), proof="0" * 64
            )
            if token is not None:
                proof = wire.follower_proof(token.encode(), root_nonce=nonce, hello=message)
                message = wire.Hello(
                    protocol_version=version,
                    rank=1,
                    nranks=2,
                    model_spec=spec,
                    nonce=message.nonce,
                    proof=proof,
                )
            return wire.encode_frame(message)

        async def real_client() -> None:
            follower = TcpControlFollower(
                host=root.address[0], port=root.address[1], rank=1, nranks=2, token=TOKEN, model_spec=spec
            )
            seen: list[Any] = []

            async def follow() -> None:
                async with follower:
                    rendezvous, commands = await follower.join()
                    seen.append(rendezvous)
                    async for command in commands:
                        seen.append(command)

            async with anyio.create_task_group() as group:
                group.start_soon(follow)
                await root.on_rendezvous_ready(Rendezvous(host="127.0.0.1", port=1))
                assert root.peers() == (1,)
                await root.broadcast(Stop(reason="done"))
            assert seen == [Rendezvous(host="127.0.0.1", port=1), Stop(reason="done")]

        async def wrong_token_client() -> None:
            follower = TcpControlFollower(
                host=root.address[0],
                port=root.address[1],
                rank=1,
                nranks=2,
                token="another token",
                model_spec=spec,
                connect_timeout=5,
            )
            async with follower:
                await follower.join()

        yield Listener(
            "control",
            root.address,
            wire.preauth_frame_limit(2, spec, 4 * 1024 * 1024),
            hello,
            real_client,
            wrong_token_client,
            lambda: len(root.recent_refusals),
        )


@asynccontextmanager
async def _streaming_listener() -> AsyncIterator[Listener]:
    from lamploop.streaming import FifoBuffer, wire
    from lamploop.streaming.producer import AsyncProducer
    from lamploop.streaming.receiver import SampleReceiver

    buffer = FifoBuffer(capacity=64, watermark=1, seed=0)
    async with SampleReceiver(
        buffer, token=TOKEN, allowed_producers=["sim"], handshake_timeout=1.5
    ) as receiver:

        def hello(nonce: str, *, version: int = wire.PROTOCOL_VERSION, token: str | None = TOKEN) -> bytes:
            message = wire.Hello(protocol_version=version, producer="sim", nonce=new_nonce(), proof="0" * 64)
            if token is not None:
                proof = wire.producer_proof(token.encode(), receiver_nonce=nonce, hello=message)
                message = wire.Hello(
                    protocol_version=version, producer="sim", nonce=message.nonce, proof=proof
                )
            return wire.encode_frame(message)

        sent = [0]

        async def real_client() -> None:
            async with AsyncProducer(
                receiver.address, name="sim", token=TOKEN, reconnect_timeout=10
            ) as producer:
                await producer.send({"x": torch.full((3,), float(sent[0]))})
            sent[0] += 1  # leaving the block waited for the acknowledgement: the sample is in the buffer
            with anyio.fail_after(10):
                while buffer.received < sent[0]:  # noqa: ASYNC110 - a counter of the buffer, no event to wait on
                    await anyio.sleep(0.02)

        async def wrong_token_client() -> None:
            async with AsyncProducer(
                receiver.address, name="sim", token="another token", reconnect_timeout=3, handshake_timeout=3
            ) as producer:
                await producer.send({"x": torch.zeros(3)})

        yield Listener(
            "streaming",
            receiver.address,
            wire.PREAUTH_FRAME_BYTES,
            hello,
            real_client,
            wrong_token_client,
            lambda: int(receiver.refusals),
            prefix=2,
        )


@asynccontextmanager
async def _federated_listener() -> AsyncIterator[Listener]:
    from lamploop.federated import (
        AggregatorSettings,
        ModelDescription,
        OptimizerConfig,
        TrainingPlan,
        mlp,
        run_aggregator,
        wire,
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
    port: list[int] = []

    async def aggregate() -> None:
        await run_aggregator(
            plan=plan,
            initial_model=mlp(options),
            token=TOKEN,
            settings=AggregatorSettings(
                rounds=1, min_nodes=2, expected_nodes=2, join_timeout=120, handshake_timeout=1.5
            ),
            on_listening=port.append,
        )

    def hello(nonce: str, *, version: int = wire.PROTOCOL_VERSION, token: str | None = TOKEN) -> bytes:
        message = wire.Hello(protocol_version=version, node="node-0", nonce=new_nonce(), proof="0" * 64)
        if token is not None:
            proof = wire.node_proof(token.encode(), aggregator_nonce=nonce, hello=message)
            message = wire.Hello(protocol_version=version, node="node-0", nonce=message.nonce, proof=proof)
        return wire.encode_frame(message)

    async with anyio.create_task_group() as group:
        group.start_soon(aggregate)
        with anyio.fail_after(10):
            while not port:  # noqa: ASYNC110 - filled by run_aggregator's on_listening callback
                await anyio.sleep(0.01)
        address = ("127.0.0.1", port[0])

        async def real_client() -> None:
            # A peer that proves the token is welcomed (transport.md: the aggregator checks no fields).
            async with RawPeer.connect(address, 2) as peer:
                challenge = await peer.frame()
                assert challenge is not None
                assert challenge["type"] == "challenge"
                await peer.send(hello(challenge["nonce"]))
                reply = await peer.frame()
                assert reply is not None
                assert reply["type"] == "welcome", reply

        async def wrong_token_client() -> None:
            raise HandshakeError(WRONG_TOKEN)  # no node is run here (it needs a data set and allow-list)

        yield Listener(
            "federated",
            address,
            wire.PREAUTH_FRAME_BYTES,
            hello,
            real_client,
            wrong_token_client,
            lambda: 0,
            prefix=2,
        )
        group.cancel_scope.cancel()


LISTENERS = {"control": _control_listener, "streaming": _streaming_listener, "federated": _federated_listener}


def _on_listener(name: str, probe: Callable[[Listener], Awaitable[None]]) -> None:
    async def run() -> None:
        with anyio.fail_after(40):
            async with LISTENERS[name]() as listener:
                await probe(listener)

    anyio.run(run)


def test_lamploop_streaming_imports_after_a_control_frame_was_decoded() -> None:
    """Any import order works: a process that ran a control channel can still use streaming."""
    code = (
        "from lamploop.control import wire\n"
        'wire.decode_body(bytearray(b\'{"type":"refuse","reason":"x"}\'))\n'
        "import lamploop.streaming\n"
    )
    # A fresh interpreter, not a warm worker (tests/workers/warm_start.py): the import order is the point.
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-1500:]


def test_transport_errors_are_one_family() -> None:
    """transport.md: every failure is a TransportError; ControlChannelError is its older name."""
    assert ControlChannelError is TransportError or issubclass(TransportError, ControlChannelError)
    for error in (FrameError, HandshakeError, PeerLostError, StreamingError):
        assert issubclass(error, TransportError), error
        assert issubclass(error, ControlChannelError), error


@pytest.mark.parametrize("name", ["control", "streaming", "federated"])
def test_a_hostile_peer_is_refused_and_a_real_client_served(name: str) -> None:
    """transport.md: the checks and the pre-authentication limit, on the three real listeners."""

    async def probe(listener: Listener) -> None:
        limit = listener.preauth_limit
        # The server speaks first: a challenge with the version and a well-formed nonce.
        async with RawPeer.connect(listener.address, listener.prefix) as peer:
            challenge = await peer.frame()
            assert challenge is not None
            assert challenge["type"] == "challenge"
            assert re.fullmatch("[0-9a-f]{64}", challenge["nonce"])
            assert isinstance(challenge["protocol_version"], int)
        # Garbage after the challenge: a stranger, closed without a reply.
        async with RawPeer.connect(listener.address, listener.prefix) as peer:
            assert await peer.frame() is not None
            await peer.send(_header(7) + b"garbage")
            assert await peer.closed_without_reply()
        # A header announcing one byte over the limit is refused at the header: its body is never sent.
        async with RawPeer.connect(listener.address, listener.prefix) as peer:
            assert await peer.frame() is not None
            await peer.send(_header(limit + 1))
            assert await peer.closed_without_reply(within=3.0)
        # A hello of exactly the limit is judged: the proof first (another version, wrong proof).
        async with RawPeer.connect(listener.address, listener.prefix) as peer:
            challenge = await peer.frame()
            assert challenge is not None
            await peer.send(
                _padded(
                    listener.hello(challenge["nonce"], version=999, token="wrong"), limit, listener.prefix
                )
            )
            refused = await peer.frame()
            assert refused is not None
            assert refused["type"] == "refuse", refused
            assert refused["reason"] == WRONG_TOKEN
            assert "999" not in refused["reason"]
            assert await peer.closed_without_reply()
        # Two frames in one read before the proof: the hello is judged alone (the second announces 64 MB).
        async with RawPeer.connect(listener.address, listener.prefix) as peer:
            challenge = await peer.frame()
            assert challenge is not None
            await peer.send(listener.hello(challenge["nonce"], token="wrong") + _header(64 << 20) + b"x" * 16)
            refused = await peer.frame()
            assert refused is not None
            assert refused["reason"] == WRONG_TOKEN, refused
        if name != "control":  # control: a peer that proved the token but does not fit fails the run (below)
            await _another_version_with_the_token(listener)
        # Bytes before the challenge: no hello ever follows; the connection ends.
        async with RawPeer.connect(listener.address, listener.prefix) as peer:
            await peer.send(b"GET / HTTP/1.0\r\n\r\n")
            first = await peer.frame()
            assert first is None or first["type"] == "challenge"
            assert first is None or await peer.closed_without_reply()
        # A silent peer does not keep a real client out, and is closed at the handshake timeout.
        async with RawPeer.connect(listener.address, listener.prefix) as silent:
            assert await silent.frame() is not None
            started = time.monotonic()
            await listener.real_client()
            while True:
                reply = await silent.frame(within=6)
                if reply is None:
                    break
                assert reply["type"] == "refuse", reply
            assert time.monotonic() - started < 6
        if name == "streaming":
            assert listener.refusals() >= 6

    _on_listener(name, probe)


async def _another_version_with_the_token(listener: Listener) -> None:
    """transport.md step 3: 'the peer proved the token, so it is refused naming both versions'."""
    async with RawPeer.connect(listener.address, listener.prefix) as peer:
        challenge = await peer.frame()
        assert challenge is not None
        await peer.send(listener.hello(challenge["nonce"], version=999))
        refused = await peer.frame()
        assert refused is not None
        assert refused["type"] == "refuse", refused
        assert "999" in refused["reason"]
        assert str(challenge["protocol_version"]) in refused["reason"]


def test_control_root_fails_its_run_for_a_proven_peer_of_another_version() -> None:
    """transport.md 'Differences on purpose': a peer that proved the token but does not fit is
    refused, and the root's run fails (HandshakeError)."""
    with pytest.raises(HandshakeError, match=r"version 999.*version \d|version \d.*version 999"):
        _on_listener("control", _another_version_with_the_token)


def test_control_root_keeps_serving_after_strangers_and_names_a_wrong_token() -> None:
    """control-channel.md: strangers are only refused (recent_refusals), the run goes on; a
    follower with the wrong token is told the token's reason (transport.md step 2)."""

    async def probe(listener: Listener) -> None:
        async with RawPeer.connect(listener.address, listener.prefix) as peer:
            challenge = await peer.frame()
            assert challenge is not None
            await peer.send(listener.hello(challenge["nonce"], token="wrong"))
            refused = await peer.frame()
            assert refused is not None
            assert refused["reason"] == WRONG_TOKEN
        async with RawPeer.connect(listener.address, listener.prefix) as peer:
            assert await peer.frame() is not None
            await peer.send(_header(listener.preauth_limit + 1))
            assert await peer.closed_without_reply(within=3.0)
        with pytest.raises(HandshakeError, match=re.escape(WRONG_TOKEN)):
            with anyio.fail_after(10):
                await listener.wrong_token_client()
        assert listener.refusals() >= 3
        await listener.real_client()

    _on_listener("control", probe)


def test_control_preauth_limit_is_four_times_the_transport_constant_for_a_small_spec() -> None:
    """transport.md: the control limit is max(4 x PREAUTH_FRAME_BYTES, 2 x own hello)."""
    from lamploop.control import wire
    from lamploop.modelspec import model_spec
    from lamploop.transport.frames import PREAUTH_FRAME_BYTES

    small = model_spec(torch.nn.Linear(3, 2))
    assert wire.preauth_frame_limit(2, small, 4 << 20) == 4 * PREAUTH_FRAME_BYTES
    big = model_spec(torch.nn.Sequential(*[torch.nn.Linear(1, 1) for _ in range(400)]))
    hello = wire.encode_frame(
        wire.Hello(
            protocol_version=wire.PROTOCOL_VERSION,
            rank=1,
            nranks=2,
            model_spec=big,
            nonce="a" * 64,
            proof="b" * 64,
        )
    )
    assert wire.preauth_frame_limit(2, big, 4 << 20) >= 2 * (len(hello) - 4) > 4 * PREAUTH_FRAME_BYTES


def test_a_producer_checks_the_challenges_version_before_it_answers() -> None:
    """transport.md 'Differences on purpose': streaming's client checks the challenge's version
    'yes, before it answers'. A fake receiver speaking version 999 gets no hello."""
    from lamploop.streaming import wire
    from lamploop.streaming.producer import AsyncProducer

    received: list[bytes] = []

    async def serve(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await stream.send(wire.encode_frame(wire.Challenge(protocol_version=999, nonce=new_nonce())))
            with anyio.move_on_after(3):
                while True:
                    try:
                        received.append(await stream.receive())
                    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                        return

    async def run() -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as group:
            group.start_soon(listener.serve, serve)

            async def produce() -> None:
                with anyio.fail_after(20):
                    async with AsyncProducer(
                        ("127.0.0.1", port), name="sim", token=TOKEN, reconnect_timeout=2, handshake_timeout=2
                    ) as producer:
                        await producer.send({"x": torch.zeros(3)})

            with pytest.raises(TransportError, match="999"):
                await produce()
            group.cancel_scope.cancel()

    anyio.run(run)
    assert b"".join(received) == b"", received


def test_streaming_wrong_token_producer_is_told_why() -> None:
    """streaming.md / transport.md: a producer with another token is refused with the token's reason."""

    async def probe(listener: Listener) -> None:
        with pytest.raises(TransportError) as caught:
            with anyio.fail_after(15):
                await listener.wrong_token_client()
        assert "token" in str(caught.value)
        await listener.real_client()

    _on_listener("streaming", probe)


# --------------------------------------------------------------------------------------------
# 3. Observability: the step breakdown and the profiler (docs/observability.md)


def _fit(**arguments: Any) -> lamploop.LoopState:
    x, y = _data(128, 4)
    arguments.setdefault("max_epochs", 2)
    arguments.setdefault("reporters", [])
    state = lamploop.fit(
        model=lamploop.SupervisedModel(arguments.pop("module", _module())),
        optimizer_factory=arguments.pop("optimizer_factory", lambda params: torch.optim.SGD(params, lr=0.1)),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),  # 8 steps per epoch
        validation_batches=arguments.pop(
            "validation_batches", lamploop.tensor_batches(x[:64], y[:64], batch_size=32, shuffle=False)
        ),
        device="cpu",
        **arguments,
    )
    assert state is not None
    return state


BREAKDOWN_COLUMNS = [
    "data_wait_seconds",
    "forward_backward_seconds",
    "communication_wait_seconds",
    "optimizer_seconds",
    "checkpoint_seconds",
]


def test_step_breakdown_in_the_events_the_metrics_file_and_the_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """observability.md 'The step breakdown': EpochFinished.step_breakdown, the metrics file's
    columns, and the log line's shares."""
    recorder = Recorder()
    caplog.set_level(logging.INFO, logger="lamploop")
    run = tmp_path / "run"  # observability.md: write it into checkpoint_dir, for lamploop inspect
    _fit(
        reporters=[recorder, MetricsFileReporter(run / "curve.csv"), lamploop.LoggingReporter()],
        max_epochs=2,
        checkpoint_dir=run,
    )
    finished = recorder.of(EpochFinished)
    assert [event.state.learning_curve[-1].epoch for event in finished] == [0, 1]
    for event in finished:
        breakdown = event.step_breakdown
        assert breakdown.steps == event.steps == 8
        parts = [
            breakdown.data_wait,
            breakdown.forward_backward,
            breakdown.communication_wait,
            breakdown.optimizer,
            breakdown.checkpoint,
        ]
        assert all(part >= 0 for part in parts)
        assert breakdown.forward_backward > 0
        assert breakdown.optimizer > 0
        assert breakdown.communication_wait == 0  # one rank: no collective
        assert sum(parts) <= event.seconds
    with (run / "curve.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(row["epoch"]) for row in rows] == [0, 1]
    for row in rows:
        step = float(row["step_seconds"])
        parts = [float(row[column]) for column in BREAKDOWN_COLUMNS]
        assert step > 0
        assert all(part >= 0 for part in parts)
        assert sum(parts) <= step * 1.0001
    lines = [record.getMessage() for record in caplog.records if record.name.startswith("lamploop")]
    epoch_lines = [line for line in lines if re.search(r"epoch [01]:", line)]
    assert len(epoch_lines) == 2, lines
    for line in epoch_lines:
        assert re.search(r"per step [0-9.]+ [mµu]?s: data wait \d+%, forward\+backward \d+%", line), line
    # 'lamploop inspect shows them per epoch when such a file lies in the run directory'.
    report = format_report(inspect_checkpoint(run))
    assert "data wait" in report
    table = report[report.index("data wait") :]
    assert re.search(r"^\s+0\s+8\s", table, re.MULTILINE), report
    assert re.search(r"^\s+1\s+8\s", table, re.MULTILINE), report


def _spans(trace: Path) -> set[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}


def test_profile_rejects_a_bad_value_naming_it(tmp_path: Path) -> None:
    """observability.md: 'Profile: active must be an int >= 1, got 0'."""
    with pytest.raises(ConfigurationError, match=re.escape("Profile: active must be an int >= 1, got 0")):
        lamploop.Profile(out_dir=tmp_path, wait=1, warmup=1, active=0)


def test_profile_windows_repeat_and_count_steps_across_epochs(tmp_path: Path) -> None:
    """observability.md: skip_first once, then repeat x (wait, warmup, active); steps counted
    across epochs; one trace per window, ProfilerStep#N from 0 at the first step."""
    profile = lamploop.Profile(out_dir=tmp_path, skip_first=4, wait=1, warmup=1, active=3, repeat=2)
    _fit(profile=profile, max_epochs=2, validation_batches=None)
    traces = sorted(tmp_path.glob("rank0.*.pt.trace.json"))
    assert len(traces) == 2, traces
    windows = sorted((_spans(trace) for trace in traces), key=lambda spans: sorted(spans))
    # steps 0-3 skipped, 4 wait, 5 warm-up, 6 7 8 recorded (across the epoch boundary at 8),
    # then 9 wait, 10 warm-up, 11 12 13 recorded.
    assert {"ProfilerStep#6", "ProfilerStep#7", "ProfilerStep#8"} in windows
    assert {"ProfilerStep#11", "ProfilerStep#12", "ProfilerStep#13"} in windows


def test_a_local_run_refuses_profile_as_the_docs_say(tmp_path: Path) -> None:
    """observability.md: one profiler per process; local_data_parallel_training_loop, whose
    replicas are threads of one process, refuses profile with a ConfigurationError.

    (Found here: it wrote rank 0's trace only, and a window cut short crashed torch's export.)
    """
    done = warm_start.run(
        [sys.executable, str(WORKERS / "acceptance_profile_local.py"), str(tmp_path), "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "ConfigurationError" in done.stderr, done.stderr[-2000:]
    assert "profile= needs a process per rank" in done.stderr
    assert not list(tmp_path.glob("*.pt.trace.json"))


def test_a_run_that_ends_inside_a_window_writes_the_steps_it_recorded(tmp_path: Path) -> None:
    """observability.md: 'a run that ends inside a window writes what the window recorded, and its
    last span then runs from the last step to the run's end'. 2 epochs of 8 steps: steps 0..15,
    recorded from step 2 (wait 1, warm-up 1), then ProfilerStep#16 up to the end."""
    _fit(profile=lamploop.Profile(out_dir=tmp_path, wait=1, warmup=1, active=20), validation_batches=None)
    (trace,) = tmp_path.glob("rank0.*.pt.trace.json")
    assert _spans(trace) == {f"ProfilerStep#{n}" for n in range(2, 17)}


# --------------------------------------------------------------------------------------------
# 4. Learning rates (docs/schedules.md)

RATES: list[float] = []


class RecordedSGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        RATES.append(round(self.param_groups[0]["lr"], 6))
        return super().step(closure)


def _rates(**learning_rates: Any) -> list[float]:
    RATES.clear()
    x, y = _data(64, 5)
    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(5, 3)),
        optimizer_factory=lambda params: RecordedSGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),
        max_epochs=3,
        device="cpu",
        reporters=[],
        **learning_rates,
    )
    return list(RATES)


def test_each_mechanism_sets_the_documented_rates() -> None:
    assert _rates(learning_rate_schedule=linear(start=1.0, end=0.5, max_steps=2)) == (
        [0.1] * 4 + [0.075] * 4 + [0.05] * 4
    )
    per_step = _rates(step_schedule=warmup_cosine(warmup_steps=2, total_steps=12, steps_per_epoch=4))
    assert per_step[:3] == [0.05, 0.1, 0.1]
    assert per_step[-1] < 0.01
    assert _rates(lr_scheduler=lambda optimizer: StepLR(optimizer, step_size=1, gamma=0.5)) == (
        [0.1] * 4 + [0.05] * 4 + [0.025] * 4
    )
    per_step_scheduler = _rates(
        lr_scheduler=lambda optimizer: StepLR(optimizer, step_size=2, gamma=0.5), lr_scheduler_interval="step"
    )
    assert per_step_scheduler[:6] == [0.1, 0.1, 0.05, 0.05, 0.025, 0.025]


def test_an_epoch_and_a_step_schedule_multiply() -> None:
    """schedules.md: 'the step's rate is base_lr * epoch factor * step factor'."""
    steps = warmup_linear(warmup_steps=2, total_steps=12, steps_per_epoch=4)
    alone = _rates(step_schedule=steps)
    both = _rates(step_schedule=steps, learning_rate_schedule=linear(start=1.0, end=0.5, max_steps=2))
    factors = [1.0] * 4 + [0.75] * 4 + [0.5] * 4
    assert both == pytest.approx(
        [rate * factor for rate, factor in zip(alone, factors, strict=True)], abs=2e-6
    )


@pytest.mark.parametrize(
    "beside",
    [
        {"step_schedule": warmup_cosine(warmup_steps=2, total_steps=12, steps_per_epoch=4)},
        {"learning_rate_schedule": linear(start=1.0, end=0.5, max_steps=2)},
    ],
    ids=["step_schedule", "epoch_schedule"],
)
def test_a_torch_scheduler_beside_another_mechanism_is_refused_before_anything_starts(
    beside: dict[str, Any],
) -> None:
    """schedules.md: 'combined with an epoch schedule other than noop() or with a step schedule
    it is a ConfigurationError' ... 'refused before anything starts'."""
    RATES.clear()
    with pytest.raises(ConfigurationError, match="lr_scheduler owns the learning rates"):
        _rates(lr_scheduler=lambda optimizer: StepLR(optimizer, step_size=1), **beside)
    assert RATES == []


def test_a_torch_scheduler_with_noop_is_accepted() -> None:
    rates = _rates(
        lr_scheduler=lambda optimizer: StepLR(optimizer, step_size=1, gamma=0.5),
        learning_rate_schedule=noop(),
    )
    assert rates == [0.1] * 4 + [0.05] * 4 + [0.025] * 4


def test_the_drivers_refuse_the_same_combination_in_settings() -> None:
    """The rule holds wherever the settings go: drive_distributed_training(settings=...)."""
    with pytest.raises(ConfigurationError, match="lr_scheduler owns the learning rates"):
        _drive_alone(
            settings=lamploop.TrainingSettings(
                lr_scheduler=lambda optimizer: StepLR(optimizer, step_size=1),
                step_schedule=warmup_cosine(warmup_steps=2, total_steps=12, steps_per_epoch=4),
            )
        )


# --------------------------------------------------------------------------------------------
# 5. DataLoader workers leave SIGINT/SIGTERM to the run (docs/reliability.md)


def test_sigterm_to_the_process_group_stops_at_a_boundary_with_a_checkpoint(tmp_path: Path) -> None:
    """reliability.md: 'A signal to the whole process group ... also reaches the loader's worker
    processes. dataloader_batches gives its loaders' workers leave_stop_signals_to_the_run: they
    ignore SIGINT and SIGTERM, leaving them to the run, which stops as above' (143, checkpoint)."""
    ready, checkpoints = tmp_path / "ready", tmp_path / "checkpoints"
    process = subprocess.Popen(
        [sys.executable, str(WORKERS / "acceptance_dataloader_stop.py"), str(checkpoints), str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a terminal's job
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the DataLoader's workers never served a batch"
        time.sleep(0.5)  # a few steps in, workers alive and busy
        os.killpg(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    text = output.decode(errors="replace")
    assert process.returncode == 143, text
    assert "interrupted: SIGTERM" in text, text
    assert "killed by signal" not in text, text
    written = sorted(path.name for path in checkpoints.glob("epoch-*-step-*"))
    assert written, (text, list(checkpoints.iterdir()) if checkpoints.exists() else None)
    assert re.fullmatch(r"epoch-\d{6}-step-\d{6}", written[-1])


def test_the_worker_init_keeps_the_users_own_init() -> None:
    """reliability.md: worker_init_leaving_signals(your_init_fn) wraps the user's init."""
    from lamploop.forked_children import worker_init_leaving_signals

    called: list[int] = []
    init = worker_init_leaving_signals(called.append)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    child = os.fork()
    if child == 0:  # a forked "worker": init, then report what it did with the signals
        ok = False
        try:
            init(3)
            ok = (
                called == [3]
                and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
                and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            )
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


# --------------------------------------------------------------------------------------------
# 6. A run that ends early says why (CHANGELOG.md, RunFinished.reason, epochs(on_end=))


def _finish(
    caplog: pytest.LogCaptureFixture, **arguments: Any
) -> tuple[lamploop.LoopState, RunFinished, list[str]]:
    recorder = Recorder()
    caplog.clear()
    caplog.set_level(logging.INFO, logger="lamploop")
    state = _fit(reporters=[recorder, lamploop.LoggingReporter()], **arguments)
    (finished,) = recorder.of(RunFinished)
    lines = [record.getMessage() for record in caplog.records if record.name.startswith("lamploop")]
    return state, finished, lines


def test_early_stopping_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """CHANGELOG: 'RunFinished.reason and the last line say why a run ended before max_epochs
    (early stopping with its count ...)'. A learning rate of 0 never improves on epoch 0."""
    state, finished, lines = _finish(
        caplog,
        max_epochs=10,
        early_stopping_patience=2,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.0),
    )
    assert state.epoch == 3
    assert finished.reason.startswith("early stopping: ")
    assert "2 validations without a new best since epoch 0" in finished.reason
    assert "early_stopping_patience=2" in finished.reason
    assert any(line.startswith(f"finished after epoch 2: {finished.reason}") for line in lines), lines


def test_the_schedules_zero_factor_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """epochs' docstring: 'Run epochs until max_epochs or until the schedule's factor is <= 0';
    the reason says so."""
    state, finished, lines = _finish(
        caplog, max_epochs=10, learning_rate_schedule=linear(start=1.0, end=0.0, max_steps=2)
    )
    assert state.epoch == 2
    assert finished.reason
    assert "factor" in finished.reason
    assert any(line.startswith(f"finished after epoch 1: {finished.reason}") for line in lines), lines


def test_a_run_to_max_epochs_has_no_reason(caplog: pytest.LogCaptureFixture) -> None:
    state, finished, lines = _finish(caplog, max_epochs=2)
    assert state.epoch == 2
    assert finished.reason == ""
    assert any(re.match(r"finished after epoch 1\b", line) for line in lines), lines
    assert not any(re.match(r"finished after epoch 1: ", line) for line in lines), lines


def test_epochs_on_end_is_called_once_with_the_reason() -> None:
    """epochs(on_end=): 'called once, as the loop ends, with why it ended ... "" at max_epochs'."""
    ends: list[str] = []

    async def train(factor: float) -> float:
        return 1.0

    async def validate() -> float:
        return 1.0

    async def save() -> None:
        return None

    async def run(**arguments: Any) -> lamploop.LoopState:
        return await lamploop.epochs(
            max_epochs=6,
            train_epoch=train,
            validation_epoch=validate,
            save_min_validation_loss_model=save,
            on_end=ends.append,
            return_min_validation_loss_model=lamploop.ALL_EPOCHS,
            **arguments,
        )

    assert anyio.run(lambda: run(early_stopping_patience=1)).epoch == 2
    assert anyio.run(lambda: run()).epoch == 6
    assert len(ends) == 2
    assert ends[0].startswith("early stopping: ")
    assert ends[1] == ""


def test_early_stopping_does_not_depend_on_which_epochs_may_become_the_best_model() -> None:
    """epochs' docstring: 'early_stopping_patience: stop once this many validations in a row have not
    improved on the best one'; nothing ties it to return_min_validation_loss_model."""
    recorder = Recorder()
    state = _drive_alone(
        max_epochs=6,
        reporters=[recorder],
        settings=lamploop.TrainingSettings(early_stopping_patience=1),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.0),
    )
    assert state.epoch == 2


def test_the_driver_reports_the_reason_too() -> None:
    """contract-changes.md: drive_distributed_training(reporters=) reports run finished."""
    recorder = Recorder()
    state = _drive_alone(
        max_epochs=10,
        reporters=[recorder],
        return_min_validation_loss_model=lamploop.ALL_EPOCHS,
        settings=lamploop.TrainingSettings(early_stopping_patience=1),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.0),
    )
    (finished,) = recorder.of(RunFinished)
    assert state.epoch == 2
    assert finished.reason.startswith("early stopping: ")
    assert "early_stopping_patience=1" in finished.reason
