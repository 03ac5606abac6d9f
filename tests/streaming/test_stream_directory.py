"""Producers handed out over several ranks' receivers by the root's directory (redirects).

Several real SampleReceivers on 127.0.0.1 in one process (one per "rank"), real producers,
and one test with producer processes killed and restarted; every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import attrs
import pytest
import torch
from support import ROOT
from workers import warm_start

from lamploop.control.wire import new_nonce
from lamploop.errors import ConfigurationError, HandshakeError
from lamploop.streaming.directory import ProducerDirectory
from lamploop.streaming.producer import AsyncProducer
from lamploop.streaming.receiver import SampleReceiver
from lamploop.streaming.sample import Sample
from lamploop.streaming.wire import (
    PROTOCOL_VERSION,
    Challenge,
    FramedStream,
    Hello,
    Redirect,
    Refuse,
    encode_frame,
    producer_proof,
    redirect_proof,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKEN = b"the streaming secret"
ROOT = ROOT


class ListSink:
    """Takes every sample at once."""

    def __init__(self) -> None:
        self.items: list[Sample] = []

    async def put(self, sample: Sample) -> None:
        self.items.append(sample)

    def seqs(self, producer: str) -> list[int]:
        return [s.seq for s in self.items if s.producer == producer]

    def producers(self) -> set[str]:
        return {s.producer for s in self.items}


def tensors_for(name: str, seq: int) -> dict[str, torch.Tensor]:
    return {"x": torch.full((4,), float(seq)), "who": torch.tensor([len(name), seq])}


async def eventually(condition: Callable[[], bool], within: float = 15.0) -> None:
    """Poll ``condition`` (state of another task or process) until true; TimeoutError after ``within`` s."""
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 (polling another object's state, not an event of ours)
            await anyio.sleep(0.01)


async def produce(address: tuple[str, int], name: str, seqs: range, **options: Any) -> AsyncProducer:
    """Send ``seqs`` as producer ``name`` (from seqs.start) and wait until all are acknowledged."""
    async with AsyncProducer(address, name=name, token=TOKEN, start_seq=seqs.start, **options) as producer:
        for seq in seqs:
            await producer.send(tensors_for(name, seq))
        await producer.done()
    return producer


async def test_producers_are_spread_round_robin_by_first_arrival_and_stay_where_they_were_sent() -> None:
    sinks = [ListSink() for _ in range(3)]
    names = [f"sim-{i}" for i in range(7)]
    with anyio.fail_after(30):
        async with (
            SampleReceiver(sinks[0], token=TOKEN) as root,
            SampleReceiver(sinks[1], token=TOKEN) as rank1,
            SampleReceiver(sinks[2], token=TOKEN) as rank2,
        ):
            addresses = [root.address, rank1.address, rank2.address]
            root.set_directory(addresses)
            for name in names:  # one after the other: the order of first arrival is known
                producer = await produce(root.address, name, range(5))
                index = names.index(name) % 3
                assert producer.receiver_address == addresses[index]
            assert root.directory_assignments == {name: i % 3 for i, name in enumerate(names)}
            # Sticky: a producer started again (from 0) goes back to its receiver, which
            # skips what it holds and takes the rest, once.
            again = await produce(root.address, "sim-4", range(12))
            assert again.receiver_address == rank1.address
            assert again.stats.skipped == 5
            assert root.directory_assignments["sim-4"] == 1
            refusals = [r.refusals for r in (root, rank1, rank2)]
            acknowledged = [r.acknowledged for r in (root, rank1, rank2)]
    assert refusals == [0, 0, 0]
    for index, sink in enumerate(sinks):
        mine = {name for i, name in enumerate(names) if i % 3 == index}
        assert sink.producers() == mine
        for name in mine:
            assert sink.seqs(name) == list(range(12 if name == "sim-4" else 5))
        assert acknowledged[index] == {name: 11 if name == "sim-4" else 4 for name in mine}


async def test_a_producer_the_root_took_before_the_directory_stays_with_the_root() -> None:
    sinks = [ListSink(), ListSink()]
    with anyio.fail_after(30):
        async with (
            SampleReceiver(sinks[0], token=TOKEN) as root,
            SampleReceiver(sinks[1], token=TOKEN) as rank1,
        ):
            early = await produce(root.address, "early", range(3))  # no directory yet: the root takes it
            root.set_directory([root.address, rank1.address])
            assert root.directory_assignments == {"early": 0}
            later = await produce(root.address, "later", range(3))  # the fewest producers: rank 1
            again = await produce(root.address, "early", range(3, 6))
    assert early.receiver_address == again.receiver_address == root.address
    assert later.receiver_address == rank1.address
    assert sinks[0].seqs("early") == list(range(6))
    assert sinks[1].seqs("later") == list(range(3))


async def test_restored_assignments_hold_producers_until_the_directory_then_send_them_back() -> None:
    """A resumed root: producers that arrive before set_directory wait (they retry), then go to
    the rank their assignment names, at that rank's new address."""
    sinks = [ListSink(), ListSink()]
    with anyio.fail_after(30):
        async with (
            SampleReceiver(
                sinks[0], token=TOKEN, directory_assignments={"a": 1, "b": 0}, handshake_timeout=1.0
            ) as root,
            SampleReceiver(sinks[1], token=TOKEN, acknowledged={"a": 4}) as rank1,
            anyio.create_task_group() as tg,
        ):
            done: list[AsyncProducer] = []

            async def run(name: str) -> None:
                done.append(await produce(root.address, name, range(10), keep_acknowledged=10))

            tg.start_soon(run, "a")
            tg.start_soon(run, "b")
            # Several hellos held and dropped meanwhile (1 s handshakes: 0.3 s let a loaded machine
            # time out an honest hello, a refusal).
            await anyio.sleep(2.5)
            assert sinks[0].items == sinks[1].items == []
            assert root.refusals == 0  # not refused: dropped to retry, the producers do not fail
            root.set_directory([root.address, rank1.address])
            await eventually(lambda: len(done) == 2)
    assert sinks[1].seqs("a") == list(range(5, 10))  # rank 1 held 0..4 of "a" already
    assert sinks[0].seqs("b") == list(range(10))
    assert sinks[0].producers() == {"b"}
    assert sinks[1].producers() == {"a"}
    assert root.directory_assignments == {"a": 1, "b": 0}


