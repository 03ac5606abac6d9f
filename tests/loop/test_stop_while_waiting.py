"""A stop request reaches a run that waits for samples (DESIGN.md section 8, issue 21).

A training pass over ``buffer_batches`` with no producer yet (or a stalled one) waits for its
next batch, where no step boundary comes.  A stop request (SIGTERM, SIGINT, a program's
``StopRequest``) must still end it as a graceful stop does: within about a second, at the
current step boundary, with the checkpoint written there, on every rank.  Here:

- real processes (``tests/workers/stop_waiting.py``): ``fit`` over empty FIFO buffers on 1
  and 2 ranks, and over buffers whose producer stalled after 3 batches on 2 ranks, SIGTERM
  to rank 0 once every rank waits: exit status 143 and the checkpoint of the boundary where
  they waited (the follower hears of the stop through the control channel);
- in-process: the drivers' programmatic ``stop=``, while the pass waits for its first batch
  or after the batches a producer put before it stalled;
- the control channel carries a stop request from any rank to every rank (every channel
  implementation), :func:`~lamploop.stopping.share_stop_requests` relays it to each rank's
  ``StopRequest``, and a request relayed from another rank does not make this rank's own
  first signal a second one (which would stop at once, without a checkpoint).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from support import WORKERS
from workers import rank as worker

import lamploop
from lamploop.checkpoint import load_checkpoint
from lamploop.control import (
    ControlFollower,
    ControlRoot,
    Rendezvous,
    Stop,
    TcpControlFollower,
    TcpControlRoot,
    local_control,
)
from lamploop.control.wire import HEADER_BYTES, FrameDecoder, Interrupt, encode_frame
from lamploop.distributed.boundaries import StopRequest
from lamploop.errors import FrameError, TrainingInterrupted
from lamploop.loop.boundary import EpochPosition
from lamploop.loop.stop_aware import (
    OWN_STREAM_GRACE_S,
    StopAwareOwnStream,
    StopAwareStream,
    ended_by_request,
    stop_aware_batches,
    watching,
)
from lamploop.modelspec import ModelSpec, TensorSpec
from lamploop.stopping import share_stop_requests, stop_on_signals
from lamploop.streaming import FifoBuffer, Sample, buffer_batches

STOPPED_WITHIN_S = 5.0
"""From the signal to the run's TrainingInterrupted (the stop itself takes well under a second)."""
EXITED_WITHIN_S = 15.0
"""From the signal to the process's exit: rank 0 also waits for its follower to close, then Python
and torch shut down, which takes seconds on the loaded 2-core machine."""
WORKER = WORKERS / "stop_waiting.py"


# --- real processes, real SIGTERM ---------------------------------------------------------------


def _stop_while_waiting(tmp_path: Path, nranks: int, mode: str) -> tuple[float, str]:
    """Start the trainer, SIGTERM rank 0 once every rank waits; seconds to the stop, and the log."""
    with worker.Processes(tmp_path) as procs:
        root = procs.start("root", [sys.executable, str(WORKER), str(tmp_path), str(nranks), mode])
        for rank in range(nranks):
            procs.wait_for_file(tmp_path / f"waiting-{rank}.json", 120, alive=["root"])
        time.sleep(0.5)  # waiting for a batch that does not come
        signalled = time.time()
        root.send_signal(signal.SIGTERM)
        assert procs.wait("root", EXITED_WITHIN_S) == 143, procs.logs()
        log = procs.log("root")
    stopped_at = float(log.split("rank 0 at ")[1].split(":")[0])
    return stopped_at - signalled, log


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("nranks", "mode", "steps", "checkpoint"),
    [
        (1, "empty", 0, "epoch-000000"),
        (2, "empty", 0, "epoch-000000"),
        (2, "stalled", 3, "epoch-000000-step-000003"),
    ],
    ids=["1-rank-no-producer", "2-ranks-no-producer", "2-ranks-stalled-producer"],
)
def test_sigterm_stops_a_run_that_waits_for_samples(
    tmp_path: Path, nranks: int, mode: str, steps: int, checkpoint: str
) -> None:
    took, log = _stop_while_waiting(tmp_path, nranks, mode)
    assert f"stopped by SIGTERM at epoch 0 after step {steps}; a checkpoint was written there" in log, log
    assert took < STOPPED_WITHIN_S, log
    # The boundary where every rank waited (no producer: the start of epoch 0), or after the
    # step of the batches it held (a stalled producer): its checkpoint is the latest.
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == checkpoint
    saved = load_checkpoint(tmp_path / "checkpoints")
    assert saved.state.loop_state.epoch == 0
    assert (saved.position.steps_done if saved.position is not None else 0) == steps


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_follower_killed_while_every_rank_waits_for_samples_ends_the_root(tmp_path: Path) -> None:
    """SIGKILL of rank 1 while both ranks wait for their first batch: the root's stream ends on
    the run's abort, and the root fails naming rank 1 (it went on waiting for the buffer before:
    its worker thread never reached a collective that would notice)."""
    with worker.Processes(tmp_path) as procs:
        root = procs.start("root", [sys.executable, str(WORKER), str(tmp_path), "2", "empty"])
        for rank in range(2):
            procs.wait_for_file(tmp_path / f"waiting-{rank}.json", 120, alive=["root"])
        time.sleep(0.5)
        follower = json.loads((tmp_path / "waiting-1.json").read_text())["pid"]
        killed = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        status = procs.wait("root", EXITED_WITHIN_S)
        took = time.monotonic() - killed
        log = procs.log("root")
    assert status == 1, log
    assert "rank 1" in log, log
    assert took < EXITED_WITHIN_S, log
    assert root.poll() is not None


