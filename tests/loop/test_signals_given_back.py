"""A run gives back the SIGTERM and SIGINT handlers its caller had installed.

A run handles both signals while it runs (a stop at the next step boundary); leaving, the
signal receiver set the signals' defaults back, so a caller's own handlers (a service that
shuts down on SIGTERM, a notebook's SIGINT) were silently lost after any run, signalled or not.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import torch

import lamploop


@pytest.fixture
def callers_handlers() -> Iterator[dict[int, object]]:
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}

    def mine(_signum: int, _frame: object) -> None:
        """The caller's handler."""

    for signum in before:
        signal.signal(signum, mine)
    try:
        yield dict.fromkeys(before, mine)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_fit_gives_back_the_callers_signal_handlers(callers_handlers: dict[int, object]) -> None:
    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(4, 2), lamploop.cross_entropy_loss),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(torch.randn(16, 4), torch.randint(0, 2, (16,)), batch_size=8),
        validation_batches=None,
        max_epochs=1,
        reporters=[],
    )
    for signum, handler in callers_handlers.items():
        assert signal.getsignal(signum) is handler, signal.Signals(signum).name


@pytest.mark.timeout(60)
def test_a_run_without_a_callers_handler_leaves_the_defaults() -> None:
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(4, 2), lamploop.cross_entropy_loss),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=lamploop.tensor_batches(
                torch.randn(16, 4), torch.randint(0, 2, (16,)), batch_size=8
            ),
            validation_batches=None,
            max_epochs=1,
            reporters=[],
        )
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
