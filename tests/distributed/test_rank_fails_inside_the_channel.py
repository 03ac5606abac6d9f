"""A rank whose run fails while its channel stays open holds nobody (DESIGN.md section 8).

Every rank a task of this process, the root's ``async with`` around both (as a user writes it):
the failing rank's stream raises in the middle of epoch 1, while its peer waits in that step's
collective.  Before, the peer waited there until ``collective_timeout`` (30 minutes by
default): the failed rank left no connection whose end the collective would see, and it left
the channel only after its peer ended.  Now the failed rank raises its own error and the peer
a :class:`PeerLostError` naming it, within seconds; over local and TCP control.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

import lamploop
from lamploop.control import TcpControlFollower, TcpControlRoot
from lamploop.errors import PeerLostError

pytestmark = pytest.mark.anyio

BOUND_S = 20.0  # a loaded machine; the hang this guards against is 1800 s
TOKEN = "rank-fails-inside-the-channel"


class Boom(Exception):
    """The user's stream fails."""


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _loss(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    return ((output - target) ** 2).sum(), int(target.shape[0])


def _batches(failing: bool) -> Any:
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def factory(context: lamploop.BatchContext) -> AsyncIterator[Any]:
        async def stream() -> AsyncIterator[Any]:
            for index in range(4):
                if failing and context.epoch == 1 and index == 2:
                    raise Boom(f"the stream of the failing rank, epoch {context.epoch}")
                yield x[2 * index : 2 * index + 2], y[2 * index : 2 * index + 2]
                await anyio.lowlevel.checkpoint()

        return stream()

    return factory


async def _pair(kind: str, failing_rank: int) -> tuple[BaseException | None, BaseException | None, float]:
    outcome: list[BaseException | None] = [None, None]
    spec = lamploop.model_spec(_module())

    async def root_run(control: Any) -> None:
        try:
            await lamploop.drive_distributed_training(
                nranks=2,
                device="cpu",
                control=control,
                model=lamploop.SupervisedModel(_module(), _loss),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                train_batches=_batches(failing_rank == 0),
                validation_batches=None,
                max_epochs=3,
                accumulate_gradient_over_n_batches=2,
            )
        except Exception as exc:
            outcome[0] = exc

    async def follower_run(control: Any) -> None:
        try:
            await lamploop.follow_distributed_training(
                rank=1,
                nranks=2,
                device="cpu",
                control=control,
                model=lamploop.SupervisedModel(_module(), _loss),
                train_batches=_batches(failing_rank == 1),
                validation_batches=None,
                accumulate_gradient_over_n_batches=2,
            )
        except Exception as exc:
            outcome[1] = exc

    began = time.monotonic()
    with anyio.fail_after(BOUND_S):
        if kind == "local":
            root, (follower,) = lamploop.local_control(2, join_timeout=30)
            async with root, follower, anyio.create_task_group() as group:
                group.start_soon(follower_run, follower)
                group.start_soon(root_run, root)
        else:
            # Over TCP a lost peer cancels the block inside the channel's ``async with``, whose
            # exit raises the PeerLostError: each rank's error is its drive's, else its channel's.
            try:
                async with TcpControlRoot(port=0, nranks=2, token=TOKEN, model_spec=spec) as root:
                    host, port = root.address[:2]

                    async def tcp_follower() -> None:
                        try:
                            async with TcpControlFollower(
                                host=host, port=port, rank=1, nranks=2, token=TOKEN, model_spec=spec
                            ) as follower:
                                await follower_run(follower)
                        except Exception as exc:
                            outcome[1] = outcome[1] or exc

                    async with anyio.create_task_group() as group:
                        group.start_soon(tcp_follower)
                        group.start_soon(root_run, root)
            except Exception as exc:
                outcome[0] = outcome[0] or exc
    return outcome[0], outcome[1], time.monotonic() - began


@pytest.mark.parametrize("kind", ["local", "tcp"])
@pytest.mark.parametrize("failing_rank", [0, 1])
async def test_the_failed_rank_raises_its_error_and_its_peer_names_it(kind: str, failing_rank: int) -> None:
    root_error, follower_error, took = await _pair(kind, failing_rank)
    errors = [root_error, follower_error]
    own, peer = errors[failing_rank], errors[1 - failing_rank]
    assert isinstance(own, Boom), repr(own)
    assert isinstance(peer, PeerLostError), repr(peer)
    assert peer.rank == failing_rank, repr(peer)
    assert "Boom" in str(peer) or "the stream of the failing rank" in str(peer), str(peer)
    assert took < BOUND_S


def test_a_local_channel_never_entered_leaves_no_stream_open() -> None:
    """A driver that refuses its arguments before entering ``local_control``'s ends: collecting
    them closes their command streams (each used to warn that it was left open, and with
    warnings as errors a later, unrelated test failed)."""
    import gc
    import warnings

    root, followers = lamploop.local_control(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del root, followers
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


async def test_a_follower_joining_after_the_roots_abort_hears_its_reason() -> None:
    """``abort_run`` before a follower joined (the root failed in set-up): the follower that
    joins later gets the root's reason when the root leaves, at once (it got "closed the
    connection before Stop" without a reason, and the root's exit waited 2 s)."""
    spec = lamploop.model_spec(_module())
    address: list[tuple[str, int]] = []
    ready = anyio.Event()
    outcome: dict[str, BaseException | None] = {"root": None, "follower": None}
    root_left_at: list[float] = []

    async def root_side() -> None:
        try:
            async with TcpControlRoot(port=0, nranks=2, token=TOKEN, model_spec=spec) as root:
                address.append(root.address[:2])
                ready.set()
                await root.abort_run(Boom("the root's set-up failed"))
                await anyio.sleep(1.0)  # the follower joins meanwhile
                raise Boom("the root's set-up failed")
        except Boom as exc:
            outcome["root"] = exc
        root_left_at.append(time.monotonic())

    async def follower_side() -> None:
        await ready.wait()
        host, port = address[0]
        try:
            async with TcpControlFollower(
                host=host, port=port, rank=1, nranks=2, token=TOKEN, model_spec=spec
            ) as follower:
                await follower.join()
        except PeerLostError as exc:
            outcome["follower"] = exc

    began = time.monotonic()
    with anyio.fail_after(BOUND_S):
        async with anyio.create_task_group() as group:
            group.start_soon(root_side)
            group.start_soon(follower_side)
    assert isinstance(outcome["root"], Boom)
    assert isinstance(outcome["follower"], PeerLostError), outcome
    assert "the root's set-up failed" in str(outcome["follower"]), str(outcome["follower"])
    assert root_left_at[0] - began < 1.0 + 1.5  # no 2 s wait for an Abort nobody sent
