"""What the root says when a follower fails itself: its exception, type and message, whole enough.

docs/reliability.md: an error that one rank finds alone "is still raised on the others at
once as ``PeerLostError(rank=that rank, how="aborted")``, with its message".  Two things
kept that message from the user:

- the reason a follower sends was cut at 1,000 characters, so a long message (a DataLoader
  worker's re-raised traceback) lost its end, the exception the user's code raised; now a
  long reason keeps its start and its end, with a marker saying how much was left out;
- a follower that failed before joining the root (its ``optimizer_factory`` raised) could
  tell the root nothing: ``fit(world_size=2)``'s root named it only as "exited with status
  1"; now the follower joins and leaves the channel with its error, as an aborted peer does.

The ``fit`` runs are real processes (``tests/workers/follower_failure.py``: fit starts rank 1
itself); the channel tests run both ends over real sockets on 127.0.0.1 or the in-process
channel.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from support import WORKERS
from workers import follower_failure
from workers.rank import worker_env
from workers.records import load_record

from lamploop.control import Rendezvous, TcpControlFollower, TcpControlRoot, Train, local_control
from lamploop.errors import PeerLostError
from lamploop.modelspec import ModelSpec, TensorSpec

RUN_WITHIN_S = 240.0
"""A bound on one two-rank fit run (two Python processes importing torch, on a loaded machine)."""

SPEC = ModelSpec((TensorSpec("fc.weight", (2, 3), "float32"),))
LAST_LINE = "ValueError: the user's own message, which must reach the root"
LONG_MESSAGE = (
    "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
    + "".join(
        f'  File "/data/set.py", line {n}, in level_{n}\n    return level_{n + 1}(index)\n' for n in range(80)
    )
    + LAST_LINE
    + "\n"
)


def _fit(tmp_path: Path, mode: str) -> dict[int, Any]:
    """Run the two-rank fit whose rank 1 fails as ``mode`` says; what each rank raised."""
    out = tmp_path / mode
    out.mkdir()
    command = [sys.executable, str(WORKERS / "follower_failure.py"), str(out), mode]
    done = subprocess.run(
        command,
        env=worker_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_WITHIN_S,
    )
    assert done.returncode == 1, done.stderr[-4000:]
    return {rank: load_record(out / f"rank{rank}") for rank in (0, 1)}


@pytest.mark.timeout(300)
def test_a_follower_whose_optimizer_factory_raises_is_named_by_its_error_on_the_root(tmp_path: Path) -> None:
    raised = _fit(tmp_path, "optimizer")
    assert raised[1]["type"] == "ValueError", raised[1]
    assert raised[1]["message"] == follower_failure.OPTIMIZER_MESSAGE
    root = raised[0]
    assert root["type"] == "PeerLostError", root
    assert (root["rank"], root["how"]) == (1, "aborted"), root
    assert (
        f"the follower of rank 1 failed: ValueError: {follower_failure.OPTIMIZER_MESSAGE}" in root["message"]
    )
    assert "exited with status" not in root["message"], root["message"]


@pytest.mark.timeout(300)
def test_a_followers_long_dataloader_traceback_keeps_its_last_line_on_the_root(tmp_path: Path) -> None:
    raised = _fit(tmp_path, "dataloader")
    own = raised[1]["message"]
    assert len(own) > follower_failure.TRACEBACK_FLOOR, own
    assert own.startswith("Caught ValueError in DataLoader worker process 0."), own[:200]
    last_line = f"ValueError: {follower_failure.DATALOADER_MESSAGE}"
    assert own.rstrip().endswith(last_line), own[-300:]
    root = raised[0]
    assert (root["type"], root["rank"], root["how"]) == ("PeerLostError", 1, "aborted"), root
    message = root["message"]
    # The start (who failed, and how the error began) and the end (what the user's code raised).
    assert (
        "the follower of rank 1 failed: ValueError: Caught ValueError in DataLoader worker process 0."
        in message
    )
    assert message.rstrip().endswith(last_line), message[-300:]
    assert "characters left out ...]" in message, message
    assert len(message) < len(own) / 2, len(message)


def _assert_long_reason_kept(error: PeerLostError) -> None:
    message = str(error)
    assert error.rank == 1, message
    assert error.how == "aborted", message
    assert (
        "the follower of rank 1 failed: ValueError: Caught ValueError in DataLoader worker process 0."
        in message
    )
    assert message.rstrip().endswith(LAST_LINE), message[-300:]
    assert "characters left out ...]" in message, message
    assert len(message) < 2500, len(message)


async def _fail_at_first_command(commands: Any) -> None:
    async for _ in commands:
        raise ValueError(LONG_MESSAGE)


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_long_reason_over_tcp_keeps_its_start_and_its_last_line() -> None:
    assert len(LONG_MESSAGE) > 4000
    listening = anyio.Event()
    ports: list[int] = []
    caught: list[BaseException] = []

    async def root() -> None:
        try:
            async with TcpControlRoot(host="127.0.0.1", nranks=2, token="t", model_spec=SPEC) as end:
                ports.append(end.address[1])
                listening.set()
                await end.on_rendezvous_ready(Rendezvous("127.0.0.1", 29500))
                await end.broadcast(Train(epoch=0, lr_factor=1.0))
                await anyio.sleep(20)  # ended by the follower's abort
        except PeerLostError as exc:
            caught.append(exc)

    async def fail() -> None:
        async with TcpControlFollower(
            host="127.0.0.1", port=ports[0], rank=1, nranks=2, token="t", model_spec=SPEC
        ) as end:
            _, commands = await end.join()
            await _fail_at_first_command(commands)

    async def follower() -> None:
        await listening.wait()
        with pytest.raises(ValueError, match="Caught ValueError"):
            await fail()

    with anyio.fail_after(15):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(root)
            tasks.start_soon(follower)
    assert len(caught) == 1, "the root did not raise PeerLostError within 15 s"
    assert isinstance(caught[0], PeerLostError)
    _assert_long_reason_kept(caught[0])


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_long_reason_in_process_keeps_its_start_and_its_last_line() -> None:
    root, (rank1,) = local_control(2, join_timeout=10.0)
    caught: list[BaseException] = []
    left = anyio.Event()

    async def fail() -> None:
        async with rank1:
            _, commands = await rank1.join()
            await _fail_at_first_command(commands)

    async def follower() -> None:
        with pytest.raises(ValueError, match="Caught ValueError"):
            await fail()
        left.set()

    with anyio.fail_after(15):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(follower)
            async with root:
                await root.on_rendezvous_ready(Rendezvous("127.0.0.1", 29500))
                await root.broadcast(Train(epoch=0, lr_factor=1.0))
                await left.wait()  # the follower read Train, failed and left the channel
                try:
                    await root.broadcast(Train(epoch=1, lr_factor=1.0))
                except PeerLostError as exc:
                    caught.append(exc)
    assert len(caught) == 1, "the root's next broadcast did not raise PeerLostError"
    assert isinstance(caught[0], PeerLostError)
    _assert_long_reason_kept(caught[0])