# --- in-process, the drivers' programmatic stop= --------------------------------------------------


def _sample(seq: int) -> Sample:
    x = torch.randn(4, generator=torch.Generator().manual_seed(seq))
    return Sample("sim", seq, {"x": x, "y": (x.sum() > 0).long()})


class _Marked:
    """A buffer's stream that sets ``waiting`` when it asks for a batch beyond the ``available`` ones."""

    def __init__(self, inner: Any, available: int, waiting: threading.Event) -> None:
        self._inner, self._available, self._waiting = inner, available, waiting

    @property
    def source_ended(self) -> bool:
        return bool(self._inner.source_ended)

    async def __aiter__(self) -> AsyncIterator[Any]:
        drawn = 0
        if self._available == 0:  # asked for its first batch: one too many
            self._waiting.set()
        async for batch in self._inner:
            drawn += 1
            yield batch
            if drawn == self._available:
                self._waiting.set()
        # (the stream ends only if the buffer is closed, which these tests never do)


def _marked(buffer: FifoBuffer, available: int, waiting: threading.Event) -> Any:
    batches = buffer_batches(buffer, batch_size=4, batches_per_epoch=100)
    return lambda context: _Marked(batches(context), available, waiting)


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("put_batches", [0, 3], ids=["no-producer-yet", "stalled-producer"])
async def test_a_programmatic_stop_ends_the_wait_at_the_step_boundary(put_batches: int) -> None:
    buffer = FifoBuffer(capacity=64, watermark=1, seed=0)
    for seq in range(put_batches * 4 + 1):  # and one sample: too few for the next batch
        await buffer.put(_sample(seq))
    stop = StopRequest()
    positions: list[EpochPosition] = []
    requested: list[float] = []
    waiting = threading.Event()
    batches = stop_aware_batches(_marked(buffer, put_batches, waiting), stop)

    async def save_position(_data: Any, _schedule: Any, position: EpochPosition, _rngs: Any) -> None:
        positions.append(position)

    def request_once_waiting() -> None:
        waiting.wait(30)
        time.sleep(0.3)
        requested.append(time.monotonic())
        stop.request("a program")

    requester = threading.Thread(target=request_once_waiting)
    requester.start()
    try:
        with pytest.raises(TrainingInterrupted) as info, anyio.fail_after(30):
            await lamploop.drive_distributed_training(
                nranks=1,
                device="cpu",
                control=None,
                model=lamploop.SupervisedModel(torch.nn.Linear(4, 2), lamploop.cross_entropy_loss),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                train_batches=batches,
                validation_batches=None,
                max_epochs=5,
                checkpoint_position=save_position,
                stop=stop,
            )
        took = time.monotonic() - requested[0]
    finally:
        requester.join(30)
    assert took < 2.0
    assert info.value.reason == "a program"
    assert (info.value.epoch, info.value.steps_done) == (0, put_batches)
    assert [(p.epoch, p.steps_done, p.example_counts) for p in positions] == [
        (0, put_batches, (put_batches * 4,))
    ]
    assert buffer.fill == 1  # the wait that a stop ended took no sample out of the buffer


class _OwnStream:
    """An async stream of one's own (no ``EndingBatchStream``): ``ready`` batches, each after
    ``every_s``, then a wait for ever (a producer that never comes); ``waiting`` is set then."""

    def __init__(self, ready: int, every_s: float, waiting: threading.Event) -> None:
        self.ready, self.every_s, self.waiting = ready, every_s, waiting
        self.cancelled = False

    async def __aiter__(self) -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for seq in range(self.ready):
            await anyio.sleep(self.every_s)
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(seq))
            yield x, (x.sum(dim=1) > 0).long()
        self.waiting.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            raise


