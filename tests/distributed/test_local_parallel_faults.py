"""``local_data_parallel_training_loop``: an error in any replica ends every replica with it.

The replicas are threads of one process; the one that fails leaves the others waiting in
a collective it will never join.  Their waits are aborted, and the first error is raised,
within seconds, not after the collective timeout.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import pytest
import torch
from workers import rank as worker

import lamploop
from lamploop.batches import BatchContext
from lamploop.errors import BatchError, NonFiniteLossError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

ENDS_WITHIN_S = 5.0
DATA = {"seed": 31, "batches": [12, 12, 12]}


def _failing_stream(bad_rank: int, bad_epoch: int, bad_batch: int, bad: str) -> lamploop.BatchStreamFactory:
    def factory(context: BatchContext) -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        async def stream() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
            for i, (x, y) in enumerate(worker.train_batches_of(DATA, context.epoch, context.rank)):
                worker.busy(0.005)
                if (context.rank, context.epoch, i) == (bad_rank, bad_epoch, bad_batch):
                    if bad == "empty":
                        x, y = x[:0], y[:0]
                    else:
                        x = torch.full_like(x, float("nan"))
                yield x, y

        return stream()

    return factory


@pytest.mark.parametrize(
    ("bad_rank", "bad", "error"),
    [(2, "empty", BatchError), (0, "empty", BatchError), (1, "nan", NonFiniteLossError)],
)
async def test_an_error_in_one_replica_ends_all_of_them_with_that_error(
    bad_rank: int, bad: str, error: type[Exception]
) -> None:
    modules = [worker.make_module({"seed": 2}, rank) for rank in range(3)]
    train = _failing_stream(bad_rank, 1, 5, bad)
    started = time.monotonic()
    with pytest.raises(error) as info, anyio.fail_after(40):
        await lamploop.local_data_parallel_training_loop(
            [(lamploop.SupervisedModel(m), train, None) for m in modules],
            worker.optimizer_factory({"name": "sgd", "lr": 0.05}),
            4,
        )
    took = time.monotonic() - started
    where = "epoch 1, batch 5" + ("" if bad_rank == 0 else f" on rank {bad_rank}")
    if bad == "empty":
        assert where in str(info.value)
    # Two epochs of 12 small batches take well under a second: all of the rest is the ending.
    assert took < ENDS_WITHIN_S, f"took {took:.1f} s: {info.value}"


async def test_an_error_only_the_root_finds_is_raised_as_it_is_every_time() -> None:
    """Only the root runs the epochs' checks (a plateau schedule without validation).  Told of
    its failure, a follower ended first, the task group cancelled the root's unwinding, and the
    loop raised the follower's ``PeerLostError`` quoting the error instead of the error: 18 of
    200 runs before (CI, test_acceptance_docs_concepts).  Forty runs, each must raise it."""
    x, y = torch.randn(16, 2), torch.randint(0, 2, (16,))
    train = lamploop.tensor_batches(x, y, batch_size=4)
    raised: list[str] = []
    for _ in range(40):
        replicas = [(lamploop.SupervisedModel(torch.nn.Linear(2, 2)), train, None) for _ in range(2)]
        with anyio.fail_after(20):
            try:
                await lamploop.local_data_parallel_training_loop(
                    replicas,
                    lambda params: torch.optim.SGD(params, lr=0.1),
                    2,
                    learning_rate_schedule=lamploop.reduce_lr_on_plateau(),
                )
            except Exception as exc:  # the kinds raised are what the test counts
                raised.append(type(exc).__name__)
    assert raised == ["ConfigurationError"] * 40, sorted(set(raised))
