"""A rank (or a whole run) of tests/test_acceptance_design_contract_r2.py, in a process of its own.

Usage::

    python design_r2_worker.py follow SPEC OUT PORT TOKEN   # rank 1 over TCP control + Gloo
    python design_r2_worker.py stall OUT                    # fit() on a stream that stops yielding
    python design_r2_worker.py torchrun SPEC OUT            # fit() under torchrun (RANK, WORLD_SIZE)

``SPEC`` is a record written by the test (``workers.records``: JSON and safetensors, no pickle);
``OUT`` is where this process writes what it saw and ended with, the same way.  Written from
DESIGN.md and the docs alone; the test holds the float64 reference the results are compared with.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for workers.records

import lamploop
from lamploop.control import TcpControlFollower
from lamploop.modelspec import model_spec
from workers.records import load_record, save_record, write_whole


def linear_module(weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.Linear:
    module = torch.nn.Linear(weight.shape[1], weight.shape[0], dtype=torch.float64)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
    return module


def squared_error(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """DESIGN.md section 1: "SupervisedModel: module + loss -> (loss sum, example count)"."""
    return ((output - target) ** 2).sum(), int(target.shape[0])


def command_record(command: Any) -> list[Any]:
    kind = type(command).__name__
    if kind == "Train":
        return [kind, command.epoch, command.lr_factor]
    if kind == "Valid":
        return [kind, command.epoch]
    return [kind, str(getattr(command, "reason", ""))]


class RecordingFollower(TcpControlFollower):
    """The TCP follower, unchanged, that also notes every command it hands on."""

    def __init__(self, seen: list[list[Any]], **keywords: Any) -> None:
        super().__init__(**keywords)
        self.seen = seen

    async def join(self):  # type: ignore[override]
        rendezvous, commands = await super().join()

        async def recorded():
            async for command in commands:
                self.seen.append(command_record(command))
                yield command

        return rendezvous, recorded()


def listed(per_rank: list[list[list[torch.Tensor]]], contexts: list, sleep: dict | None = None):
    def make(context: lamploop.BatchContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
        contexts.append([context.epoch, context.rank, context.nranks])
        if sleep is not None and context.epoch == sleep["epoch"]:
            time.sleep(sleep["seconds"])  # a long "step" on this rank's training thread
        return [(x, y) for x, y in per_rank[context.rank]]

    return lamploop.iterable_batches(make)


async def follow(spec: dict[str, Any], out: str, port: int, token: str) -> None:
    seen: list[list[Any]] = []
    train_contexts: list = []
    valid_contexts: list = []
    # not the root's initial values, on purpose: DESIGN section 4, followers start from the root's
    module = linear_module(spec["weight"] * -3.0 + 1.0, spec["bias"] + 5.0)
    keywords: dict[str, Any] = {}
    if spec.get("follower_lr") is not None:
        lr, momentum = spec["follower_lr"]
        keywords["optimizer_factory"] = lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)
    result: dict[str, Any] = {}
    try:
        async with RecordingFollower(
            seen,
            host="127.0.0.1",
            port=port,
            rank=1,
            nranks=2,
            token=token,
            model_spec=model_spec(module),
        ) as control:
            write_whole(Path(out + ".joined"), "joined")
            returned = await follow_distributed_training_with(
                control, module, spec, train_contexts, valid_contexts, keywords
            )
            result["returned_none"] = returned is None
    except BaseException as error:
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = "".join(traceback.format_exception(error))
    result.update(
        commands=seen,
        train_contexts=train_contexts,
        valid_contexts=valid_contexts,
        weight=module.weight.detach().clone(),
        bias=module.bias.detach().clone(),
    )
    save_record(result, out)


async def follow_distributed_training_with(control, module, spec, train_contexts, valid_contexts, keywords):
    return await lamploop.follow_distributed_training(
        rank=1,
        nranks=2,
        device="cpu",
        control=control,
        model=lamploop.SupervisedModel(module, squared_error),
        train_batches=listed(spec["train"], train_contexts, spec.get("sleep")),
        validation_batches=listed(spec["valid"], valid_contexts),
        accumulate_gradient_over_n_batches=spec["k"],
        **keywords,
    )


def stall(out: str) -> None:
    """fit() whose training stream yields two batches, then waits for data that never comes."""
    marker = Path(out + ".waiting")

    async def batches(context: lamploop.BatchContext):
        x = torch.ones(2, 3, dtype=torch.float64)
        y = torch.zeros(2, 1, dtype=torch.float64)
        yield x, y
        yield x, y
        write_whole(marker, "waiting")
        await anyio.sleep_forever()

    class Stream:
        def __init__(self, context: lamploop.BatchContext) -> None:
            self.context = context

        def __aiter__(self):
            return batches(self.context)

    module = torch.nn.Linear(3, 1, dtype=torch.float64)
    result: dict[str, Any] = {}
    try:
        state = lamploop.fit(
            model=lamploop.SupervisedModel(module, squared_error),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=Stream,
            max_epochs=3,
            device="cpu",
            reporters=[],
        )
        result["epoch"] = None if state is None else state.epoch
    except BaseException as error:
        result["error"] = f"{type(error).__name__}: {error}"
    save_record(result, out)


def under_torchrun(spec: dict[str, Any], out: str) -> None:
    """fit() as a script under torchrun: lamploop reads RANK / WORLD_SIZE / LOCAL_RANK itself."""
    rank = int(os.environ["RANK"])
    module = linear_module(spec["weight"], spec["bias"])
    contexts: list = []
    result: dict[str, Any] = {"env_rank": rank}
    try:
        state = lamploop.fit(
            model=lamploop.SupervisedModel(module, squared_error),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=spec["lr"]),
            train_batches=listed(spec["train"], contexts),
            max_epochs=spec["max_epochs"],
            device="cpu",
            reporters=[],
        )
        result["state_epoch"] = None if state is None else state.epoch
        result["losses"] = None if state is None else [e.training_loss for e in state.learning_curve]
    except BaseException as error:
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = "".join(traceback.format_exception(error))
    result.update(contexts=contexts, weight=module.weight.detach().clone(), bias=module.bias.detach().clone())
    save_record(result, f"{out}.rank{rank}")


def main() -> None:
    torch.set_num_threads(1)
    mode = sys.argv[1]
    if mode == "follow":
        spec = load_record(sys.argv[2])
        anyio.run(follow, spec, sys.argv[3], int(sys.argv[4]), sys.argv[5])
    elif mode == "stall":
        stall(sys.argv[2])
    elif mode == "torchrun":
        under_torchrun(load_record(sys.argv[2]), sys.argv[3])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