def _drive(train: Any, validation: Any, stop: StopRequest, positions: list[EpochPosition]) -> Any:
    async def save_position(_data: Any, _schedule: Any, position: EpochPosition, _rngs: Any) -> None:
        positions.append(position)

    return lamploop.drive_distributed_training(
        nranks=1,
        device="cpu",
        control=None,
        model=lamploop.SupervisedModel(torch.nn.Linear(4, 2), lamploop.cross_entropy_loss),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=train,
        validation_batches=validation,
        max_epochs=3,
        checkpoint_position=save_position,
        stop=stop,
    )


def _request_once(event: threading.Event, stop: StopRequest, requested: list[float], after_s: float) -> None:
    event.wait(30)
    time.sleep(after_s)
    requested.append(time.monotonic())
    stop.request("a program")


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_stop_ends_the_wait_of_an_own_stream_that_stalls_after_the_grace() -> None:
    """DESIGN.md section 8: a stop request ends a run "also when no step is in progress because
    the run waits for data", for an async stream of one's own too (found by
    tests/test_acceptance_design_contract_r2.py: only EndingBatchStreams were stop-aware).  The
    stream yields 3 batches, then waits for ever: the wait is cancelled ``OWN_STREAM_GRACE_S``
    after the request and the run stops at the boundary after the 3 steps."""
    stop, positions, requested = StopRequest(), [], []
    waiting = threading.Event()
    stream = _OwnStream(3, 0.0, waiting)
    requester = threading.Thread(target=_request_once, args=(waiting, stop, requested, 0.3))
    requester.start()
    try:
        with pytest.raises(TrainingInterrupted) as info, anyio.fail_after(30):
            await _drive(stop_aware_batches(lambda _context: stream, stop), None, stop, positions)
        took = time.monotonic() - requested[0]
    finally:
        requester.join(30)
    assert OWN_STREAM_GRACE_S <= took < OWN_STREAM_GRACE_S + 2.0
    assert stream.cancelled  # the stream was cancelled where it waited
    assert (info.value.epoch, info.value.steps_done) == (0, 3)
    assert [(p.epoch, p.steps_done) for p in positions] == [(0, 3)]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_an_own_validation_stream_that_yields_steadily_runs_to_its_end_after_a_stop() -> None:
    """The grace leaves a stream alone that keeps yielding: a stop during a validation pass whose
    batches come every 0.3 s (each wait shorter than the grace) lets the pass end whole, so the
    epoch ends with its validation loss and the run stops there (docs/reliability.md, "during a
    validation pass")."""
    stop, positions, requested = StopRequest(), [], []
    validating = threading.Event()

    train = lamploop.tensor_batches(torch.randn(8, 4), torch.randint(0, 2, (8,)), batch_size=4)

    class _Validation:
        def __init__(self) -> None:
            self.drawn = 0

        async def __aiter__(self) -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
            for seq in range(6):
                if seq == 1:
                    validating.set()
                await anyio.sleep(0.3)
                self.drawn += 1
                x = torch.randn(4, 4, generator=torch.Generator().manual_seed(100 + seq))
                yield x, (x.sum(dim=1) > 0).long()

    validation = _Validation()
    requester = threading.Thread(target=_request_once, args=(validating, stop, requested, 0.1))
    requester.start()
    own = stop_aware_batches(lambda _context: validation, stop)
    try:
        with pytest.raises(TrainingInterrupted, match="at the epoch's end") as info, anyio.fail_after(30):
            await _drive(stop_aware_batches(train, stop), own, stop, positions)
    finally:
        requester.join(30)
    assert validation.drawn == 6  # the whole pass
    assert (info.value.epoch, info.value.steps_done) == (1, 0)


@pytest.mark.anyio
async def test_a_stream_wrapped_twice_is_one_wrapper_that_ends_on_either_request() -> None:
    """``fit`` wraps with its stop request and each replica with its abort: one wrapper, one
    watcher, ending on either."""
    first, second = StopRequest(), StopRequest()
    waiting = threading.Event()
    factory = stop_aware_batches(stop_aware_batches(lambda _c: _OwnStream(0, 0.0, waiting), first), second)
    stream = factory(lamploop.BatchContext(0))
    assert isinstance(stream, StopAwareOwnStream)
    assert not isinstance(stream._inner, StopAwareOwnStream)
    second.request("the run's abort")
    began = time.monotonic()
    with anyio.fail_after(10):
        async with watching(stream):
            assert [batch async for batch in stream] == []
    assert ended_by_request(stream)
    assert OWN_STREAM_GRACE_S <= time.monotonic() - began < OWN_STREAM_GRACE_S + 2.0


