"""Worker of tests/test_acceptance_docs_howto_resume.py: one `lamploop.fit` run of docs/how-to/resume.md.

    python howto_resume_worker.py fit OUT_DIR RECORD [--ready FILE] [--step-seconds S]
    python howto_resume_worker.py follower PORT RECORD [--strategy S] [--batch-sleep S]
    torchrun ... howto_resume_worker.py torchrun OUT_DIR RECORD_DIR

Trains the small float64 model of :func:`train` with ``checkpoint_dir=OUT_DIR``. With
``--ready FILE`` the forward pass of epoch 1's 4th step writes FILE, then sleeps S seconds
(``--step-seconds``), then writes ``FILE.done``: a step of known length is in progress while
the test signals. The outcome goes to RECORD as JSON (records.py): ``{"outcome": "done" |
"interrupted" | "<exception class>", "epoch", "steps_done", "reason", "message", "ended_at",
"params"}``.

``follower``: rank 1 of multi-node.md's by-hand recipe (``TcpControlFollower`` +
``follow_distributed_training``, the token in ``LAMPLOOP_TOKEN``) against a root at
127.0.0.1:PORT that the test runs; its outcome and parameters go to RECORD.

``torchrun``: every rank of a torchrun launch runs the same ``fit`` (:func:`under_torchrun`);
each writes ``RECORD_DIR/rank<R>-restart<N>.json``.

:func:`train` is imported by the test too, to compute the uninterrupted run in its own process.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

import lamploop

try:  # imported by the test: tests/ is on sys.path
    from workers.records import save_record
except ImportError:  # run as a script: this folder is sys.path[0]
    from records import save_record

STEPS_PER_EPOCH = 12  # 48 examples in batches of 4
MAX_EPOCHS = 3


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(48, 5, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (48,), generator=generator)
    return x, y


class SlowAt(torch.nn.Module):
    """An identity that marks one training step: at its ``at``-th training forward (counted from
    1 over the whole run) it writes ``ready`` (with the time), sleeps ``seconds`` and writes
    ``ready.done`` when it wakes; a step of known length in progress when the test signals."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0
        self.at = 0
        self.calls = 0
        self.ready: Path | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.ready is not None and self.calls == self.at:
                self.ready.write_text(repr(time.time()))
                time.sleep(self.seconds)
                Path(f"{self.ready}.done").write_text(repr(time.time()))
        return x


def make_module() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 16),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),  # the restored RNG states matter
        SlowAt(),
        torch.nn.Linear(16, 3),
    ).double()


def train(
    directory: Path | None,
    *,
    max_epochs: int = MAX_EPOCHS,
    ready: Path | None = None,
    ready_at: int = STEPS_PER_EPOCH + 4,
    step_seconds: float = 0.0,
    **keywords: Any,
) -> tuple[lamploop.LoopState | None, torch.nn.Module]:
    """One ``fit`` call; the state and the trained module.

    With ``ready``, the ``ready_at``-th training step of this call (default: epoch 1's 4th in a
    fresh run) writes ``ready`` and lasts ``step_seconds`` more (see :class:`SlowAt`).
    """
    x, y = data()
    module = make_module()
    slow = module[3]
    slow.ready, slow.at, slow.seconds = ready, ready_at, step_seconds
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        train_batches=lamploop.tensor_batches(x, y, batch_size=4, seed=3),
        validation_batches=lamploop.tensor_batches(x[:16], y[:16], batch_size=8, shuffle=False),
        max_epochs=max_epochs,
        checkpoint_dir=directory,
        reporters=[],
        **keywords,
    )
    return state, module


def tcp_model(seed: int) -> lamploop.SupervisedModel:
    """The model of the by-hand TCP runs (multi-node.md): each rank seeds it differently."""
    torch.manual_seed(seed)
    return lamploop.SupervisedModel(
        torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    )


def tcp_batches(batch_sleep: float) -> lamploop.BatchStreamFactory:
    """The by-hand runs' training data; each batch takes ``batch_sleep`` s to come (a long run)."""
    x, y = data()
    inner = lamploop.tensor_batches(x.float(), y, batch_size=4, seed=1)

    def factory(context: lamploop.BatchContext) -> Any:
        async def stream() -> Any:
            async for batch in inner(context):
                await anyio.sleep(batch_sleep)
                yield batch

        return stream()

    return factory


