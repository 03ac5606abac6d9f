"""A run of ``lamploop.fit(world_size=2)`` for tests/test_acceptance_docs_r3.py.

Usage: ``python acceptance_r3_worker.py OUT_DIR``.  This process becomes rank 0 and, as
docs/getting-started.md says ("Several processes on this machine: fit(..., world_size=2)"),
fit runs the same command line again for rank 1.  A float64 model with an accuracy metric
trains one epoch on uneven shares (9 training batches, 7 validation batches), accumulating 2
batches per step and clipping the gradient, with SGD and momentum; each rank
writes what it saw with :func:`records.save_record`: rank 0 ``OUT_DIR/root`` (the state, the
final weights, the events), a follower ``OUT_DIR/follower`` (its reporter's counts).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from records import save_record

import lamploop
from lamploop.metrics import accuracy
from lamploop.reporting import events
from lamploop.state import converter

N_TRAIN, N_VALID, BATCH, LR, MOMENTUM, ACCUMULATE, MAX_NORM = 72, 50, 8, 0.2, 0.9, 2, 0.5


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(N_TRAIN + N_VALID, 5, generator=generator, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def make_module() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()


class Recorder:
    def __init__(self) -> None:
        self.started = 0
        self.closed = 0
        self.events: list[dict] = []

    def start(self) -> None:
        self.started += 1

    def report(self, event: object) -> None:
        row: dict = {"type": type(event).__name__}
        if isinstance(event, events.PeerJoined):
            row.update(rank=event.rank, nranks=event.nranks, address=str(event.address))
        elif isinstance(event, events.RunStarted):
            row.update(nranks=event.nranks, epoch=event.epoch, max_epochs=event.max_epochs)
        elif isinstance(event, events.ValidationFinished):
            row.update(loss=float(event.loss), metrics={k: float(v) for k, v in dict(event.metrics).items()})
        elif isinstance(event, events.EpochFinished):
            row.update(steps=event.steps, examples=event.examples)
        self.events.append(row)

    def close(self) -> None:
        self.closed += 1


def main() -> None:
    out = Path(sys.argv[1])
    x, y, xv, yv = data()
    module = make_module()
    recorder = Recorder()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, lamploop.cross_entropy_loss, metrics={"accuracy": accuracy}),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
        train_batches=lamploop.tensor_batches(x, y, batch_size=BATCH, shuffle=False),
        validation_batches=lamploop.tensor_batches(xv, yv, batch_size=BATCH, shuffle=False),
        max_epochs=1,
        accumulate_gradient_over_n_batches=ACCUMULATE,
        max_gradient_norm=MAX_NORM,
        world_size=2,
        device="cpu",
        reporters=[recorder],
    )
    if state is None:
        save_record(
            {"started": recorder.started, "closed": recorder.closed, "events": recorder.events},
            out / "follower",
        )
        return
    save_record(
        {
            "state": converter.unstructure(state),
            "module": {name: tensor.detach().clone() for name, tensor in module.state_dict().items()},
            "started": recorder.started,
            "closed": recorder.closed,
            "events": recorder.events,
        },
        out / "root",
    )


if __name__ == "__main__":
    main()
