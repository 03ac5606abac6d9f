"""One rank of tests/distributed/test_acceptance_docs_drivers.py, in a process of its own.

Usage::

    python acceptance_drivers_rank.py follow SPEC OUT RANK PORT TOKEN
    python acceptance_drivers_rank.py fit SPEC OUT
    python acceptance_drivers_rank.py local-nranks ROOT_NRANKS FOLLOWER_NRANKS OUT

``SPEC`` is a record written by the test (``workers.records``: JSON and safetensors, no
pickle: the model's shape, this run's data, the optimizer's settings); ``OUT`` is where this
rank writes what it ended with (its weights, or the error it raised), the same way.
``fit`` is started by the test as rank 0 and by lamploop itself
(``fit(world_size=2)`` runs the same command line again with ``LAMPLOOP_RANK`` set), so every
rank writes ``OUT.rank<r>``.

Written from the docs alone (docs/distributed.md, docs/control-channel.md); the test holds the
reference that the results are compared with.
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
from lamploop.state import converter
from workers.records import load_record, save_record


def build_module(hidden: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    """The model every rank trains: a small MLP, its initial values drawn from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)).to(
        dtype
    )


def squared_error(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A loss as SupervisedModel wants it: (sum of squared errors, example count)."""
    return ((output - target) ** 2).sum(), int(target.shape[0])


def listed_batches(per_rank_epochs: list[list[list[tuple[torch.Tensor, torch.Tensor]]]]) -> Any:
    """A stream factory that hands rank r in epoch e the batches ``per_rank_epochs[r][e]``."""
    return lamploop.iterable_batches(lambda context: list(per_rank_epochs[context.rank][context.epoch]))


def _error_record(error: BaseException) -> dict[str, Any]:
    return {
        "error_type": type(error).__name__,
        "error_mro": [cls.__name__ for cls in type(error).__mro__],
        "message": str(error),
        "rank": getattr(error, "rank", None),
        "traceback": "".join(traceback.format_exception(error)),
    }


async def _follow(spec: dict[str, Any], rank: int, port: int, token: str) -> dict[str, Any]:
    module = build_module(spec["hidden"], seed=100 + rank)  # not the root's values, on purpose
    model = lamploop.SupervisedModel(module, loss=squared_error)
    nranks = spec.get("follower_nranks", spec["nranks"])
    keywords: dict[str, Any] = dict(spec.get("follower_keywords", {}))
    if spec.get("follower_optimizer") is not None:
        lr, momentum = spec["follower_optimizer"]
        keywords["optimizer_factory"] = lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)
    try:
        async with TcpControlFollower(
            host="127.0.0.1",
            port=port,
            rank=rank,
            nranks=nranks,
            token=token,
            model_spec=lamploop.model_spec(module),
            connect_timeout=20.0,
        ) as control:
            await follow_with_timeout(
                rank=rank,
                nranks=nranks,
                device="cpu",
                control=control,
                model=model,
                train_batches=listed_batches(spec["train"]),
                validation_batches=listed_batches(spec["valid"]) if spec.get("valid") else None,
                **keywords,
            )
    except lamploop.errors.LamploopError as error:
        return _error_record(error)
    return {"state_dict": {name: value.detach().clone() for name, value in module.state_dict().items()}}


async def follow_with_timeout(**arguments: Any) -> None:
    with anyio.fail_after(45):  # a bound of our own: the test fails, the worker never hangs
        await lamploop.follow_distributed_training(**arguments)


def _fit(spec: dict[str, Any], out: Path) -> None:
    rank = int(os.environ.get("LAMPLOOP_RANK", "0"))
    module = build_module(spec["hidden"], seed=200 + rank)
    if rank == 0:
        module.load_state_dict(spec["init"])
    model = lamploop.SupervisedModel(module, loss=squared_error)
    features, target = spec["features"], spec["target"]
    lr, momentum = spec["optimizer"]
    seen: list[lamploop.LoopState] = []
    result = lamploop.fit(
        model=model,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum),
        train_batches=lamploop.tensor_batches(features, target, batch_size=spec["batch_size"], shuffle=False),
        max_epochs=spec["max_epochs"],
        device="cpu",
        world_size=2,
        on_epoch=seen.append,
        reporters=[],
        accumulate_gradient_over_n_batches=spec["k"],
    )
    record = {
        "rank": rank,
        "returned": None if result is None else converter.unstructure(result),
        "on_epoch": [converter.unstructure(state) for state in seen],
        "world_size_env": os.environ.get("LAMPLOOP_WORLD_SIZE"),
        "state_dict": {name: value.detach().clone() for name, value in module.state_dict().items()},
    }
    save_record(record, f"{out}.rank{rank}")


async def _local_nranks(root_nranks: int, follower_nranks: int) -> dict[int, Any]:
    """Root and rank 1 over ``local_control(2)``, one of them told another world size."""
    from lamploop.control import local_control

    features = torch.zeros(4, 3, dtype=torch.float64)
    batches = lamploop.iterable_batches(lambda context: [(features, features[:, :1])])
    root, followers = local_control(2, join_timeout=30.0)
    results: dict[int, Any] = {}

    async def follow() -> None:
        try:
            async with followers[0] as control:
                await lamploop.follow_distributed_training(
                    rank=1,
                    nranks=follower_nranks,
                    device="cpu",
                    control=control,
                    model=lamploop.SupervisedModel(build_module(4, seed=1), loss=squared_error),
                    train_batches=batches,
                    validation_batches=None,
                )
        except Exception as error:
            results[1] = _error_record(error)

    async def drive() -> None:
        try:
            async with root:
                await lamploop.drive_distributed_training(
                    nranks=root_nranks,
                    device="cpu",
                    control=root,
                    model=lamploop.SupervisedModel(build_module(4), loss=squared_error),
                    optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                    train_batches=batches,
                    validation_batches=None,
                    max_epochs=1,
                )
        except Exception as error:
            results[0] = _error_record(error)

    began = time.monotonic()  # after the imports, which a loaded machine makes slow
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(follow)
        tasks.start_soon(drive)
    for record in results.values():
        record["took_s"] = time.monotonic() - began
    return results


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    mode = argv[1]
    if mode == "local-nranks":
        save_record(anyio.run(_local_nranks, int(argv[2]), int(argv[3])), argv[4])
        return 0
    spec_path, out = argv[2], Path(argv[3])
    spec = load_record(spec_path)
    if mode == "follow":
        rank, port, token = int(argv[4]), int(argv[5]), argv[6]
        record = anyio.run(_follow, spec, rank, port, token)
        save_record(record, out)
        return 0
    if mode == "fit":
        _fit(spec, out)
        return 0
    print(f"unknown mode {mode!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