@pytest.mark.anyio
async def test_a_watched_pass_raises_its_streams_error_as_it_is() -> None:
    """An error in a watched stream reaches the caller as it is, not in an exception group."""
    stop = StopRequest()

    async def broken(_context: lamploop.BatchContext) -> AsyncIterator[Any]:
        msg = "a producer's bad sample"
        raise ValueError(msg)
        yield  # an async generator

    stream = stop_aware_batches(lambda context: broken(context), stop)(lamploop.BatchContext(0))
    assert isinstance(stream, StopAwareOwnStream)
    with pytest.raises(ValueError, match="a producer's bad sample"):
        async with watching(stream):
            await anext(aiter(stream))


@pytest.mark.anyio
@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
async def test_a_watched_pass_raises_a_base_exception_as_it_is(kind: type[BaseException]) -> None:
    """A ``KeyboardInterrupt`` or ``SystemExit`` in a watched stream reaches the caller as it is:
    a follower names it ("the follower of rank 1 failed: SystemExit"), not an exception group
    (tests/test_acceptance_no_hangs.py found that in CI)."""
    stop = StopRequest()

    async def interrupted(_context: lamploop.BatchContext) -> AsyncIterator[Any]:
        raise kind()
        yield  # an async generator

    factory = stop_aware_batches(lambda context: interrupted(context), stop)
    stream = factory(lamploop.BatchContext(0))
    with pytest.raises(kind):
        async with watching(stream):
            await anext(aiter(stream))
    with pytest.raises(kind):  # iterated outside a pass: the same
        await anext(aiter(factory(lamploop.BatchContext(0))))


@pytest.mark.anyio
async def test_lamploops_in_memory_streams_are_not_wrapped_and_ending_ones_are() -> None:
    stop = StopRequest()
    plain = lamploop.tensor_batches(torch.zeros(4, 2), torch.zeros(4), batch_size=2)
    assert stop_aware_batches(plain, stop) is not plain  # a factory...
    stream = stop_aware_batches(plain, stop)(lamploop.BatchContext(0))
    assert not isinstance(stream, StopAwareStream | StopAwareOwnStream)  # tensor_batches' own stream
    made = lamploop.iterable_batches(lambda _c: [(torch.zeros(2, 2), torch.zeros(2))])
    assert not isinstance(stop_aware_batches(made, stop)(lamploop.BatchContext(0)), StopAwareOwnStream)
    buffer = FifoBuffer(capacity=4, watermark=1, seed=0)
    wrapped = stop_aware_batches(buffer_batches(buffer, batch_size=2, batches_per_epoch=1), stop)
    assert isinstance(wrapped(lamploop.BatchContext(0)), StopAwareStream)


@pytest.mark.anyio
async def test_a_wrapped_stream_passes_on_its_errors_and_its_end() -> None:
    buffer = FifoBuffer(capacity=4, watermark=1, seed=0)
    stop = StopRequest()
    await buffer.put(_sample(0))
    await buffer.put(_sample(1))
    buffer.close()
    wrapped = stop_aware_batches(buffer_batches(buffer, batch_size=2, batches_per_epoch=5), stop)
    stream = wrapped(lamploop.BatchContext(0))
    assert [len(y) async for _, y in stream] == [2]
    assert isinstance(stream, StopAwareStream)
    assert stream.source_ended

    def broken(samples: Any) -> Any:
        msg = "a bad sample"
        raise ValueError(msg)

    other = FifoBuffer(capacity=4, watermark=1, seed=0)
    await other.put(_sample(0))
    failing = stop_aware_batches(
        buffer_batches(other, batch_size=1, batches_per_epoch=1, collate=broken), stop
    )
    with pytest.raises(ValueError, match="a bad sample"):  # as it is: not wrapped in an exception group
        await anext(aiter(failing(lamploop.BatchContext(0))))


# --- the control channel carries stop requests between ranks ------------------------------------

TOKEN = "stop-token"
SPEC = ModelSpec((TensorSpec("w", (2, 2), "float32"),))
RENDEZVOUS = Rendezvous(host="127.0.0.1", port=29500)


@asynccontextmanager
async def _local(nranks: int) -> AsyncIterator[tuple[ControlRoot, list[ControlFollower]]]:
    root, followers = local_control(nranks, join_timeout=5.0)
    async with root:
        yield root, list(followers)