async def follower(port: int, record: str, strategy: str | None, batch_sleep: float) -> None:
    """Rank 1 of 2 of multi-node.md's by-hand recipe (the token comes from the environment);
    ``strategy`` is passed only when given (the page's recipe passes none)."""
    model = tcp_model(seed=1)
    settings = {} if strategy is None else {"strategy": strategy}
    result: dict[str, Any] = {"outcome": "done"}
    try:
        async with lamploop.TcpControlFollower(
            host="127.0.0.1",
            port=port,
            rank=1,
            nranks=2,
            token=os.environ["LAMPLOOP_TOKEN"],
            model_spec=lamploop.model_spec(model.module),
            connect_timeout=30,
        ) as control:
            await lamploop.follow_distributed_training(
                rank=1,
                nranks=2,
                device="cpu",
                control=control,
                model=model,
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                train_batches=tcp_batches(batch_sleep),
                validation_batches=None,
                **settings,
            )
    except Exception as error:
        result.update(outcome=type(error).__name__, message=str(error))
    result["params"] = {name: tensor.detach().clone() for name, tensor in model.module.state_dict().items()}
    save_record(result, record)


def torchrun_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(21)
    return torch.randn(64, 5, generator=generator), torch.randint(0, 3, (64,), generator=generator)


def torchrun_model(rank: int) -> torch.nn.Module:
    torch.manual_seed(100 + rank)  # the root's weights are sent to every rank anyway
    return torch.nn.Linear(5, 3)


TORCHRUN_EPOCHS = 4


def under_torchrun(out: Path, records: Path) -> None:
    """multi-node.md's script under torchrun: the same ``fit`` call on every rank. In the first
    attempt (``TORCHELASTIC_RESTART_COUNT`` 0) rank 1 dies (exit 3) as epoch 2 starts."""
    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    x, y = torchrun_data()
    inner = lamploop.tensor_batches(x, y, batch_size=8, seed=2)
    trained: list[int] = []

    def train_batches(context: lamploop.BatchContext) -> Any:
        if restart == 0 and rank == 1 and context.epoch == 2:
            os._exit(3)
        trained.append(context.epoch)
        return inner(context)

    module = torchrun_model(rank)
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=train_batches,
        max_epochs=TORCHRUN_EPOCHS,
        device="cpu",
        checkpoint_dir=out,
        reporters=[],
    )
    result = {
        "rank": rank,
        "restart": restart,
        "state_is_none": state is None,
        "epochs": None if state is None else [entry.epoch for entry in state.learning_curve],
        "trained": trained,
        "params": {name: tensor.detach().clone() for name, tensor in module.state_dict().items()},
    }
    save_record(result, records / f"rank{rank}-restart{restart}.json")


def main(argv: list[str]) -> int:
    """Run the mode of ``argv``; the outcome goes to the record, with when it came (``time.time()``)."""
    mode = argv[0]
    if mode == "torchrun":
        under_torchrun(Path(argv[1]), Path(argv[2]))
        return 0
    if mode == "follower":
        strategy = argv[argv.index("--strategy") + 1] if "--strategy" in argv else None
        batch_sleep = float(argv[argv.index("--batch-sleep") + 1]) if "--batch-sleep" in argv else 0.0
        anyio.run(follower, int(argv[1]), argv[2], strategy, batch_sleep)
        return 0
    out, record = Path(argv[1]), argv[2]
    assert mode == "fit", mode
    ready = Path(argv[argv.index("--ready") + 1]) if "--ready" in argv else None
    step_seconds = float(argv[argv.index("--step-seconds") + 1]) if "--step-seconds" in argv else 0.0
    result: dict[str, Any] = {"outcome": "done", "epoch": None, "steps_done": None, "reason": None}
    module = None
    try:
        state, module = train(out, ready=ready, step_seconds=step_seconds)
        result["epoch"] = None if state is None else state.epoch
    except lamploop.errors.TrainingInterrupted as error:
        result.update(
            outcome="interrupted",
            epoch=error.epoch,
            steps_done=error.steps_done,
            reason=str(error.reason),
            message=str(error),
        )
        result["ended_at"] = time.time()
    except BaseException as error:  # the second signal: whatever "stops at once" raises
        result.update(outcome=type(error).__name__, message=str(error), ended_at=time.time())
        save_record(result, record)
        raise
    if module is not None:
        result["params"] = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    result["ended_at"] = time.time()
    save_record(result, record)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main(sys.argv[1:]))
