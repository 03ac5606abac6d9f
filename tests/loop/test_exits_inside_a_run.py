"""``sys.exit`` and ``KeyboardInterrupt`` raised inside a run leave ``fit`` as themselves.

The run's task groups wrapped them in a ``BaseExceptionGroup``: ``sys.exit(3)`` in a forward
made the process exit with status 1 (an uncaught group), and ``except KeyboardInterrupt``
around ``fit`` did not catch a ``KeyboardInterrupt`` raised inside it.
"""

from __future__ import annotations

import pytest
import torch

import lamploop


class Leaving(torch.nn.Module):
    """A linear model whose third forward raises ``leaving``."""

    def __init__(self, leaving: BaseException) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.leaving = leaving
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3:
            raise self.leaving
        return self.linear(x)


def _fit(module: torch.nn.Module) -> None:
    lamploop.fit(
        model=lamploop.SupervisedModel(module, lamploop.cross_entropy_loss),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(torch.randn(32, 4), torch.randint(0, 2, (32,)), batch_size=8),
        validation_batches=None,
        max_epochs=2,
        reporters=[],
    )


@pytest.mark.timeout(60)
def test_sys_exit_in_a_forward_leaves_fit_as_itself() -> None:
    with pytest.raises(SystemExit) as caught:
        _fit(Leaving(SystemExit(3)))
    assert caught.value.code == 3


@pytest.mark.timeout(60)
def test_a_keyboard_interrupt_in_a_forward_leaves_fit_as_itself() -> None:
    with pytest.raises(KeyboardInterrupt):
        _fit(Leaving(KeyboardInterrupt()))