async def test_with_fixed_assignments_and_indexes_each_rank_serves_its_own_at_once() -> None:
    """Every rank's receiver gets the same assignments and its own index: the root serves its
    producers before the directory is set and holds the others; rank 1 serves those sent to it."""
    assignments = {"a": 1, "b": 0}
    sinks = [ListSink(), ListSink()]
    with anyio.fail_after(30):
        async with (
            SampleReceiver(
                sinks[0],
                token=TOKEN,
                directory_assignments=assignments,
                directory_index=0,
                handshake_timeout=1.0,
            ) as root,
            SampleReceiver(
                sinks[1], token=TOKEN, directory_assignments=assignments, directory_index=1
            ) as rank1,
            anyio.create_task_group() as tg,
        ):
            b = await produce(root.address, "b", range(4))  # its own: served at once
            assert b.receiver_address == root.address
            tg.start_soon(produce, root.address, "a", range(4))
            await anyio.sleep(1.5)
            assert sinks[1].items == []  # "a" waits for the directory
            with pytest.raises(
                ConfigurationError, match="own_index=1, but this receiver's directory_index is 0"
            ):
                root.set_directory([rank1.address, root.address], own_index=1)
            root.set_directory([root.address, rank1.address])
            await eventually(lambda: len(sinks[1].items) == 4)
    assert sinks[0].seqs("b") == list(range(4))
    assert sinks[1].seqs("a") == list(range(4))
    assert root.directory_assignments == rank1.directory_assignments == assignments


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def _run_receiver(
    receiver: SampleReceiver, stop: anyio.Event, *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    async with receiver:
        task_status.started()
        await stop.wait()


async def test_after_the_trainer_restarts_a_producer_asks_the_root_again_and_goes_back_to_its_rank() -> None:
    """Both ranks' receivers stop; the root comes back on its port, rank 1 on another one, restored
    (assignments, acknowledged positions); the producer, its assigned receiver gone, asks the
    root again and is sent to rank 1's new address, where it resends what rank 1 lacks."""
    old_root_sink, old_sink, new_root_sink, new_sink = ListSink(), ListSink(), ListSink(), ListSink()
    stop_old, stop_new = anyio.Event(), anyio.Event()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            old_root, old_rank1 = (
                SampleReceiver(old_root_sink, token=TOKEN),
                SampleReceiver(old_sink, token=TOKEN),
            )
            await tg.start(_run_receiver, old_root, stop_old)
            await tg.start(_run_receiver, old_rank1, stop_old)
            old_root.set_directory([old_root.address, old_rank1.address])
            await produce(old_root.address, "first", range(1))  # rank 0's producer
            async with AsyncProducer(
                old_root.address, name="sim", token=TOKEN, keep_acknowledged=20
            ) as producer:
                for seq in range(10):
                    await producer.send(tensors_for("sim", seq))
                await eventually(lambda: producer.acknowledged_seq == 9)
                assert producer.receiver_address == old_rank1.address
                assignments = old_root.directory_assignments
                stop_old.set()  # the trainer stops (a checkpoint of rank 1 holds up to seq 6)
                await eventually(lambda: not _listening(old_root.address[1]))
                new_root = SampleReceiver(
                    new_root_sink, token=TOKEN, port=old_root.address[1], directory_assignments=assignments
                )
                new_rank1 = SampleReceiver(new_sink, token=TOKEN, acknowledged={"sim": 6})
                await tg.start(_run_receiver, new_root, stop_new)
                await tg.start(_run_receiver, new_rank1, stop_new)
                new_root.set_directory([new_root.address, new_rank1.address])
                for seq in range(10, 15):
                    await producer.send(tensors_for("sim", seq))
                await producer.done()
                assert producer.receiver_address == new_rank1.address
            stop_new.set()
    assert assignments == {"first": 0, "sim": 1}
    assert old_sink.seqs("sim") == list(range(10))
    assert new_sink.seqs("sim") == list(range(7, 15))  # exactly what the restored rank 1 lacked
    assert new_root_sink.items == []
    assert new_root.directory_assignments == assignments


def test_directory_arguments_are_checked_with_clear_errors() -> None:
    directory = ProducerDirectory({"a": 2})
    with pytest.raises(ConfigurationError, match="non-empty sequence of"):
        directory.set_addresses([], own_index=0)
    with pytest.raises(ConfigurationError, match=r"addresses\[1\] must be a \(host, port\) pair"):
        directory.set_addresses([("h", 1), ("h", 0)], own_index=0)
    with pytest.raises(ConfigurationError, match=r"own_index must be in \[0, 1\], got 2"):
        directory.set_addresses([("h", 1), ("h", 2)], own_index=2)
    with pytest.raises(ConfigurationError, match=r"beyond the 2 given.*'a': 2.*as many ranks"):
        directory.set_addresses([("h", 1), ("h", 2)], own_index=0)
    directory.set_addresses([("h", 1), ("h", 2), ("h", 3)], own_index=0)
    with pytest.raises(ConfigurationError, match="called already"):
        directory.set_addresses([("h", 1)], own_index=0)
    with pytest.raises(ConfigurationError, match=r"directory_assignments\['b'\] must be a rank index"):
        ProducerDirectory({"b": -1})
    with pytest.raises(ConfigurationError, match="directory_assignments: a producer's name"):
        ProducerDirectory({"": 0})
    with pytest.raises(ConfigurationError, match=r"directory_assignments\['b'\] must be a rank index"):
        SampleReceiver(ListSink(), token=TOKEN, directory_assignments={"b": True})


async def test_set_directory_refuses_an_own_address_that_is_not_this_receiver() -> None:
    async with SampleReceiver(ListSink(), token=TOKEN) as root:
        host, port = root.address
        with pytest.raises(ConfigurationError, match=rf"addresses\[0\] is .* listens on port {port}"):
            root.set_directory([(host, port + 1 if port < 65535 else port - 1), (host, port)])
        root.set_directory([(host, port)])  # one address: every producer stays
        producer = await produce(root.address, "solo", range(2))
    assert producer.receiver_address == root.address


async def _fake_receiver(reply: Callable[[Hello, str], bytes], *, version: int = PROTOCOL_VERSION) -> Any:
    """A listener that challenges, reads a hello and sends ``reply(hello, nonce)``."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")

    async def serve(stream: anyio.abc.SocketStream) -> None:
        conn = FramedStream(stream, max_frame_bytes=4096)
        try:
            nonce = new_nonce()
            await conn.send(encode_frame(Challenge(version, nonce)))
            hello = await conn.receive()
            if isinstance(hello, Hello):
                await conn.send(reply(hello, nonce))
            await anyio.sleep(1)
        finally:
            await conn.aclose()

    return listener, serve


async def test_a_redirect_without_a_valid_proof_fails_the_producer() -> None:
    def forged(hello: Hello, nonce: str) -> bytes:
        proof = redirect_proof(b"not the token", receiver_nonce=nonce, hello=hello, host="127.0.0.1", port=9)
        return encode_frame(Redirect("127.0.0.1", 9, proof))

    listener, serve = await _fake_receiver(forged)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    with anyio.fail_after(20):
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, serve)
            with pytest.raises(HandshakeError, match="redirected it without proving the shared token"):
                await produce(("127.0.0.1", port), "sim", range(1))
            tg.cancel_scope.cancel()


async def test_peers_of_another_protocol_version_are_refused_with_both_versions_named() -> None:
    listener, serve = await _fake_receiver(lambda hello, nonce: b"", version=1)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    with anyio.fail_after(20):
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, serve)
            with pytest.raises(
                HandshakeError, match="speaks streaming protocol version 1, this producer speaks version 2"
            ):
                await produce(("127.0.0.1", port), "sim", range(1))
            tg.cancel_scope.cancel()
        # A version-1 producer's hello to this receiver.
        async with SampleReceiver(ListSink(), token=TOKEN) as receiver:
            conn = FramedStream(await anyio.connect_tcp(*receiver.address), max_frame_bytes=4096)
            challenge = await conn.receive()
            assert isinstance(challenge, Challenge)
            assert challenge.protocol_version == PROTOCOL_VERSION == 2
            hello = Hello(1, "old", new_nonce(), "")
            hello = attrs.evolve(
                hello, proof=producer_proof(TOKEN, receiver_nonce=challenge.nonce, hello=hello)
            )
            await conn.send(encode_frame(hello))
            reply = await conn.receive()
            await conn.aclose()
    assert reply == Refuse(
        "producer 'old' speaks streaming protocol version 1, the receiver speaks version 2"
    )


def _start_producer(port: int, name: str, count: int, pace: float = 0.005) -> Any:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LAMPLOOP_STREAM_TOKEN": TOKEN.decode()}
    script = str(ROOT / "tests" / "workers" / "stream_producer.py")
    argv = [sys.executable, script, str(port), name, str(count), str(pace)]
    return warm_start.popen(argv, env=env, text=True)


async def test_producer_processes_killed_and_restarted_go_back_to_their_rank_and_deliver_each_seq_once() -> (
    None
):
    count = 300
    sinks = [ListSink(), ListSink()]
    processes: list[Any] = []
    try:
        with anyio.fail_after(50):
            async with (
                SampleReceiver(sinks[0], token=TOKEN) as root,
                SampleReceiver(sinks[1], token=TOKEN) as rank1,
            ):
                root.set_directory([root.address, rank1.address])
                port = root.address[1]
                # 20 ms a sample (6 s in all): the kill below lands mid-stream also when this
                # test's loop runs late on a loaded machine (at 5 ms, "a" once had sent all 300).
                processes += [_start_producer(port, name, count, pace=0.02) for name in ("a", "b")]
                await eventually(lambda: len(sinks[0].items) >= 20 and len(sinks[1].items) >= 20, within=30)
                assignments = root.directory_assignments
                assert sorted(assignments.values()) == [0, 1]
                killed = processes.pop(0)
                killed.send_signal(signal.SIGKILL)  # "a" dies mid-stream, and starts again from 0
                killed.wait(timeout=10)
                assert len(sinks[assignments["a"]].seqs("a")) < count  # mid-stream indeed
                processes.append(_start_producer(port, "a", count))

                def complete() -> bool:
                    return all(len(sinks[assignments[name]].seqs(name)) == count for name in ("a", "b"))

                await eventually(complete, within=40)
                for process in processes:
                    assert await anyio.to_thread.run_sync(process.wait, 20) == 0
                final = root.directory_assignments
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    assert final == assignments
    for name, index in assignments.items():
        assert sinks[index].seqs(name) == list(range(count))  # every seq once, in order
        assert name not in sinks[1 - index].producers()


def test_a_producer_taken_before_the_addresses_stays_here_whoever_hands_them_in() -> None:
    """With the receiver on its own thread, a handshake may take a producer between the owner's
    look at whom it served and its handing in the addresses: the directory remembers it itself."""
    directory = ProducerDirectory(own_index=1)
    assert directory.assign("early") is None  # taken here: the addresses are not known yet
    directory.set_addresses([("127.0.0.1", 1001), ("127.0.0.1", 1002)], own_index=1, served=())
    assert directory.assign("early") is None  # still served here, not redirected
    assert directory.assignments["early"] == 1
    assert directory.assign("later") == ("127.0.0.1", 1001)  # round-robin: rank 0 has none yet
