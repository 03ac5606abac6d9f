"""One rank of ``fit(world_size=n)`` with one fault (tests/test_acceptance_no_hangs_r3.py).

``python no_hangs_r3_worker.py WHERE RANK WORLD OUT``: the rank ``RANK`` raises ``Boom`` at
``WHERE`` (``backward``, ``optimizer-step``, ``schedule``, ``validation``, ``forward``) in epoch 1;
every rank writes ``OUT/rank<r>.json`` with how it ended and its pid to ``OUT/pid-rank<r>``.
``fit`` starts ranks ``1..WORLD-1`` by running this command line again.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import lamploop


class Boom(Exception):
    pass


def main() -> int:
    where, failing, world, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    rank = int(os.environ.get("LAMPLOOP_RANK", "0"))
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    message = f"injected in {where} on rank {rank}"
    state = {"epoch": -1, "forwards": 0}
    mine = rank == failing

    class RaiseInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
            raise Boom(message)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.fc(x)
            if self.training:
                state["forwards"] += 1
                if mine and state["epoch"] == 1 and state["forwards"] == 2:
                    if where == "backward":
                        out = RaiseInBackward.apply(out)
                    if where == "forward":
                        raise Boom(message)
            elif mine and state["epoch"] == 1 and where == "validation":
                raise Boom(message)
            return out

    class SGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            if mine and state["epoch"] == 1 and where == "optimizer-step":
                raise Boom(message)
            return super().step(closure)

    class Schedule(lamploop.LearningRateSchedule):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.inner = lamploop.noop()

        @property
        def needs_validation_loss(self) -> bool:
            return False

        @property
        def state_type(self) -> Any:
            return self.inner.state_type

        def init(self) -> Any:
            return self.inner.init()

        def learning_rate_factor(self, s: Any, epoch: int, last: float | None) -> Any:
            if mine and epoch == 1 and where == "schedule":
                raise Boom(message)
            return self.inner.learning_rate_factor(s, epoch, last)

    torch.manual_seed(1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def train(context: lamploop.BatchContext) -> Any:
        async def stream() -> Any:
            state["epoch"], state["forwards"] = context.epoch, 0
            for i in range(4):
                yield x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]

        return stream()

    def valid(context: lamploop.BatchContext) -> Any:
        async def stream() -> Any:
            state["epoch"] = context.epoch
            yield x, y

        return stream()

    record: dict[str, Any]
    try:
        lamploop.fit(
            model=lamploop.SupervisedModel(Net(), lamploop.mse_loss),
            optimizer_factory=lambda params: SGD(params, lr=0.05),
            train_batches=train,
            validation_batches=valid,
            max_epochs=3,
            world_size=world,
            device="cpu",
            learning_rate_schedule=Schedule(),
            reporters=[],
        )
        record = {"error": None}
    except BaseException as exc:
        record = {
            "error": type(exc).__name__,
            "message": str(exc),
            "rank": getattr(exc, "rank", None),
            "cause": repr(exc.__cause__),
        }
    record["at"] = time.time()
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    gc.freeze()
    return 0 if record["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