@asynccontextmanager
async def _tcp(nranks: int) -> AsyncIterator[tuple[ControlRoot, list[ControlFollower]]]:
    timing = {"heartbeat_interval": 0.1, "heartbeat_timeout": 2.0}
    async with TcpControlRoot(
        nranks=nranks, token=TOKEN, model_spec=SPEC, join_timeout=5.0, **timing
    ) as root:
        host, port = root.address
        yield (
            root,
            [
                TcpControlFollower(
                    host=host, port=port, rank=r, nranks=nranks, token=TOKEN, model_spec=SPEC, **timing
                )
                for r in range(1, nranks)
            ],
        )


def test_an_interrupt_travels_as_a_strict_frame() -> None:
    frame = encode_frame(Interrupt("SIGTERM"))
    assert FrameDecoder().feed(frame) == [Interrupt("SIGTERM")]
    assert frame[HEADER_BYTES:] == b'{"reason":"SIGTERM","type":"interrupt"}'
    with pytest.raises(FrameError, match="malformed 'interrupt' message"):
        FrameDecoder().feed(encode_frame(Interrupt("x")).replace(b'"x"', b" 1 "))  # a number


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("channel", [_local, _tcp], ids=["local", "tcp"])
@pytest.mark.parametrize("asker", [0, 2], ids=["root-asks", "follower-asks"])
async def test_a_stop_request_from_any_rank_reaches_every_rank(channel: Any, asker: int) -> None:
    heard: dict[int, str] = {}

    async def follow(end: Any) -> None:
        async with end:
            _, commands = await end.join()
            if end.rank == asker:
                await end.request_stop("SIGTERM")
                await end.request_stop("SIGINT")  # only the first request counts
            heard[end.rank] = await end.wait_for_stop_request()
            assert [c async for c in commands] == [Stop("stopped")]

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, channel(3) as (root, ends):
            for end in ends:
                tg.start_soon(follow, end)
            await root.on_rendezvous_ready(RENDEZVOUS)
            if asker == 0:
                await root.request_stop("SIGTERM")
            heard[0] = await root.wait_for_stop_request()
            while len(heard) < 3:  # noqa: ASYNC110
                await anyio.sleep(0.01)
            await root.broadcast(Stop("stopped"))
            await root.request_stop("after Stop: nothing is sent")
    assert heard == {0: "SIGTERM", 1: "SIGTERM", 2: "SIGTERM"}


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_follower_that_joins_after_the_request_hears_it() -> None:
    with anyio.fail_after(10):
        async with _tcp(2) as (root, [end]), end:
            await root.request_stop("SIGTERM")  # before anyone joined
            async with anyio.create_task_group() as tg:
                tg.start_soon(root.on_rendezvous_ready, RENDEZVOUS)
                await end.join()
            assert await end.wait_for_stop_request() == "SIGTERM"
            await root.broadcast(Stop("stopped"))


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_share_stop_requests_sets_every_ranks_request() -> None:
    root, followers = local_control(3, join_timeout=5.0)
    stops = [StopRequest() for _ in range(3)]

    async def follow(end: Any, stop: StopRequest) -> None:
        async with end, share_stop_requests(stop, end):
            _, commands = await end.join()
            async for _ in commands:
                pass

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for end, stop in zip(followers, stops[1:], strict=True):
                tg.start_soon(follow, end, stop)
            async with root, share_stop_requests(stops[0], root):
                await root.on_rendezvous_ready(RENDEZVOUS)
                stops[2].request("SIGTERM")  # a signal on rank 2
                while not all(stop.is_set() for stop in stops):  # noqa: ASYNC110  (thread-safe flags)
                    await anyio.sleep(0.01)
                await root.broadcast(Stop("stopped"))
    assert [stop.reason for stop in stops] == ["SIGTERM"] * 3


def test_a_request_relayed_from_another_rank_does_not_make_the_first_signal_a_second() -> None:
    async def main() -> tuple[bool, bool]:
        stop = StopRequest()
        stop.request("SIGTERM")  # relayed from another rank before this rank's own SIGTERM
        async with stop_on_signals(stop) as at_once:
            await anyio.sleep(0.2)  # the handler is in place
            os.kill(os.getpid(), signal.SIGTERM)  # this rank's own first signal
            await anyio.sleep(0.5)
            first = at_once.cancel_called
            os.kill(os.getpid(), signal.SIGTERM)  # its second: at once
            await anyio.sleep(5)
        return first, at_once.cancelled_caught

    first, second = anyio.run(main)
    assert not first
    assert second
