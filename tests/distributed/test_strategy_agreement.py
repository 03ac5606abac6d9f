"""Ranks started by hand agree on the strategy ``"auto"`` resolves to (docs/concepts/sync-strategies.md).

``"auto"`` is ``all_reduce`` when every rank has an optimizer, else ``reduce_to_root``; the
ranks resolve it before they compare, so a root asking for ``"auto"`` and a follower naming
``"all_reduce"`` (with its optimizer factory) train together, exactly as two ranks asking for
``"all_reduce"``; resolved strategies that differ are refused on every rank, naming both.

Both ranks run in this process, each on its own thread of training, over the TCP control
channel and a Gloo group on 127.0.0.1 (no mocks).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

import lamploop
from lamploop.control import TcpControlFollower, TcpControlRoot
from lamploop.errors import DistributedError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

RUN_WITHIN_S = 60.0
TOKEN = "strategy agreement"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def _batches(context: lamploop.BatchContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 * context.epoch + context.rank)
    return [
        (
            torch.randn(4, 3, generator=generator, dtype=torch.float64),
            torch.randint(0, 2, (4,), generator=generator),
        )
        for _ in range(3)
    ]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


async def _train(root_strategy: str, follower_strategy: str) -> dict[int, Any]:
    """Two ranks, two epochs; each rank's final state dict, or the error it raised."""
    modules = {0: _module(0), 1: _module(1)}
    outcome: dict[int, Any] = {}
    spec = lamploop.model_spec(modules[0])
    listening = anyio.Event()
    ports: list[int] = []

    async def drive() -> None:
        try:
            async with TcpControlRoot(host="127.0.0.1", nranks=2, token=TOKEN, model_spec=spec) as root:
                ports.append(root.address[1])
                listening.set()
                await lamploop.drive_distributed_training(
                    nranks=2,
                    device="cpu",
                    control=root,
                    model=lamploop.SupervisedModel(modules[0]),
                    optimizer_factory=_sgd,
                    train_batches=lamploop.iterable_batches(_batches),
                    validation_batches=None,
                    max_epochs=2,
                    strategy=root_strategy,
                )
        except Exception as exc:
            outcome[0] = exc
        else:
            outcome[0] = modules[0].state_dict()
        finally:
            listening.set()

    async def follow() -> None:
        await listening.wait()
        try:
            async with TcpControlFollower(
                host="127.0.0.1", port=ports[0], rank=1, nranks=2, token=TOKEN, model_spec=spec
            ) as control:
                await lamploop.follow_distributed_training(
                    rank=1,
                    nranks=2,
                    device="cpu",
                    control=control,
                    model=lamploop.SupervisedModel(modules[1]),
                    optimizer_factory=_sgd,
                    train_batches=lamploop.iterable_batches(_batches),
                    validation_batches=None,
                    strategy=follower_strategy,
                )
        except Exception as exc:
            outcome[1] = exc
        else:
            outcome[1] = modules[1].state_dict()

    with anyio.fail_after(RUN_WITHIN_S):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(follow)
            tasks.start_soon(drive)
    return outcome


def _assert_trained_alike(got: dict[int, Any], expected: dict[int, Any]) -> None:
    for rank in (0, 1):
        assert not isinstance(got[rank], BaseException), f"rank {rank} raised {got[rank]!r}"
        for name, value in expected[rank].items():
            assert torch.equal(got[rank][name], value), f"rank {rank}: {name}"


@pytest.mark.parametrize(("root", "follower"), [("auto", "all_reduce"), ("all_reduce", "auto")])
async def test_auto_on_one_rank_agrees_with_the_strategy_it_resolves_to(root: str, follower: str) -> None:
    reference = await _train("all_reduce", "all_reduce")
    got = await _train(root, follower)
    _assert_trained_alike(got, reference)
    # all_reduce steps on every rank: the follower ends with the root's parameters
    for name, value in got[0].items():
        assert torch.equal(got[1][name], value), name


async def test_auto_resolving_to_another_strategy_is_refused_naming_both() -> None:
    # Every rank has an optimizer: the root's "auto" is all_reduce, not the follower's choice.
    got = await _train("auto", "reduce_to_root")
    for rank in (0, 1):
        error = got[rank]
        assert isinstance(error, DistributedError), f"rank {rank}: {error!r}"
        message = str(error)
        assert "the ranks disagree on the sync strategy" in message, message
        assert "rank 0's \"all_reduce ('auto' resolved)\"" in message, message
        assert "rank 1 has 'reduce_to_root'" in message, message


async def test_named_strategies_that_differ_are_still_refused() -> None:
    got = await _train("reduce_to_root", "all_reduce")
    for rank in (0, 1):
        error = got[rank]
        assert isinstance(error, DistributedError), f"rank {rank}: {error!r}"
        assert "rank 0's 'reduce_to_root'" in str(error), str(error)
        assert "rank 1 has 'all_reduce'" in str(error), str(error)
